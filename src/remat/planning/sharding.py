"""FSDP2: what sharding over ``world`` ranks changes in one rank's step, as a profile transform.

How: :func:`shard` returns a new :class:`~remat.planning.costs.Profile` whose static bytes and
per-block bytes are those of one rank under FSDP2 ``fully_shard`` applied to every block and
then to the root (after ``remat.apply``, as remat requires), and whose ``comm``
(:class:`~remat.planning.costs.Collectives`) lists the step's all-gathers and reduce-scatters.
The simulator and the solver read the transformed profile unchanged, so a plan for a sharded
run is solved exactly like one for a single GPU. Memory, per rank:

- parameters and optimizer state: ``1/world`` of them stay (static);
- all-gathered parameters in flight: the current block's and the prefetched one's, counted
  as two of the largest block's parameters, all step long (a bound: between blocks there
  are at most two unsharded). With ``reshard_after_forward=False`` a block stays unsharded
  from its forward to the end of its backward: its parameters join what it keeps (and its
  forward and backward peaks), and only the prefetched block is counted in static (a bound
  that counts one block too many in the head and the backward);
- the root's own parameters (embeddings, final norm, LM head) unsharded, in full, all step
  long (FSDP2 keeps the root unsharded from its forward to the end of its backward);
- each block's parameter gradients: full size during its backward (already in the block's
  measured backward peak), then reduce-scattered, so ``1/world`` of them stay afterwards.

Time: one all-gather per block in forward and (resharded) again in backward, one
reduce-scatter per block, the root's all-gather first and its reduce-scatter last; bytes in
the param dtype (gathers) and the reduce dtype (``MixedPrecisionPolicy(reduce_dtype=...)``,
default the param dtype); seconds at the bus bandwidth ``bus_Bps`` (the profile's rates, or a
rate measured on the process group: :func:`remat.profiling._calibrate.bus_rate`). A treatment
that recomputes adds no all-gather: FSDP2 keeps the block unsharded through its backward, the
recompute included (65 all-gathers, 33 reduce-scatters per step for every treatment on a
32-layer model, ``benchmarks/results/issue12``). How the collectives overlap compute is the
simulator's (:mod:`remat.planning.simulator`).

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

Limits: HSDP and CPU offload of shards are not modelled; the root's gradients are kept in full
(conservative); with a ``MixedPrecisionPolicy`` whose param dtype is narrower than the
profiled model's, the unsharded blocks in flight are counted at the profiled dtype
(conservative). FSDP2's copy-in/copy-out around each collective and the SMs NCCL takes from
compute are not charged.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from remat.planning.costs import Collectives, Profile, dtype_bytes


def shard(profile: Profile, world: int, class_param_bytes: tuple, *, reshard_after_forward: bool = True,
          param_dtype=None, reduce_dtype=None, bus_Bps: Optional[float] = None) -> Profile:
    """``profile`` as one of ``world`` FSDP2 ranks sees it (see the module docstring).

    ``reshard_after_forward``: as passed to ``fully_shard`` for the blocks (the root is never
    resharded after forward). ``param_dtype`` / ``reduce_dtype``: a ``MixedPrecisionPolicy``'s
    (names or torch dtypes); default the profiled model's dtype, and the param dtype.
    ``bus_Bps``: collective bus bandwidth in bytes/s; default the profile's rates.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"the FSDP world size must be a positive integer (ranks sharing the model), got {world!r}")
    if len(class_param_bytes) != len(profile.classes):
        raise ValueError(f"class_param_bytes has {len(class_param_bytes)} entries for {len(profile.classes)} "
                         "block classes; use remat.profiling.profiler.block_param_bytes(model, profile)")
    bus = profile.rates.bus_Bps if bus_Bps is None else bus_Bps
    if not bus or bus <= 0:
        raise ValueError(f"bus_Bps must be a positive rate in bytes/s (e.g. 330e9 for NVLink H100), got {bus_Bps!r}")
    if world == 1:
        return profile
    kept = 1.0 - 1.0 / world
    blocks = sum(class_param_bytes[c] for c in profile.block_class)
    root = max(0, profile.param_bytes - blocks)
    in_flight = (2 if reshard_after_forward else 1) * max(class_param_bytes)
    static = (profile.static_bytes - (profile.param_bytes + profile.optimizer_bytes) * kept
              + root * kept + in_flight)

    def sharded(cost, params):
        cost = replace(cost, bwd_end=int(cost.bwd_end - params * kept))
        if reshard_after_forward:
            return cost
        return replace(cost, kept=cost.kept + params, fwd_peak=cost.fwd_peak + params,
                       bwd_peak=cost.bwd_peak + params)

    classes = tuple({t: sharded(cost, class_param_bytes[c]) for t, cost in costs.items()}
                    for c, costs in enumerate(profile.classes))
    model_bytes = dtype_bytes(profile.dtype)
    gather = dtype_bytes(param_dtype) / model_bytes if param_dtype is not None else 1.0
    reduce = (dtype_bytes(reduce_dtype) / model_bytes) if reduce_dtype is not None else gather
    per_block = [class_param_bytes[c] for c in profile.block_class]
    comm = Collectives(world=world, bus_Bps=float(bus), reshard_after_forward=bool(reshard_after_forward),
                       gather_bytes=tuple(int(b * gather) for b in per_block),
                       reduce_bytes=tuple(int(b * reduce) for b in per_block),
                       root_gather_bytes=int(root * gather), root_reduce_bytes=int(root * reduce),
                       bus_measured=bus_Bps is not None)
    return replace(profile, static_bytes=int(static), classes=classes, comm=comm,
                   notes=dict(profile.notes, fsdp_world=world, reshard_after_forward=bool(reshard_after_forward)))


def comm_notes(profile: Profile, sim) -> dict:
    """What a plan's notes say of the collectives (``sim``: its :class:`~remat.planning.simulator.Simulation`);
    empty on one GPU."""
    comm = profile.comm
    if comm is None:
        return {}
    def s(x):  # four significant digits: a tiny model's collectives take microseconds
        return float(f"{x:.4g}")
    return {"fsdp_world": comm.world, "reshard_after_forward": comm.reshard_after_forward,
            "bus_GBps": round(comm.bus_Bps / 1e9, 1), "bus_measured": comm.bus_measured,
            "comm_s": s(sim.comm_s), "exposed_comm_s": s(sim.exposed_comm_s),
            "compute_s": s(sim.step_s - sim.exposed_comm_s)}
