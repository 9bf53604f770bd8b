"""A smaller card on a bigger GPU: the bench's rows capped at a card's memory, and their two peaks.

A budget is the memory of a card, and on a card it is the caching allocator, not
``torch.cuda.max_memory_allocated``, that runs out: blocks it reserved and cannot reuse
(fragmentation), the optimizer step's temporaries, a planner's own calibration. The bench tells
the truth about a card by running each row in a process whose allocator may reserve no more than
the card holds, with :func:`torch.cuda.set_per_process_memory_fraction` (``card / total_memory``):
as on a real card, the allocator then frees its cached blocks and retries before it raises
``OutOfMemoryError``, and the row is recorded as ``oom``. Each row records both peaks,
``max_memory_allocated`` (what remat's plans predict) and ``max_memory_reserved`` (what the card
must hold).

The cap covers what the allocator may reserve; the CUDA context (some hundreds of MiB) lies outside
it, so an emulated card is that much kinder than a real one whose ``total_memory`` includes the
context. A card is a size as :func:`remat.units.parse_size` reads it: ``79.2GiB`` is what an H100
80GB shows CUDA, ``80GB`` is 74.5 GiB (decimal gigabytes).

Bad input is refused before anything runs (ValueError): a size that does not parse, a card larger
than the GPU (a cap can only take memory away: the rows would not be what that card gives, so the
bench does not run them uncapped and call it that card), a cap asked for without a CUDA GPU.

:func:`capped` sets the cap for a region and puts the previous fraction back on exit, so a library
caller's process is left as it was.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from remat.units import format_size, parse_budget


@dataclass(frozen=True)
class Card:
    """A card emulated on one GPU."""

    bytes: int
    """What the card holds: the most the caching allocator may reserve."""
    gpu_bytes: int
    """The GPU's ``total_memory``."""
    device: int
    """The CUDA device index the cap is set on."""
    text: str = ""
    """The size as the user wrote it (``80GB``), for records and messages."""

    @property
    def fraction(self) -> float:
        return self.bytes / self.gpu_bytes

    def describe(self) -> str:
        written = f"--card {self.text}; " if self.text else ""
        return (f"card {format_size(self.bytes)} ({written}a cap of {self.fraction:.4f} of this GPU's "
                f"{format_size(self.gpu_bytes)})")


def parse_card(size, device="cuda") -> Optional[Card]:
    """The card ``size`` (bytes or a string such as ``"79.2GiB"``; None: no card) on ``device``.

    Raises ValueError for a size :func:`remat.units.parse_budget` refuses, for a ``device`` that is
    not a visible CUDA GPU, and for a card larger than the GPU, each naming what to do.

    >>> parse_card("15.5GiB")            # doctest: +SKIP
    Card(bytes=16642998272, gpu_bytes=150110011392, device=0, text='15.5GiB')
    """
    if size is None:
        return None
    try:
        card_bytes = parse_budget(size)
    except (ValueError, TypeError) as error:
        raise ValueError(f"--card takes a card's memory such as 80GB or 79.2GiB; {error}") from None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        where = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"the bench runs on {device}"
        raise ValueError(f"--card {size} caps a CUDA GPU's memory (torch.cuda.set_per_process_memory_fraction), "
                         f"and {where}; leave --card out, or run on a GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if card_bytes > total:
        raise ValueError(f"--card {size} ({format_size(card_bytes)}) is more than this GPU has "
                         f"({torch.cuda.get_device_name(index)}: {format_size(total)}): a cap can only emulate a "
                         "smaller card, and rows run uncapped would not be what that card gives. Leave --card out "
                         "to run on the whole GPU, or measure on a GPU at least that large.")
    return Card(bytes=card_bytes, gpu_bytes=total, device=index, text=str(size))


@contextlib.contextmanager
def capped(card: Optional[Card]):
    """Within the region the allocator reserves at most ``card.bytes`` (None: the whole GPU, where a
    cap is in force around it); the fraction in force before is put back on exit. The cached blocks
    are freed first, so that what an earlier region reserved does not count against this one.
    RuntimeError (naming the card) where the cap cannot be set."""
    if card is None:
        yield
        return
    before = _fraction(card.device)
    torch.cuda.empty_cache()
    _set(card.fraction, card)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        _set(before, card)


@contextlib.contextmanager
def uncapped(card: Optional[Card]):
    """The whole GPU within the region, where ``card`` caps the rest of the run (None: nothing to lift)."""
    if card is None:
        yield
        return
    whole = Card(bytes=card.gpu_bytes, gpu_bytes=card.gpu_bytes, device=card.device)
    with capped(whole):
        yield


def _fraction(device: int) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    return float(get(device)) if get is not None else 1.0


def _set(fraction: float, card: Card) -> None:
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(fraction)), card.device)
    except (RuntimeError, ValueError, TypeError) as error:
        raise RuntimeError(f"the {card.describe()} cannot be set on this GPU: {type(error).__name__}: {error}") from error


def peaks(cuda: bool) -> dict:
    """``{"peak_bytes": allocated peak, "reserved_peak_bytes": reserved peak}`` since the last
    reset ({} off CUDA: the CPU has no allocator statistics)."""
    if not cuda:
        return {}
    return {"peak_bytes": int(torch.cuda.max_memory_allocated()),
            "reserved_peak_bytes": int(torch.cuda.max_memory_reserved())}
