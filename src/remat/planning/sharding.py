"""FSDP2: what sharding over ``world`` ranks changes in one rank's memory, as a profile transform.

How: :func:`shard` returns a new :class:`~remat.planning.costs.Profile` whose static bytes and
per-block gradient bytes are those of one rank under FSDP2 ``fully_shard`` applied to every
block and then to the root (after ``remat.apply``, as remat requires), with the defaults
(``reshard_after_forward=True``, one block prefetched). The simulator and the solver read
the transformed profile unchanged, so a plan for a sharded run is solved exactly like one
for a single GPU. The model, per rank:

- parameters and optimizer state: ``1/world`` of them stay (static);
- all-gathered parameters in flight: the current block's and the prefetched one's, counted
  as two of the largest block's parameters, all step long (a bound: between blocks there
  are at most two unsharded);
- the root's own parameters (embeddings, final norm, LM head) unsharded, in full, all step
  long (FSDP2 keeps the root unsharded from its forward to the end of its backward);
- each block's parameter gradients: full size during its backward (already in the block's
  measured backward peak), then reduce-scattered, so ``1/world`` of them stay afterwards.

Why a transform rather than a profile taken under FSDP: it needs no process group, so
``remat plan --fsdp 8`` answers on a laptop for a cluster, and the single-GPU profile,
whose numbers are validated, stays the one source of truth.

``class_param_bytes`` (parameter bytes of one block per block class) comes from the model:
:func:`remat.profiling.profiler.block_param_bytes` reads it, so this module never sees a model.

Limits: collective time is not modelled (FSDP2 overlaps all-gathers and reduce-scatters with
compute; a slow interconnect makes steps longer than predicted); HSDP, ``reshard_after_
forward=False`` and CPU offload of shards are not modelled; the root's gradients are kept in
full (conservative).
"""
from __future__ import annotations

from dataclasses import replace

from remat.planning.costs import Profile


def shard(profile: Profile, world: int, class_param_bytes: tuple) -> Profile:
    """``profile`` as one of ``world`` FSDP2 ranks sees it (see the module docstring)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"the FSDP world size must be a positive integer (ranks sharing the model), got {world!r}")
    if len(class_param_bytes) != len(profile.classes):
        raise ValueError(f"class_param_bytes has {len(class_param_bytes)} entries for {len(profile.classes)} "
                         "block classes; use remat.profiling.profiler.block_param_bytes(model, profile)")
    if world == 1:
        return profile
    kept = 1.0 - 1.0 / world
    blocks = sum(class_param_bytes[c] for c in profile.block_class)
    root = max(0, profile.param_bytes - blocks)
    static = (profile.static_bytes - (profile.param_bytes + profile.optimizer_bytes) * kept
              + root * kept + 2 * max(class_param_bytes))
    classes = tuple({t: replace(cost, bwd_end=int(cost.bwd_end - class_param_bytes[c] * kept))
                     for t, cost in costs.items()}
                    for c, costs in enumerate(profile.classes))
    return replace(profile, static_bytes=int(static), classes=classes,
                   notes=dict(profile.notes, fsdp_world=world))
