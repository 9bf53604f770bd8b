"""FSDP2: what sharding over ``world`` ranks changes in one rank's step, as a profile transform.

How: :func:`shard` returns a new :class:`~remat.planning.costs.Profile` whose static bytes and
per-block bytes are those of one rank under FSDP2 ``fully_shard`` applied to every block and
then to the root (after ``remat.apply``, as remat requires), and whose ``comm``
(:class:`~remat.planning.comm.Collectives`) lists the step's all-gathers and reduce-scatters.
The simulator and the solver read the transformed profile unchanged, so a plan for a sharded
run is solved exactly like one for a single GPU. Memory, per rank:

- parameters and optimizer state: ``1/world`` of them stay (static), and the optimizer's step
  (``Profile.optimizer_s``) updates ``1/world`` of them;
- all-gathered parameters in flight: one of the largest block's parameters, all step long.
  What a rank was measured to hold beyond the profile, with peaks in the head's forward and in
  blocks' backward alike, is the root's parameters (below) plus one block, not two (the current
  and the prefetched one). With ``reshard_after_forward=False`` a block stays unsharded from its forward to the end
  of its backward: its parameters join what it keeps (and its forward and backward peaks),
  and the prefetched block is the one in static (unmeasured);
- the root's own parameters (embeddings, final norm, LM head) unsharded, in full, all step
  long (FSDP2 keeps the root unsharded from its forward to the end of its backward), beside
  their shard, which FSDP2 keeps as every parameter's;
- each block's parameter gradients: full size during its backward (already in the block's
  measured backward peak), then reduce-scattered, so ``1/world`` of them stay afterwards;
- reduce-scatter buffers in flight: FSDP2 copies a block's gradients into a flat buffer in the
  reduce dtype (its copy-in) and holds that buffer until the next block's reduce-scatter is
  issued, so during a block's backward the buffer of the block after it is alive, and at its end
  its own joins it: two blocks' gradient bytes (reduce dtype) on every block's backward peak and
  on the embeddings' backward (plans that peak in a block's backward showed these two buffers;
  plans that peak at the head do not see them).

Time: one all-gather per block in forward and (resharded) again in backward, one
reduce-scatter per block, the root's all-gather first and its reduce-scatter last; bytes in
the param dtype (gathers) and the reduce dtype (``MixedPrecisionPolicy(reduce_dtype=...)``,
default the param dtype); seconds at the bus bandwidth ``bus_Bps`` (the profile's rates, or a
rate measured on the process group: :func:`remat.profiling._calibrate.bus_rate`). A treatment
that recomputes adds no all-gather: FSDP2 keeps the block unsharded through its backward, the
recompute included (the collectives counted per step are the same for every treatment). How the
collectives overlap compute is the simulator's (:mod:`remat.planning.simulator`).

Eager ``attn-saved`` (the same per-op modes) is left out below :data:`OP_POLICY_FROM_TOKENS` tokens a
step, where a block's ops are short enough for that to matter; from there on each op runs for
milliseconds and the host stays ahead. Eager ``selective`` is left out (:data:`EAGER_SELECTIVE_UNDER_FSDP2`, in ``notes["selective"]``):
under FSDP2 its GPU waits for its host, which no per-block GPU time shows. torch's
selective-checkpoint modes dispatch every op of its forward and recompute in Python, several
times the host time of the other treatments (``benchmarks/host_probe.py``), and FSDP2's hooks add
host work to every block and keep the host at most a block or two ahead, so selective-heavy
plans run well over their predicted step where plans of the other treatments hold theirs. A
host-time term (phase = max(GPU, host / share), host times from the profile's chains) is not
modelled instead: a torchrun profile's host times are not those of a lone process, and such a
term over-predicted the same plans. Compiled, ``selective`` costs its host nothing special and
stays; on one GPU the host runs far ahead and it stays too. (The measurements:
docs/history.md.)

Same plan on every rank: plan on rank 0 and broadcast ``plan.to_dict()``
(``torch.distributed.broadcast_object_list``; ``examples/train_fsdp.py`` and
``benchmarks/fsdp_bench.py`` do). A fake-tensor profile is deterministic (FLOP counts and
bytes), but a measured one is not (each rank times its own kernels, and a small difference
can flip the solver's choice), so the broadcast is the one rule that holds for both.
:func:`remat.profiling._calibrate.bus_rate` returns the same number on every rank (the
slowest rank's), so it never makes ranks disagree.

Why a transform rather than a profile taken under FSDP: it needs no process group, so
``remat plan --fsdp 8`` answers on a laptop for a cluster, and the single-GPU profile,
whose numbers are validated, stays the one source of truth.

``class_param_bytes`` (parameter bytes of one block per block class) comes from the model:
:func:`remat.profiling.profiler.block_param_bytes` reads it, so this module never sees a model.

Overheads beside the link (:class:`Overheads`, fields of the
:class:`~remat.planning.comm.Collectives`, charged on the compute stream in the phase where they
happen by :class:`Link`, the simulator's model of the link; the plan's notes and
:meth:`~remat.planning.simulation.Simulation.stages` show each). A time model that charges only
the link under-predicts every strategy's step by far more than the link's exposed time. What the
link time leaves out:

- copies (torch 2.13's ``_fsdp_collectives``): an all-gather first copies the rank's shard into
  the flat gather buffer (``all_gather_copy_in``: read + write ``2 B / world``; it runs on FSDP2's
  copy-in stream, charged here on the compute stream as a bound), then splits the gathered buffer
  into the unsharded parameters (``split_with_sizes_copy``, on the compute stream: read + write
  ``2 B``). A reduce-scatter first concatenates the unsharded gradients into its flat input
  (``chunk_cat``, on the compute stream: reads them in the param dtype and writes them in the
  reduce dtype, the cast included). Charged at ``hbm_Bps_fraction`` of the GPU's HBM bandwidth,
  in the block's forward (its all-gather's copies) and backward (the backward all-gather's and
  its reduce-scatter's). Not charged: the reduced shard's cast back to the parameter dtype (on the
  reduce-scatter stream, ``1/world`` of the bytes);
- ``contention``: compute runs slower while NCCL's kernels run beside it (they hold SMs and HBM
  bandwidth); the simulator stretches each phase by ``contention`` x the seconds the link is busy
  during it;
- ``latency_s``: a fixed cost per collective on the compute stream (the launch, FSDP2's pre- and
  post-forward/backward hooks in Python, the stream waits).

The defaults (:data:`FSDP2_OVERHEADS`; each constant's docstring says what it measures) are
fitted by ``benchmarks/fit_overheads.py`` to the stock rows (``eager``, ``torch_ac``) of traced
``benchmarks/fsdp_bench.py`` runs, from a profile measured on the GPU on random tokens (all-zero
tokens run faster than real data and would leave that error to the overheads). Python's garbage
collector must be kept out of the steps for the prediction to hold: a collection on one rank
holds the others at the next collective, which is not modelled (it depends on the whole
program's heap; :mod:`remat.integrations.collector`). :meth:`Overheads.fit` turns a trace's sums
into constants; pass others to :func:`shard` (and :func:`remat.planning.replication.replicate`)
for other GPUs. The fits and the runs that checked them: docs/history.md.

Limits: HSDP and CPU offload of shards are not modelled; the root's gradients are kept in full
(conservative); with a ``MixedPrecisionPolicy`` whose param dtype is narrower than the
profiled model's, the unsharded blocks in flight are counted at the profiled dtype
(conservative). The overheads' constants are one set for every GPU and dtype (a reduce-scatter's
copy-in that casts to fp32 ran at a third of the bf16 one's rate), and a phase's contention is
taken from the link time overlapping it before it is stretched (one pass, no feedback).
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
