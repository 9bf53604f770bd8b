"""What the planner assumes of the offload engine: its settings and the GPU bytes it may hold.

Memory the engine adds. Beyond what a block holds while it runs (its own saved tensors, back
on the GPU during its backward), :class:`remat.offload.engine.OffloadEngine` holds GPU memory for
other blocks in two ways only.
(1) Forward and head: GPU bytes of saved tensors whose host copy has not been seen to land are at
most the *window* ``W`` (``max_pending_bytes``; by default ``window_records`` = 1 times the largest
record packed so far, i.e. the largest offloaded block's bytes once a step has run), so during
block ``i``'s forward the blocks before it add ``min(W, their bytes)``, and the head's forward
and backward (before the first unpack) add ``min(W, all offloaded bytes)``: the newest bytes saved.
(2) Backward of block ``i``: the ``prefetch_blocks`` offloaded blocks before it (the nearest
before the current offloaded block) are fully on the GPU, plus whatever of the forward's last
``min(W, all)`` bytes belongs to blocks older still. Nothing else: the pool is host memory, and a
record's GPU copies go when the next record becomes current.

Why one record: it keeps the copy stream busy (the engine refills its copy queue to
``issue_bytes`` at every pack) and keeps ``full+offload``'s saving at all but one block input; a
window of a fixed fraction of the card leaves gigabytes on the GPU at the head, where the step's
peak is. A larger window trades peak for bus bytes (the tail it holds is never moved).

Why here and not in :mod:`remat.offload`: the rule is plain arithmetic over byte counts, and the
planning layer must not import the engine (which needs torch and CUDA streams). The engine
enforces the rule with streams and events; :func:`remat.profiling.profiler.engine_model` reads the
engine's real settings into an :class:`EngineModel` for a profile, and a test checks that the
defaults here are the engine's.

Limits: upper bounds, not a timeline; they assume the engine's own behaviour (one current record,
landed copies released at the next pack, block end or first unpack) and say nothing of the
caching allocator's fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_WINDOW_RECORDS = 1  # default window: this many times the largest record packed
DEFAULT_ISSUE_BYTES = 512 * 2**20  # bytes of device-to-host copies the engine queues at once


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """The offload engine's settings, as :mod:`remat.planning.simulator` and the solver use them."""

    window_bytes: Optional[int] = None
    """The most GPU bytes of offloaded tensors held before the host waits for copies (the engine's
    ``max_pending_bytes``); None: ``window_records`` times the largest block's offloaded bytes."""
    window_records: int = DEFAULT_WINDOW_RECORDS
    """The default window, in records (one block call's offloaded bytes)."""
    issue_bytes: int = DEFAULT_ISSUE_BYTES
    """Copies queued on the copy stream at once; bytes still waiting beyond it when the backward
    starts are never moved."""
    prefetch_blocks: int = 1
    """Offloaded blocks fetched ahead in backward."""

    def window(self, block_bytes) -> int:
        """The window in force for a plan whose blocks offload ``block_bytes`` (forward order)."""
        if self.window_bytes is not None:
            return int(self.window_bytes)
        return int(self.window_records * max(block_bytes, default=0))


def gpu_overhead_bytes(block_bytes, max_pending_bytes: Optional[int] = None,
                       prefetch_blocks: int = 1) -> dict:
    """GPU bytes the engine holds for *other* blocks, phase by phase ("Memory the engine adds").

    ``block_bytes``: the bytes each block hands to the engine, in forward order (0 for blocks
    that are not offloaded; for ``full+offload``, its input); ``max_pending_bytes`` and
    ``prefetch_blocks`` as given to the engine (None: the default window,
    ``DEFAULT_WINDOW_RECORDS`` times the largest entry). Returns

    - ``window``: the window ``W`` in force;
    - ``forward``: per block, the most the engine holds for the blocks before it during its
      forward, ``min(W, bytes of the blocks before)``;
    - ``head``: the same during the head's forward and backward, ``min(W, all bytes)``;
    - ``backward``: per block, during its backward: the ``prefetch_blocks`` offloaded blocks before
      the current offloaded block (the block itself, or the nearest later one for a block that
      does not offload) in full, plus what of the forward's last ``min(W, all)`` bytes belongs to
      blocks older still.

    Upper bounds: the engine holds these at most, whatever the timing (landed copies are released
    at the next pack, block end or first unpack). A block's own bytes are not in them: in its
    forward they are the block's, in its backward they are back on the GPU for it.
    """
    sizes = list(block_bytes)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes):
        raise ValueError(f"block_bytes must be non-negative ints (bytes per block, forward order), got {sizes!r}")
    if max_pending_bytes is not None and (isinstance(max_pending_bytes, bool) or not isinstance(max_pending_bytes, int)
                                          or max_pending_bytes < 0):
        raise ValueError(f"max_pending_bytes must be a non-negative int or None, got {max_pending_bytes!r}")
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
        raise ValueError(f"prefetch_blocks must be a non-negative int, got {prefetch_blocks!r}")
    window = DEFAULT_WINDOW_RECORDS * max(sizes, default=0) if max_pending_bytes is None else max_pending_bytes
    total = sum(sizes)
    left = min(window, total)  # on the GPU when the forward ends: the newest bytes saved
    forward, before = [], 0
    for b in sizes:
        forward.append(min(window, before))
        before += b
    records = [i for i, b in enumerate(sizes) if b]
    backward = []
    for i in range(len(sizes)):
        later = [r for r in records if r >= i]
        if not later:  # the backward has not reached an offloaded block: only the forward's tail
            backward.append(left)
            continue
        current = later[0]
        earlier = [r for r in records if r < current]
        prefetched = earlier[len(earlier) - prefetch_blocks:] if prefetch_blocks else []
        lowest = prefetched[0] if prefetched else i
        newer = sum(sizes[lowest:])
        backward.append(sum(sizes[r] for r in prefetched) + max(0, left - newer))
    return {"window": window, "forward": forward, "head": left, "backward": backward}


def engine_overhead(engine: EngineModel, block_bytes) -> dict:
    """:func:`gpu_overhead_bytes` for ``engine``'s settings; all zeros when nothing is offloaded."""
    sizes = [int(b) for b in block_bytes]
    if not any(sizes):
        return {"window": 0, "forward": [0] * len(sizes), "head": 0, "backward": [0] * len(sizes)}
    return gpu_overhead_bytes(sizes, engine.window(sizes), engine.prefetch_blocks)


def engine_bounds(window: float, largest: float, previous: float, earlier: bool, prefetch_blocks: int = 1):
    """(forward and head, backward) bytes the solver allows the engine for the blocks before one.

    ``previous``: the block before's offloaded bytes; ``earlier``: whether any block before
    that one offloaded; ``largest``: the largest offloaded block. Upper bounds of
    :func:`gpu_overhead_bytes` (``min(W, bytes before)`` in forward, the prefetched block plus
    the older part of the forward's last ``W`` bytes in backward) that depend on the previous
    block only, which is what the solver's state carries.
    """
    forward = min(window, previous + (window if earlier else 0))
    if prefetch_blocks == 0:     # no prefetch: only the forward's last bytes
        backward = forward
    elif prefetch_blocks == 1:   # the nearest offloaded block before + the older part of the last W bytes
        if previous:
            backward = previous + (max(0.0, window - previous) if earlier else 0.0)
        else:
            backward = max(window, largest) if earlier else 0.0
    else:
        backward = prefetch_blocks * largest + window if (previous or earlier) else 0.0
    return forward, backward


def pinned_bytes(sizes) -> int:
    """Pinned host bytes the offload engine's pool holds for tensors of ``sizes`` bytes: each in its
    power-of-two size class (``remat.offload.pinned.PinnedPool.size_class``; a test checks they agree)."""
    return sum(1 << max(int(size) - 1, 1).bit_length() for size in sizes)
