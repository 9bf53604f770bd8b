"""FSDP2: what sharding over ``world`` ranks changes in one rank's step, as a profile transform.

How: :func:`shard` returns a new :class:`~remat.planning.costs.Profile` whose static bytes and
per-block bytes are those of one rank under FSDP2 ``fully_shard`` applied to every block and then
to the root (after ``remat.apply``), and whose ``comm`` (:class:`~remat.planning.comm.Collectives`)
lists the step's all-gathers and reduce-scatters. The simulator and the solver read the
transformed profile unchanged, so a sharded plan is solved exactly like a single-GPU one.

- memory, per rank: ``1/world`` of parameters, gradients and optimizer state; one block's
  all-gathered parameters in flight (its whole forward-to-backward with
  ``reshard_after_forward=False``); the root's parameters unsharded all step; two blocks'
  reduce-scatter buffers (reduce dtype) on every block's backward peak;
- time: one all-gather per block in forward and again in backward, one reduce-scatter per block,
  the root's first and last, at the bus rate ``bus_Bps``; recompute adds no collective. The
  overlap with compute is the simulator's; copies, launch latency and contention on the compute
  stream are :class:`Overheads` (defaults :data:`FSDP2_OVERHEADS`, fitted by
  ``benchmarks/fit_overheads.py``), charged by :class:`Link`;
- eager ``selective`` (and ``attn-saved`` below :data:`OP_POLICY_FROM_TOKENS` tokens) is left out:
  under FSDP2 its host, not its GPU, sets the step, which no per-block GPU time shows.

Why a transform rather than a profile taken under FSDP: it needs no process group, so
``remat plan --fsdp 8`` answers on a laptop, and the validated single-GPU profile stays the one
source of truth. ``class_param_bytes`` comes from
:func:`remat.profiling.profiler.block_param_bytes`, so this module never sees a model. Plan on
rank 0 and broadcast ``plan.to_dict()``: measured profiles differ between ranks.

Limits: HSDP and CPU offload of shards are not modelled; the root's gradients (in full) and a
narrower ``MixedPrecisionPolicy`` param dtype (at the profiled one) are conservative; one set of
overheads for every GPU and dtype. The terms in full, the fit, the measurements: docs/design/planning.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from remat.planning.calls import refuse_calls
from remat.planning.comm import Collectives
from remat.planning.costs import Profile, dtype_bytes
from remat.planning.plans import ATTENTION_SAVED

HBM_BPS_FRACTION = 1.08
"""FSDP2's copies' bytes as this module counts them, over the ``fsdp_copy`` kernels' seconds, over the
datasheet HBM bandwidth (fitted: ``benchmarks/results/issue12/overheads_fit.json``). It can exceed 1
because the count is an approximation (the all-gather copy-in runs on its own stream and part of
it overlaps; each copy kernel alone runs below the datasheet rate); the fit keeps the total right."""
CONTENTION = 0.19
"""Seconds by which compute slows per second of link time beside it: the compute kernels of a
traced FSDP2 step against the same kernels as the profile measured them alone (fitted on the
stock rows, ``eager`` and ``torch_ac``). NCCL's ring kernels hold SMs and HBM bandwidth."""
LATENCY_S = 0.35e-3
"""Seconds per collective on the step beyond its kernels: FSDP2's pre/post hooks in Python, stream
waits, idle gaps, and exposed communication the FIFO link model does not see (what the stock
rows' measured steps had beyond everything else, per collective). Charged on the compute stream
in the phase that issues the collective."""


EAGER_SELECTIVE_UNDER_FSDP2 = (
    "eager selective is not planned under FSDP2 (world > 1): its per-op dispatch in Python keeps the GPU waiting for "
    "its host once FSDP2's hooks hold the host a block or two ahead (4 x H100 and 4 x H200: selective-heavy plans ran "
    "10-28% over their predicted step, plans without it within +3.9% and faster); compiled it is planned")

OP_POLICY_FROM_TOKENS = 32768
"""Tokens a step from which eager ``attn-saved`` is planned under FSDP2 (see the module doc)."""


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """What a collective costs the compute stream beyond the link's time (see the module doc).

    The defaults are fitted by ``benchmarks/fit_overheads.py``; :meth:`fit` makes others
    from a kernel-time breakdown (``benchmarks/fsdp_bench.py --trace``).
    """

    hbm_Bps_fraction: float = HBM_BPS_FRACTION
    """Copies run at this fraction of the GPU's ``Rates.hbm_Bps`` (read + write counted); 0: copies not charged."""
    contention: float = CONTENTION
    """Fraction by which compute slows while the link is busy beside it."""
    latency_s: float = LATENCY_S
    """Fixed seconds per collective on the compute stream."""

    @classmethod
    def fit(cls, *, copy_bytes: float, copy_s: float, hbm_Bps: float, overlapped_s: float, slowdown_s: float,
            collectives: int, host_s: float) -> "Overheads":
        """Constants from one step's kernel-time breakdown: ``copy_bytes`` moved (read + write) by
        the copy kernels in ``copy_s``; ``overlapped_s`` of compute that ran beside a collective, and
        ``slowdown_s`` more than the same kernels took alone; ``collectives`` launched, costing
        ``host_s`` on the compute stream beyond their kernels."""
        if min(copy_bytes, copy_s, hbm_Bps, overlapped_s, collectives) <= 0 or min(slowdown_s, host_s) < 0:
            raise ValueError("Overheads.fit needs positive bytes, seconds, a bandwidth and a count of collectives, "
                             f"got copy_bytes={copy_bytes!r}, copy_s={copy_s!r}, hbm_Bps={hbm_Bps!r}, "
                             f"overlapped_s={overlapped_s!r}, collectives={collectives!r} (slowdown_s, host_s >= 0)")
        return cls(hbm_Bps_fraction=copy_bytes / copy_s / hbm_Bps, contention=slowdown_s / overlapped_s,
                   latency_s=host_s / collectives)

    def fields(self, hbm_Bps: float) -> dict:
        """The :class:`~remat.planning.comm.Collectives` fields these constants set, at ``hbm_Bps``."""
        return dict(copy_Bps=float(hbm_Bps) * self.hbm_Bps_fraction, contention=float(self.contention),
                    latency_s=float(self.latency_s))


FSDP2_OVERHEADS = Overheads()
"""The defaults :func:`shard` and :func:`remat.planning.replication.replicate` charge."""
NO_OVERHEADS = Overheads(hbm_Bps_fraction=0.0, contention=0.0, latency_s=0.0)
"""Only the link's time (the time model before these overheads; for tests and comparisons)."""


def shard(profile: Profile, world: int, class_param_bytes: tuple, *, reshard_after_forward: bool = True,
          param_dtype=None, reduce_dtype=None, bus_Bps: Optional[float] = None,
          overheads: Overheads = FSDP2_OVERHEADS) -> Profile:
    """``profile`` as one of ``world`` FSDP2 ranks sees it (see the module docstring).

    ``reshard_after_forward``: as passed to ``fully_shard`` for the blocks (the root is never
    resharded after forward). ``param_dtype`` / ``reduce_dtype``: a ``MixedPrecisionPolicy``'s
    (names or torch dtypes); default the profiled model's dtype, and the param dtype.
    ``bus_Bps``: collective bus bandwidth in bytes/s; default the profile's rates.
    ``overheads``: the copies, contention and latency charged beside the link (:class:`Overheads`).
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"the FSDP world size must be a positive integer (ranks sharing the model), got {world!r}")
    if len(class_param_bytes) != len(profile.classes):
        raise ValueError(f"class_param_bytes has {len(class_param_bytes)} entries for {len(profile.classes)} "
                         "block classes; use remat.profiling.profiler.block_param_bytes(model, profile)")
    bus = check_bus(profile, bus_Bps)
    if world == 1:
        return profile
    refuse_calls(profile, "FSDP2's time and memory")   # its gathers and reductions are per module, not per call
    kept = 1.0 - 1.0 / world
    blocks = sum(class_param_bytes[c] for c in profile.block_class)
    root = max(0, profile.param_bytes - blocks)
    in_flight = max(class_param_bytes)
    static = profile.static_bytes - (profile.param_bytes + profile.optimizer_bytes) * kept + root + in_flight

    model_bytes = dtype_bytes(profile.dtype)
    gather = dtype_bytes(param_dtype) / model_bytes if param_dtype is not None else 1.0
    reduce = (dtype_bytes(reduce_dtype) / model_bytes) if reduce_dtype is not None else gather
    scatter_buffers = int(2 * max(class_param_bytes) * reduce)  # two blocks' copy-in buffers in flight

    def sharded(cost, params):
        cost = replace(cost, bwd_end=int(cost.bwd_end - params * kept), bwd_peak=cost.bwd_peak + scatter_buffers)
        if reshard_after_forward:
            return cost
        return replace(cost, kept=cost.kept + params, fwd_peak=cost.fwd_peak + params,
                       bwd_peak=cost.bwd_peak + params)

    eager = not profile.notes.get("compile")
    host_bound = eager and profile.batch * profile.seq < OP_POLICY_FROM_TOKENS

    def planned(c, t, cost):  # eager selective, and attn-saved where the host bounds it, are left out
        if (eager and t == "selective") or (host_bound and t in ATTENTION_SAVED):
            return None
        return sharded(cost, class_param_bytes[c])
    heads = tuple(replace(h, pre_bwd_peak=h.pre_bwd_peak + scatter_buffers) for h in profile.heads)
    gathers = tuple(int(class_param_bytes[c] * gather) for c in profile.block_class)
    reduces = tuple(int(class_param_bytes[c] * reduce) for c in profile.block_class)
    root_gather, root_reduce = int(root * gather), int(root * reduce)

    def gather_copies(b):  # copy-in of the shard (read + write), copy-out of the whole (read + write)
        return int(2 * b / world + 2 * b)

    again = 1 if reshard_after_forward else 0
    comm = Collectives(world=world, bus_Bps=float(bus), reshard_after_forward=bool(reshard_after_forward),
                       gather_bytes=gathers, reduce_bytes=reduces, root_gather_bytes=root_gather,
                       root_reduce_bytes=root_reduce, bus_measured=bus_Bps is not None, kind="fsdp2",
                       # reduce-scatter copy-in: gradients read in the param dtype, written in the reduce dtype
                       fwd_copy_bytes=tuple(gather_copies(g) for g in gathers),
                       bwd_copy_bytes=tuple(again * gather_copies(g) + g + r for g, r in zip(gathers, reduces)),
                       fwd_launches=(1,) * len(gathers), bwd_launches=(1 + again,) * len(gathers),
                       root_fwd_copy_bytes=gather_copies(root_gather) if root_gather else 0,
                       root_bwd_copy_bytes=root_gather + root_reduce,
                       root_fwd_launches=int(root_gather > 0), root_bwd_launches=int(root_reduce > 0),
                       **overheads.fields(profile.rates.hbm_Bps))
    notes = dict(profile.notes, fsdp_world=world, reshard_after_forward=bool(reshard_after_forward))
    if eager and any("selective" in costs for costs in profile.classes):
        notes["selective"] = EAGER_SELECTIVE_UNDER_FSDP2
    # each rank steps the optimizer over its own shard
    return replace(profile.with_costs(planned), static_bytes=int(static), heads=heads, comm=comm, notes=notes,
                   optimizer_s=profile.optimizer_s / world, optimizer_temp_bytes=-(-profile.optimizer_temp_bytes // world))


class Link:
    """How :func:`remat.simulate` charges a :class:`~remat.planning.comm.Collectives`: one FIFO link at
    the bus rate beside the compute stream, and the overheads that land on that stream, summed.
    ``clock``: the simulator's, whose ``"gpu"`` entry :meth:`stretch` moves."""

    def __init__(self, comm: Collectives, clock: dict):
        self.comm, self.clock = comm, clock
        self.free_at = 0.0
        self.busy = []   # (start, end) of each collective, in issue order
        self.copy_s = self.launch_s = self.contention_s = 0.0

    def issue(self, nbytes, ready, reduce=False) -> float:
        """One all-gather, or reduction (``reduce``), of ``nbytes`` (unsharded) at ``ready``; when it ends."""
        factor = 2 if reduce and self.comm.kind == "ddp" else 1   # an all-reduce moves twice the bytes
        start = max(self.free_at, ready)
        self.free_at = start + nbytes * factor * (self.comm.world - 1) / self.comm.world / self.comm.bus_Bps
        self.busy.append((start, self.free_at))
        return self.free_at

    def charge(self, copied, launches) -> float:
        """Seconds of ``copied`` bytes and ``launches`` collectives on the compute stream."""
        copy, launch = self.comm.copy_s(copied), self.comm.latency_s * launches
        self.copy_s += copy
        self.launch_s += launch
        return copy + launch

    def block(self, index, backward) -> float:
        """:meth:`charge` block ``index``'s copies and launches of its forward or backward."""
        c = self.comm
        copied, launches = (c.bwd_copy_bytes, c.bwd_launches) if backward else (c.fwd_copy_bytes, c.fwd_launches)
        return self.charge(copied[index] if copied else 0, launches[index] if launches else 0)

    def stretch(self, start, seconds) -> float:
        """Slow the phase that computes ``seconds`` from ``start`` by ``contention`` x the link's busy
        time within it (its collectives issued already); the seconds added to the clock."""
        if not self.comm.contention:
            return 0.0
        busy = 0.0
        for begin, end in reversed(self.busy):  # FIFO: ends only grow
            if end <= start:
                break
            busy += max(0.0, min(end, start + seconds) - max(begin, start))
        extra = self.comm.contention * busy
        self.clock["gpu"] += extra
        self.contention_s += extra
        return extra


def check_bus(profile: Profile, bus_Bps: Optional[float]) -> float:
    """The bus rate to charge: ``bus_Bps``, or the profile's; ValueError unless positive."""
    bus = profile.rates.bus_Bps if bus_Bps is None else bus_Bps
    if not bus or bus <= 0:
        raise ValueError(f"bus_Bps must be a positive rate in bytes/s (e.g. 330e9 for NVLink H100), got {bus_Bps!r}")
    return float(bus)


def comm_notes(profile: Profile, sim) -> dict:
    """What a plan's notes say of the collectives (``sim``: its :class:`~remat.planning.simulation.Simulation`);
    empty on one GPU. ``compute_s`` is the step less the exposed communication and the overheads."""
    comm = profile.comm
    if comm is None:
        return {}
    def s(x):  # four significant digits: a tiny model's collectives take microseconds
        return float(f"{x:.4g}")
    if comm.kind == "ddp":
        notes = {"ddp_world": comm.world, "allreduce_buckets": sum(comm.bwd_launches) + comm.root_bwd_launches}
    else:
        notes = {"fsdp_world": comm.world, "reshard_after_forward": comm.reshard_after_forward}
    overhead = sim.comm_copy_s + sim.comm_launch_s + sim.comm_contention_s
    return dict(notes, bus_GBps=round(comm.bus_Bps / 1e9, 1), bus_measured=comm.bus_measured,
                comm_s=s(sim.comm_s), exposed_comm_s=s(sim.exposed_comm_s),
                comm_overhead_s=s(overhead), comm_copy_s=s(sim.comm_copy_s), comm_launch_s=s(sim.comm_launch_s),
                comm_contention_s=s(sim.comm_contention_s),
                compute_s=s(sim.step_s - sim.exposed_comm_s - overhead))
