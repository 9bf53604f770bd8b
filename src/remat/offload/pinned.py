"""Pinned host buffers for the offload engine, reused from step to step under a host-memory limit.

How it works. :class:`PinnedPool` hands out 1-D ``uint8`` buffers in power-of-two size classes
(PyTorch's host allocator rounds pinned blocks so anyway, so a class costs nothing extra there).
Buffers are allocated during the first steps and given back to a free list per class afterwards,
so a step of the same shapes allocates nothing (``allocations`` stays constant once warmed up).
Each free buffer carries a *fence*: the event of the last copy that read it, which the next copy
into it must wait on; the pool only stores fences, the engine records and waits on them.

The limit. Pinned memory cannot be swapped, so the pool never holds more than ``limit`` bytes
(default ``HOST_FRACTION`` = 60% of MemAvailable, read once at the first allocation and left to
the OS otherwise). Before it would grow past the limit it drops free buffers of other size
classes (largest first) and asks PyTorch to give its cached pinned blocks back; if that is not
enough it raises a ValueError naming the bytes needed, the bytes available and what to change.

How it differs from the obvious alternative: ``save_on_cpu(pin_memory=True)`` allocates pinned
memory per saved tensor, every step, with no bound; here buffers are pinned once and reused, and
running out is an error that says what to change, raised before the allocation.

Limits: power-of-two classes waste up to half of a buffer; the pool gives memory back only to
make room under its limit; the limit is not re-read if the host's free memory changes.
The pool has no lock of its own: the engine calls it under its lock. ``pin=False`` gives ordinary
host memory (the engine's CPU test mode).
"""
from __future__ import annotations

import collections
import os
from typing import Optional

import torch

from remat.units import format_size

MiB = 1 << 20
GiB = 1 << 30
HOST_FRACTION = 0.6  # of MemAvailable: pinned memory cannot be swapped, leave the rest to the OS



def host_memory() -> dict:
    """The host's memory, from ``/proc/meminfo``: the one reader of it (the pool's default limit, ``remat env``).

    Returns:
        ``{"total": bytes, "available": bytes}`` (MemTotal, MemAvailable); off Linux, the available
        physical pages and no total."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    available = values.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"total": values.get("MemTotal"), "available": available}


def _mem_available() -> int:
    return host_memory()["available"]


def default_limit() -> int:
    """The bytes a pool without a ``limit`` may hold.

    Returns:
        ``HOST_FRACTION`` of MemAvailable now: what the planner holds offload plans to
        (:func:`remat.planner.plan`'s ``host_memory``)."""
    return int(HOST_FRACTION * _mem_available())


class PinnedPool:
    """Host buffers in power-of-two size classes, reused across steps.

    ``take(nbytes)`` returns ``(buffer, fence)``: a 1-D uint8 tensor of at least ``nbytes`` and the
    event of the last copy that read it (None if none); the copy that writes it must wait on the
    fence. ``give(buffer, fence)`` returns it. ``limit`` (bytes; None: 60% of MemAvailable, read
    at the first allocation) bounds what the pool holds; free buffers of other sizes are dropped
    before it raises. ``pin=False`` gives ordinary host memory (CPU tests).
    """

    def __init__(self, limit: Optional[int] = None, *, pin: bool = True):
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"host memory limit must be a positive number of bytes, got {limit!r}")
        self.limit = limit
        self.pin = pin
        self.held_bytes = 0  # pinned bytes this pool owns, in use or free
        self.in_use_bytes = 0
        self.allocations = 0  # buffers ever allocated: constant from step to step after warm-up
        self._free = collections.defaultdict(list)  # size class -> [(buffer, fence)]

    @staticmethod
    def size_class(nbytes: int) -> int:
        return 1 << max(int(nbytes) - 1, 1).bit_length()

    def take(self, nbytes: int):
        size = self.size_class(nbytes)
        free = self._free.get(size)
        if free:
            buffer, fence = free.pop()
        else:
            self._make_room(size, nbytes)
            buffer, fence = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin), None
            self.held_bytes += size
            self.allocations += 1
        self.in_use_bytes += size
        return buffer, fence

    def give(self, buffer: torch.Tensor, fence=None) -> None:
        self.in_use_bytes -= buffer.numel()
        self._free[buffer.numel()].append((buffer, fence))

    def _make_room(self, size: int, nbytes: int) -> None:
        if self.limit is None:
            self.limit = default_limit()
        if self.held_bytes + size <= self.limit:
            return
        dropped = 0
        for cls in sorted(self._free, reverse=True):
            while self._free[cls] and self.held_bytes + size > self.limit:
                self._free[cls].pop()
                self.held_bytes -= cls
                dropped += cls
        if dropped and self.pin and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # PyTorch caches freed pinned blocks; give them back
        if self.held_bytes + size > self.limit:
            raise ValueError(
                f"remat offload: pinned host memory would exceed its limit: this step needs at least "
                f"{format_size(self.in_use_bytes + size)} ({format_size(self.in_use_bytes)} already holding saved "
                f"tensors + {format_size(size)} for a {format_size(nbytes)} tensor), but only "
                f"{format_size(self.limit)} is available to offload (limit: host_memory_limit, default "
                f"{HOST_FRACTION:.0%} of MemAvailable). Offload fewer blocks (e.g. 'every:2:offload', "
                "or 'full+offload', which moves only block inputs), or pass "
                "OffloadEngine(model, host_memory_limit=...) if the host has more to give.")
