"""Context parallelism: what splitting the sequence over ``world`` ranks changes in one rank's step,
as a profile transform.

How: the profile is taken on one rank's piece (``seq / world`` tokens: :func:`remat.plan` cuts the
batch before profiling, :mod:`remat.parallel.sequence` cuts it the same way when training), so
every activation, every token-wise cost and the head are already a rank's. What that piece alone
does not show is attention over the rest of the sequence, which :func:`context` adds to each
block's cost for every treatment, as torch's ring attention runs it on a GPU
(``torch.distributed.tensor.experimental.context_parallel``, its default all-gather rotation, no
load balancing: :mod:`remat.parallel.attention`):

- compute: the pieces are contiguous, so rank ``r`` attends to ``r`` whole pieces beyond its own
  causal one; the step waits for the last rank, whose ``world - 1`` extra ``s x s`` blocks are charged
  (forward ``4 b h s^2 d`` FLOPs each at the attention rate measured for the head dimension, else
  the matmul rate x :data:`ATTENTION_EFFICIENCY`; backward :data:`BACKWARD_FACTOR` times that
  at the backward's rate);
- exchange: in forward one all-gather of every rank's keys and values (``world x`` a rank's K/V,
  ``(world - 1) / world`` of it over each GPU's link at the bus rate), overlapped with the rank's own
  causal block only; in backward the same all-gather again (overlapped with that block's backward),
  and the K/V gradients passed around the ring in fp32, ``world`` hops, each hidden behind the next
  block's backward but the last; what the compute does not hide is added to the block's forward or
  backward seconds, with :data:`LATENCY_S` per collective;
- memory: during attention's forward the gathered K/V (``world x`` a rank's) and the fp32 output
  the ring merges into; during its backward the gathered K/V again, fp32 accumulators of the query
  gradient and of the K/V gradients (with the hop's receive and send buffers): added to the block's
  forward and backward peaks (transient: nothing more is kept for backward than the piece's own
  q, k, v, output and log-sum-exp, which the profile already holds);
- recompute: a treatment whose recompute runs attention (:data:`RECOMPUTES_ATTENTION`) repeats, in
  its backward, the forward's extra compute and exchange. ``selective`` keeps the attention
  kernel's output, so its recompute neither exchanges nor attends again on the GPU (the CPU's
  all-gather path repeats the exchange: tests/test_context_parallel.py counts it).

Parameters, gradients and optimizer state are sharded by :func:`remat.planning.sharding.shard` over
``fsdp_world`` ranks (torchtitan shards them over every rank, CP ranks included: ``fsdp_world =
cp x dp``); this transform composes with it in either order.

Why a transform (as :mod:`remat.planning.sharding`): no process group is needed, so ``remat plan
--cp 4 --fsdp 4`` answers on a laptop, and the one-GPU profile of a piece stays the measured truth.

Limits: modelled, not measured (the GPU bench, ``benchmarks/cp_bench.py``, is what checks it);
every block is taken to hold one attention of :class:`AttentionShape` (hybrid models' other
mixers are charged as attention); the ring's traffic and FSDP2's share the link but are charged
apart; a rank's own causal block is in the profile at the piece's length, so it is not charged
again; the load-balanced layout (every rank ``(world - 1/2)`` blocks on average instead of the last
rank's ``world - 1/2``) is not modelled, as remat does not shard that way.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from remat.planning.costs import Profile, dtype_bytes

ATTENTION_EFFICIENCY = 0.45
"""Attention kernels' FLOP rate as a fraction of the matmul rate where the profile's rates hold no
measured attention rate for the head dimension (:meth:`remat.planning.costs.Rates.attention_flops`,
which bf16/fp16 attention uses otherwise), as the fake-tensor roofline takes it."""
BACKWARD_FACTOR = 2.5
"""Attention's backward FLOPs over its forward's (flash attention: five matmuls against two)."""
LATENCY_S = 50e-6
"""Seconds per CP collective on the compute stream beyond its bytes (a guess, not fitted)."""
RECOMPUTES_ATTENTION = frozenset({"full", "attention", "full+offload", "full+tiled", "full+offload+tiled"})
"""Treatments whose recompute runs the block's attention again, its exchange included."""


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """One block's attention, as context parallelism exchanges it (read from a Hugging Face config by
    :func:`remat.planner.attention_shape`)."""

    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (fewer under GQA: what the ring passes around)."""
    head_dim: int
    """Per head, of queries and keys."""
    value_dim: Optional[int] = None
    """Per head, of values (None: ``head_dim``)."""


def context(profile: Profile, world: int, attention: AttentionShape, *, bus_Bps: Optional[float] = None) -> Profile:
    """``profile`` (of one rank's ``seq / world`` tokens) as one of ``world`` context-parallel ranks
    sees its step (see the module doc). ``bus_Bps``: the link's bus bandwidth; default the profile's."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the context-parallel world size must be a positive integer, got {world!r}")
    if world == 1:
        return profile
    charge = charges(profile, world, attention, bus_Bps=bus_Bps)

    def ringed(treatment, cost):
        again = treatment in RECOMPUTES_ATTENTION
        return replace(cost, fwd_s=cost.fwd_s + charge["fwd_s"],
                       bwd_s=cost.bwd_s + charge["bwd_s"] + (charge["fwd_s"] if again else 0.0),
                       fwd_peak=cost.fwd_peak + charge["fwd_bytes"], bwd_peak=cost.bwd_peak + charge["bwd_bytes"])
    blocks = len(profile.block_names)
    notes = dict(profile.notes, cp_world=world, cp_seq=profile.seq * world,
                 cp_exchange_bytes=int(charge["exchange_bytes"] * blocks),
                 cp_exposed_s=round((charge["fwd_exposed_s"] + charge["bwd_exposed_s"]) * blocks, 6),
                 cp_attention_s=round(charge["compute_s"] * blocks, 6))
    return replace(profile.with_costs(lambda c, t, cost: ringed(t, cost)), notes=notes)


NOTES = ("cp_world", "cp_seq", "cp_exchange_bytes", "cp_exposed_s", "cp_attention_s")
"""What a plan's notes say of context parallelism (:func:`context_notes`)."""


def context_notes(profile: Profile) -> dict:
    """The plan's notes on context parallelism (empty on one CP rank): the CP world, the whole
    sequence's length, the bytes over the rank's link for attention's exchange per step (recompute
    not counted), the seconds of it compute does not hide, and the extra attention compute the last
    rank does beyond its piece's own (forward and backward, every block; recompute not counted)."""
    return {k: profile.notes[k] for k in NOTES if k in profile.notes}


def charges(profile: Profile, world: int, attention: AttentionShape, *, bus_Bps: Optional[float] = None) -> dict:
    """What one block's attention adds on the last CP rank (see the module doc): ``fwd_s`` /
    ``bwd_s`` (extra compute and exposed exchange), ``fwd_bytes`` / ``bwd_bytes`` (transient peaks),
    and for the notes ``compute_s``, ``fwd_exposed_s``, ``bwd_exposed_s``, ``exchange_bytes``
    (bytes over this GPU's link per step, without recompute)."""
    b, s = profile.batch, profile.seq
    element = dtype_bytes(profile.dtype)
    d, dv = attention.head_dim, attention.value_dim or attention.head_dim
    kv = b * s * attention.kv_heads * (d + dv) * element          # one rank's keys and values
    q = b * s * attention.heads * d * element
    fallback = (profile.rates.fp32_flops if element >= 4 else profile.rates.matmul_flops) * ATTENTION_EFFICIENCY
    measured = element < 4 and profile.rates.attention_flops(d, False) is not None
    rate = profile.rates.attention_flops(d, False) if measured else fallback
    backward_rate = profile.rates.attention_flops(d, True) if measured else fallback
    block_s = 2 * b * attention.heads * s * s * (d + dv) / rate   # one whole s x s block, forward
    backward_block_s = block_s * rate / backward_rate             # its backward's FLOPs / BACKWARD_FACTOR
    extra = world - 1
    bus = bus_Bps or profile.rates.bus_Bps
    gather_s = extra * kv / bus                                     # world x kv gathered, (world-1)/world moved
    hop_s = kv * 4 / element / bus                                  # fp32 K/V gradients, one hop
    fwd_exposed = max(0.0, gather_s - block_s / 2) + LATENCY_S      # hidden behind the causal block only
    bwd_exposed = (max(0.0, gather_s - BACKWARD_FACTOR * backward_block_s / 2) + extra * max(
        0.0, hop_s - BACKWARD_FACTOR * backward_block_s) + hop_s + (1 + world) * LATENCY_S)
    fp32 = 4 / element
    return dict(fwd_s=extra * block_s + fwd_exposed, bwd_s=BACKWARD_FACTOR * extra * backward_block_s + bwd_exposed,
                fwd_bytes=int(world * kv + q * fp32), bwd_bytes=int(world * kv + (q + 3 * kv) * fp32),
                compute_s=(1 + BACKWARD_FACTOR) * extra * block_s, fwd_exposed_s=fwd_exposed,
                bwd_exposed_s=bwd_exposed, exchange_bytes=int(2 * extra * kv + world * kv * fp32))
