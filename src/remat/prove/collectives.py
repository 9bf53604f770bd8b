"""Count the collectives a training step issues: all-gathers, reduce-scatters, all-reduces.

    from remat.prove.collectives import CollectiveCounter
    with CollectiveCounter() as counter:
        loss = model(**batch).loss
        loss.backward()
    counter.counts.all_gather, counter.counts.reduce_scatter, counter.counts.as_dict()

How: a CPU-activity ``torch.profiler`` session around the code, then the ``c10d::`` operators in its
raw event list. Every collective of a ``ProcessGroup`` goes through one of these dispatcher operators
(``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::allreduce_`` ...), whoever issues
it and on any backend: FSDP2's ``dist.all_gather_single``, FSDP1's flat-parameter all-gather, DDP's
bucketed all-reduce (issued by its C++ reducer, never through Python), and functional collectives
(DTensor, ``torch.compile``), whose ``_c10d_functional::`` operator wraps one ``c10d::`` operator. An
operator inside another counted one is counted once (the outer one). What the backend does below that
(gloo implements a reduce-scatter with an all-reduce) is not counted: the count is what was asked for.

Why not the obvious alternatives: patching ``torch.distributed``'s Python functions misses DDP's
reducer and functional collectives, and depends on which spelling a torch version uses (torch 2.13
FSDP2 calls ``all_gather_single``, earlier ones ``all_gather_into_tensor``); a ``TorchDispatchMode``
would sit in the dispatch stack of the very step it measures, next to remat's selective modes. Only
the raw events are read (no ``FunctionEvent`` tree), so reading a large step costs milliseconds.

Limits: one profiler at a time (not inside another ``torch.profiler`` session); the profiler slows the
step, so time other steps. Coalesced calls (``allgather_into_tensor_coalesced_``) count once per call.
Collectives of every process group the rank is in are counted; ``by_op`` tells them apart by operator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# c10d dispatcher operator -> the kind of collective it is
KINDS: Mapping[str, str] = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_coalesced_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::alltoall_": "all_to_all",
    "c10d::alltoall_base_": "all_to_all",
}
# c10d operators that move no data between ranks
_NOT_COLLECTIVES = frozenset({"c10d::check_for_nan"})


@dataclass(frozen=True)
class CollectiveCounts:
    """Collectives issued by this rank while a :class:`CollectiveCounter` was open."""

    all_gather: int = 0
    """all-gathers (FSDP: unsharding a parameter group before its forward or backward)"""
    reduce_scatter: int = 0
    """reduce-scatters (FSDP: one per parameter group's gradients)"""
    all_reduce: int = 0
    """all-reduces (DDP: one per gradient bucket; HSDP's replicate dimension; a loss average)"""
    other: int = 0
    """every other ``c10d::`` operator: broadcast, all-to-all, barrier, send/recv, gather ..."""
    by_op: Mapping[str, int] = field(default_factory=dict)
    """count per ``c10d::`` operator name, for what the kinds above fold together"""

    def as_dict(self) -> dict:
        return dict(all_gather=self.all_gather, reduce_scatter=self.reduce_scatter,
                    all_reduce=self.all_reduce, other=self.other, by_op=dict(self.by_op))

    def per_step(self, steps: int) -> dict:
        """The main counts divided by ``steps`` (a counter held open over several steps)."""
        return {k: getattr(self, k) / steps for k in ("all_gather", "reduce_scatter", "all_reduce", "other")}


class CollectiveCounter:
    """A context manager counting this rank's collectives; ``counts`` is set on exit."""

    def __init__(self):
        self._profiler = None
        self.counts: CollectiveCounts | None = None

    def __enter__(self) -> "CollectiveCounter":
        from torch.profiler import ProfilerActivity, profile
        self.counts = None
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(*exc)
        if exc[0] is None:
            self.counts = count_events(profiler.profiler.kineto_results.events())


def count_events(events) -> CollectiveCounts:
    """:class:`CollectiveCounts` from raw profiler events (objects with ``name()``,
    ``start_ns()``, ``duration_ns()`` and ``start_thread_id()``)."""
    spans = sorted(((e.start_thread_id(), e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                    for e in events if e.name().startswith("c10d::")), key=lambda s: (s[0], s[1], -s[2]))
    by_op: dict = {}
    open_until: dict = {}  # thread -> end of the outermost counted operator still running
    for thread, start, end, name in spans:
        if name in _NOT_COLLECTIVES:
            continue
        if start < open_until.get(thread, -1):
            continue  # runs inside a counted operator: the caller asked for one collective
        open_until[thread] = end
        by_op[name] = by_op.get(name, 0) + 1
    totals = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "other": 0}
    for name, n in by_op.items():
        kind = KINDS.get(name, "other")
        totals[kind if kind in totals else "other"] += n
    return CollectiveCounts(**totals, by_op=dict(sorted(by_op.items())))
