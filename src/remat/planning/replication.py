"""DDP: what ``torch.nn.parallel.DistributedDataParallel`` over ``world`` ranks changes in one rank's
step, as a profile transform (the counterpart of :mod:`remat.planning.sharding` for FSDP2).

How: :func:`replicate` returns a new :class:`~remat.planning.costs.Profile` for one rank of a DDP
run wrapped after ``remat.apply``, with DDP's default arguments unless told otherwise, whose
``comm`` (:class:`~remat.planning.comm.Collectives`, ``kind="ddp"``) lists the step's bucketed
all-reduces. The simulator and the solver read it unchanged, as they read a sharded profile.

- memory, per rank: the whole model, plus the reducer's flat bucket buffers (the trainable
  gradients' bytes, static); with ``gradient_as_bucket_view=True`` the gradients are views of
  them, so a block no longer leaves its gradients after its backward;
- time: the gradients form one stream in backward order, cut into buckets as DDP cuts them (the
  first 1 MiB, then ``bucket_cap_mb``, parameters never split; by the model's parameters where
  :func:`remat.plan` passes them, else by bytes); a bucket's all-reduce starts once its last
  gradient is produced and moves ``2 (world - 1) / world`` of its bytes over each link, and the
  step ends when the link is done;
- on the compute stream: the copies into (and, without bucket views, out of) the buckets,
  ``latency_s`` per all-reduce and ``contention`` while the link is busy (:data:`DDP_OVERHEADS`;
  refit with ``benchmarks/ddp_bench.py --trace``, FSDP2's constants do not carry over).

Why a transform: as for FSDP2, no process group is needed and the single-GPU profile stays the
one source of truth. The bucket rules were checked against torch 2.13's ``distributed.py`` and
``reducer.cpp``.

Limits: ``broadcast_buffers``, ``find_unused_parameters``, ``static_graph``, communication hooks and
DDP's mixed precision are not modelled; backward order within a block is the reverse of
registration; the first iteration's single bucket is not modelled. The details and measurements:
docs/design/planning.md.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from remat.planning.calls import refuse_calls
from remat.planning.comm import Collectives
from remat.planning.costs import Profile
from remat.planning.sharding import Overheads, check_bus

DDP_OVERHEADS = Overheads(hbm_Bps_fraction=0.8, contention=0.2, latency_s=50e-6)
"""What :func:`replicate` charges beside the link (see the module docstring): estimates, not fitted."""
FIRST_BUCKET_BYTES = 1024 * 1024
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket's cap under DDP's default."""
BUCKET_CAP_MB = 25
"""DDP's default ``bucket_cap_mb`` (MiB)."""


def replicate(profile: Profile, world: int, *, bucket_cap_mb: Optional[float] = None,
              gradient_as_bucket_view: bool = False, bus_Bps: Optional[float] = None,
              class_grad_bytes: Optional[tuple] = None, grad_bytes: Optional[int] = None,
              stream: Optional[tuple] = None, overheads: Overheads = DDP_OVERHEADS) -> Profile:
    """``profile`` as one of ``world`` DDP ranks sees it (see the module docstring).

    ``bucket_cap_mb`` / ``gradient_as_bucket_view``: as passed to ``DistributedDataParallel``
    (None: its default, 25 MiB buckets after a first one of 1 MiB). ``bus_Bps``: collective bus
    bandwidth in bytes/s; default the profile's rates. ``class_grad_bytes``: per block class, one
    block's trainable gradient bytes; default what the profile measured a ``keep`` block leaves
    after its backward, less its input's gradient. ``grad_bytes``: the model's trainable gradient
    bytes; default every parameter's (``profile.param_bytes``). :func:`remat.plan` passes both,
    read from the model (frozen parameters have no gradient: LoRA). ``stream``: the trainable
    parameters' ``(owner, gradient bytes)`` in backward order (owner a block index, ``"head"`` or
    ``"embeddings"``: :func:`remat.planner.gradient_stream`), to cut buckets at parameter ends as DDP
    does; without it the bytes are cut at the caps. ``overheads``: the copies, contention and
    latency charged beside the link.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"the DDP world size must be a positive integer (ranks each holding the model), got {world!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive size in MiB (DDP's default: 25), got {bucket_cap_mb!r}")
    bus = check_bus(profile, bus_Bps)
    if class_grad_bytes is None:
        class_grad_bytes = tuple(max(0, costs["keep"].bwd_end - profile.hidden_bytes) if "keep" in costs else 0
                                 for costs in profile.classes)
    if len(class_grad_bytes) != len(profile.classes):
        raise ValueError(f"class_grad_bytes has {len(class_grad_bytes)} entries for {len(profile.classes)} block "
                         "classes: one block's trainable gradient bytes per class")
    per_block = [int(class_grad_bytes[c]) for c in profile.block_class]
    total = int(profile.param_bytes if grad_bytes is None else grad_bytes)
    root = max(0, total - sum(per_block))
    if world == 1:
        return profile
    refuse_calls(profile, "DDP's time and memory")   # a shared module's gradients are ready at its last backward
    cap = int((BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets, tail = _buckets(per_block, root, first, cap) if stream is None else _param_buckets(stream, len(per_block),
                                                                                                 first, cap)

    def viewed(cost, grads):  # the gradients live in the buckets (static), not in what the block leaves
        return replace(cost, bwd_end=max(0, cost.bwd_end - grads)) if gradient_as_bucket_view else cost

    n = len(per_block)
    comm = Collectives(world=world, bus_Bps=bus, kind="ddp", gather_bytes=(0,) * n,
                       reduce_bytes=tuple(sum(b for _, b in block) for block in buckets),
                       root_gather_bytes=0, root_reduce_bytes=sum(tail), buckets=buckets,
                       bus_measured=bus_Bps is not None, reshard_after_forward=False,
                       fwd_copy_bytes=(0,) * n, bwd_copy_bytes=tuple(2 * g for g in per_block),
                       fwd_launches=(0,) * n, bwd_launches=tuple(len(block) for block in buckets),
                       root_bwd_copy_bytes=2 * root, root_bwd_launches=len(tail),
                       final_copy_bytes=0 if gradient_as_bucket_view else 2 * total,
                       **overheads.fields(profile.rates.hbm_Bps))
    return replace(profile.with_costs(lambda c, t, cost: viewed(cost, class_grad_bytes[c])),
                   static_bytes=int(profile.static_bytes + total), comm=comm,
                   notes=dict(profile.notes, ddp_world=world, gradient_as_bucket_view=bool(gradient_as_bucket_view),
                              bucket_cap_mb=bucket_cap_mb if bucket_cap_mb is not None else BUCKET_CAP_MB))


def _buckets(per_block, root, first, cap):
    """Cut the gradient stream (blocks last to first, then the root) into buckets: per block, the
    ``(fraction of its backward, bytes)`` of each bucket that fills in it; and the sizes of those
    that fill in the root's part (after the embeddings' backward)."""
    order = list(reversed(range(len(per_block))))
    spans, at = {}, 0
    for i in order:
        spans[i] = (at, at + per_block[i])
        at += per_block[i]
    end = at + root
    cuts, edge = [], first
    while edge < end:
        cuts.append(edge)
        edge += cap
    cuts.append(end)
    buckets, tail, begin = {i: [] for i in order}, [], 0
    for cut in cuts:
        if cut <= begin:
            continue
        owner = next((i for i in order if spans[i][0] < cut <= spans[i][1]), None)
        if owner is None:
            tail.append(cut - begin)
        else:
            s, e = spans[owner]
            buckets[owner].append(((cut - s) / (e - s), cut - begin))
        begin = cut
    return tuple(tuple(buckets[i]) for i in range(len(per_block))), tuple(tail)


def _param_buckets(stream, blocks: int, first: int, cap: int):
    """As :func:`_buckets`, from parameters in backward order, never split: a bucket takes parameters
    until it reaches its cap (``first`` for the first one), as DDP's rebuilt buckets do, and is
    all-reduced once its last parameter's gradient is produced: at the end of that block's
    backward, at the start of the last block's for the head's parameters (their gradients come
    before any block's), after the embeddings' backward for theirs."""
    buckets, tail = {i: [] for i in range(blocks)}, []
    size, limit = 0, first
    for index, (owner, nbytes) in enumerate(stream):
        size += int(nbytes)
        if size < limit and index + 1 < len(stream):
            continue
        if owner == "embeddings" or blocks == 0:
            tail.append(size)
        elif owner == "head":
            buckets[blocks - 1].append((0.0, size))
        else:
            buckets[int(owner)].append((1.0, size))
        size, limit = 0, cap
    for block in buckets.values():
        block.sort()  # issue order within a block's backward
    return tuple(tuple(buckets[i]) for i in range(blocks)), tuple(tail)

