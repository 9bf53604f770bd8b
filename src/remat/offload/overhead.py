"""The offload engine's GPU memory rule as a pure function, for the planner and the simulator.

Memory the engine adds. Beyond what a block holds while it runs (its own saved tensors, back
on the GPU during its backward), :class:`remat.offload.engine.OffloadEngine` holds GPU memory for other
blocks in two ways only.
(1) Forward and head: GPU bytes of saved tensors whose host copy has not been seen to land are at
most the *window* ``W`` (``max_pending_bytes``; default ``DEFAULT_WINDOW_RECORDS`` = 1 times the
largest record packed so far, i.e. the largest offloaded block's bytes once a step has run), so
during block ``i``'s forward the blocks before it add ``min(W, their bytes)``, and the head's forward
and backward (before the first unpack) add ``min(W, all offloaded bytes)``: the newest bytes saved.
(2) Backward of block ``i``: the ``prefetch_blocks`` offloaded blocks before it (the nearest
before the current offloaded block) are fully on the GPU, plus whatever of the forward's last
``min(W, all)`` bytes belongs to blocks older still. Nothing else: the pool is host memory, and a
record's GPU copies go when the next record becomes current. :func:`gpu_overhead_bytes` is this
rule as a pure function, for the planner. Why one record: it still keeps the copy stream busy
(the copy queue is refilled to ``remat.offload.engine._ISSUE_WINDOW`` at every pack; measured on an
H200, offloading every block of the bench model ran within 6% of the bus time), and it keeps ``full+offload``'s
saving at all but one block input (15/16 measured); a window of a fraction of the card (the first
version's 1/20) left gigabytes on the GPU at the head, where the step's peak is. A larger window
trades peak for bus bytes (the tail it holds is never moved): ``offload_bench --extra-windows-gib``.

Why a module of its own: the rule is plain arithmetic over byte counts and imports nothing (no
torch), so it reads apart from the streams and events that enforce it, and it is the one place the
engine's default window (``DEFAULT_WINDOW_RECORDS``) is defined. ``remat.offload.engine`` re-exports both.

Limits: upper bounds, not a timeline; they assume the engine's own behaviour (one current record,
landed copies released at the next pack, block end or first unpack) and say nothing of the
caching allocator's fragmentation.
"""
from __future__ import annotations

from typing import Optional

DEFAULT_WINDOW_RECORDS = 1  # default max_pending_bytes: this many times the largest record packed


def gpu_overhead_bytes(block_bytes, max_pending_bytes: Optional[int] = None,
                       prefetch_blocks: int = 1) -> dict:
    """GPU bytes the engine holds for *other* blocks, phase by phase ("Memory the engine adds").

    ``block_bytes``: the bytes each block hands to the engine, in forward order (0 for blocks
    that are not offloaded; for ``full+offload``, its input); ``max_pending_bytes`` and
    ``prefetch_blocks`` as given to :class:`OffloadEngine` (None: the default window,
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
