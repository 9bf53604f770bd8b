"""How much GPU memory a measurement may take: the card as this process sees it, and a cap for planning.

What: :func:`available_bytes` is what the caching allocator can still hand out on a device: the
least of the GPU's free memory plus what this process has cached, and the process's own limit
(``torch.cuda.set_per_process_memory_fraction``) less what it has allocated. :func:`card_bytes` is
the most this process may hold there. :func:`allocator_cap` lowers that limit for the length of a
block (planning for a budget measures inside it), then puts it back.

Why: ``torch.cuda.mem_get_info`` tells the GPU's free memory, not the process's limit: under a
card emulated with ``set_per_process_memory_fraction``, or a budget that planning must not exceed,
a measurement sized from it ran out of memory (the in-step calibration, a block's chain of
forwards). Inside :func:`allocator_cap` the allocator raises ``OutOfMemoryError`` where the budget
ends, as a card of that size would, after freeing its cache and retrying.

Limits: a torch without ``torch.cuda.memory.get_per_process_memory_fraction`` cannot say what limit
is in force: it is taken as the whole card, and :func:`allocator_cap` sets no cap (it could not put a
limit the user set back as it was).
"""
from __future__ import annotations

import contextlib

import torch


def _fraction_getter():
    return getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)


def memory_fraction(device) -> float:
    """The share of ``device``'s memory this process's allocator may reserve (1.0 where unknown)."""
    getter = _fraction_getter()
    return float(getter(device)) if getter is not None else 1.0


def card_bytes(device) -> int:
    """The most this process may hold on ``device``: its limit, or the GPU's free memory plus what the
    process has reserved, whichever is less (other processes and the CUDA context take the rest)."""
    free, total = torch.cuda.mem_get_info(device)
    limit = int(memory_fraction(device) * total)
    return min(limit, free + torch.cuda.memory_reserved(device))


def available_bytes(device) -> int:
    """Bytes the allocator can still hand out on ``device``: :func:`card_bytes` less what is allocated."""
    return max(0, card_bytes(device) - torch.cuda.memory_allocated(device))


@contextlib.contextmanager
def allocator_cap(device, limit_bytes: int):
    """Inside the block, the caching allocator holds at most ``limit_bytes`` on ``device`` (never more
    than the limit already in force); afterwards the limit is as it was. The cache is emptied first:
    blocks cached from before count against the cap. No cap where this torch cannot read the limit."""
    if _fraction_getter() is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    before = memory_fraction(device)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(before, max(0.0, limit_bytes / total)), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)
