"""Context parallelism: what splitting the sequence over ``world`` ranks changes in one rank's step,
as a profile transform.

How: the profile is taken on one rank's share (``seq / world`` tokens: :func:`remat.plan` cuts the
batch before profiling, :mod:`remat.parallel.sequence` cuts it the same way when training), so
every activation, token-wise cost and the head are already a rank's. What that share does not show
is attention over the rest of the sequence, which :func:`context` adds to each block's cost for
every treatment, as torch's ring attention runs it (``context_parallel``, its all-gather rotation:
:mod:`remat.parallel.attention`), for the layout the batch is cut with (``balance``):

- compute: the ``s x s`` attention blocks beyond the share's own (balanced: ``(world - 1) / 2`` of
  them; contiguous: the last rank's ``world - 1``), at the attention rate of the head dimension;
- exchange: the K/V all-gather in forward and backward and the K/V gradients' ring in fp32, at the
  bus rate, less what the compute hides, plus :data:`LATENCY_S` per collective;
- memory (:func:`ring_buffer_bytes`): the gathered K/V, merge and accumulator buffers, added to the
  block's forward and backward peaks (transient, nothing more is kept);
- recompute: a treatment in :data:`RECOMPUTES_ATTENTION` repeats the forward's extra work.

Parameters, gradients and optimizer state are sharded by :func:`remat.planning.sharding.shard` over
``fsdp_world`` ranks (torchtitan: ``cp x dp``); the two transforms compose in either order.

Why a transform (as :mod:`remat.planning.sharding`): no process group is needed, so ``remat plan
--cp 4 --fsdp 4`` answers on a laptop, and the one-GPU profile of a share stays the measured truth.

Limits: a model, checked on 2 x H100 by ``benchmarks/cp_bench.py`` (llama-8b, CP 2: the step within
0.2% of its prediction, the last rank's peak 5.6% over it, 5.4% after the merge charge was fixed, the
cause of the rest not found, so plan CP runs 8 GiB under the card: benchmarks/results/issue32), not
on larger groups; tests/cp_worker.py checks the buffers against torch's code; every block holds one attention of
:class:`AttentionShape`; the ring's and FSDP2's traffic are charged apart; half-block steps run at
the whole block's rate. The terms in full: docs/design/planning.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from remat.planning.calls import calls
from remat.planning.costs import Profile, dtype_bytes

ATTENTION_EFFICIENCY = 0.45
"""Attention kernels' FLOP rate as a fraction of the matmul rate where the profile's rates hold no
measured attention rate for the head dimension (:meth:`remat.planning.costs.Rates.attention_flops`,
which bf16/fp16 attention uses otherwise), as the fake-tensor roofline takes it."""
BACKWARD_FACTOR = 2.5
"""Attention's backward FLOPs over its forward's (flash attention: five matmuls against two)."""
LATENCY_S = 50e-6
"""Seconds per CP collective on the compute stream beyond its bytes (a guess, not fitted)."""
MERGE_QUERIES = 8
"""Bytes of the ring's forward merge beyond the share's own attention, in bf16 queries ``q``: torch's
``_SDPAMerger`` holds the running output in fp32 (2q) and, merging a step, the step's bf16 output
(q), its fp32 copy (2q), ``sigmoid(...) * (out - block_out)`` (2q) and the new running output (2q)
at once: 9q, of which the share's own attention output (q) is in the profile. (Charged as 2q, and
not at all in a recompute, before: on 2 x H100, llama-8b at 262,144 tokens, the last rank peaked 3.7
GiB over such a plan, in the backward of a recomputed block, and a 76 GiB plan ran out of memory:
``benchmarks/results/issue32``.)"""
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


def context(profile: Profile, world: int, attention: AttentionShape, *, bus_Bps: Optional[float] = None,
            balance: bool = True) -> Profile:
    """``profile`` (of one rank's ``seq / world`` tokens) as one of ``world`` context-parallel ranks
    sees its step (see the module doc). ``bus_Bps``: the link's bus bandwidth; default the profile's.
    ``balance``: the sequence cut head-tail (every rank's share of attention alike) or contiguous
    (the last rank's, the most)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the context-parallel world size must be a positive integer, got {world!r}")
    if world == 1:
        return profile
    charge = charges(profile, world, attention, bus_Bps=bus_Bps, balance=balance)

    def ringed(treatment, cost):
        again = treatment in RECOMPUTES_ATTENTION
        # a recompute runs the ring's forward inside the block's backward phase: its merge too
        transient = max(charge["bwd_bytes"], charge["fwd_bytes"]) if again else charge["bwd_bytes"]
        return replace(cost, fwd_s=cost.fwd_s + charge["fwd_s"],
                       bwd_s=cost.bwd_s + charge["bwd_s"] + (charge["fwd_s"] if again else 0.0),
                       fwd_peak=cost.fwd_peak + charge["fwd_bytes"], bwd_peak=cost.bwd_peak + transient)
    blocks = len(calls(profile))   # a block called N times exchanges N times
    notes = dict(profile.notes, cp_world=world, cp_seq=profile.seq * world, cp_balance=bool(balance),
                 cp_exchange_bytes=int(charge["exchange_bytes"] * blocks),
                 cp_exposed_s=round((charge["fwd_exposed_s"] + charge["bwd_exposed_s"]) * blocks, 6),
                 cp_attention_s=round(charge["compute_s"] * blocks, 6))
    return replace(profile.with_costs(lambda c, t, cost: ringed(t, cost)), notes=notes)


NOTES = ("cp_world", "cp_seq", "cp_balance", "cp_exchange_bytes", "cp_exposed_s", "cp_attention_s")
"""What a plan's notes say of context parallelism (:func:`context_notes`)."""


def context_notes(profile: Profile) -> dict:
    """The plan's notes on context parallelism (empty on one CP rank): the CP world, the whole
    sequence's length, the layout (balanced or not), the bytes over the rank's link for attention's
    exchange per step (recompute not counted), the seconds of it compute does not hide, and the
    extra attention compute the rank charged does beyond its share's own (every rank balanced, the
    last contiguous; forward and backward, every block; recompute not counted)."""
    return {k: profile.notes[k] for k in NOTES if k in profile.notes}


def charges(profile: Profile, world: int, attention: AttentionShape, *, bus_Bps: Optional[float] = None,
            balance: bool = True) -> dict:
    """What one block's attention adds on the rank the step waits for (see the module doc): ``fwd_s`` /
    ``bwd_s`` (extra compute and exposed exchange), ``fwd_bytes`` / ``bwd_bytes`` (transient peaks),
    and for the notes ``compute_s``, ``fwd_exposed_s``, ``bwd_exposed_s``, ``exchange_bytes``
    (bytes over this GPU's link per step, without recompute), ``blocks`` (the ``s x s`` blocks of
    attention beyond the share's own)."""
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
    hops = world - 1                                                # ring steps beyond the rank's own
    step = 0.5 if balance else 1.0                                  # blocks a step: half balanced, one contiguous
    blocks = hops * step
    bus = bus_Bps or profile.rates.bus_Bps
    gather_s = hops * kv / bus                                      # world x kv gathered, (world-1)/world moved
    hop_s = kv * 4 / element / bus                                  # fp32 K/V gradients, one hop
    fwd_exposed = max(0.0, gather_s - block_s / 2) + LATENCY_S      # hidden behind the causal block only
    bwd_exposed = (max(0.0, gather_s - BACKWARD_FACTOR * backward_block_s / 2) + hops * max(
        0.0, hop_s - BACKWARD_FACTOR * backward_block_s * step) + hop_s + (1 + world) * LATENCY_S)
    fp32 = 4 / element
    fwd_bytes, bwd_bytes = ring_buffer_bytes(q, kv, world, element)
    return dict(fwd_s=blocks * block_s + fwd_exposed, bwd_s=BACKWARD_FACTOR * blocks * backward_block_s + bwd_exposed,
                fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes,
                compute_s=(1 + BACKWARD_FACTOR) * blocks * block_s, fwd_exposed_s=fwd_exposed,
                bwd_exposed_s=bwd_exposed, exchange_bytes=int(2 * hops * kv + world * kv * fp32), blocks=blocks)


def ring_buffer_bytes(q: int, kv: int, world: int, element: int) -> tuple:
    """``(forward, backward)``: bytes torch's ring attention holds on one rank beyond what one
    attention call over the rank's share holds (its kernel's work and outputs, in the profile),
    where the most is held: ``q`` the bytes of the rank's queries, ``kv`` of its keys and values
    together, ``element`` bytes an element of the model's dtype (fp32 accumulators are ``4 /
    element`` times as large).

    Forward, at the merge of a step's output into the running one: the gathered K/V (``world x
    kv``), :data:`MERGE_QUERIES` queries, and the keys and values concatenated for the all-gather
    (``kv``: alive there in some runs, as long as the collective holds its input). Backward, while a step's kernel runs: the gathered K/V;
    the fp32 query-gradient accumulator and three fp32 K/V gradients (the accumulator, the hop's send
    and its receive buffer); the step before's kernel outputs (``q + kv``), held until this step's
    replace them; the keys and values concatenated for the exchange (``kv``). (Both were charged
    without their concatenations, and the backward without the step before's outputs, until torch's
    ring run on gloo showed them: ``kv`` and ``q + 2 kv`` more.) The
    fp32 log-sum-exp-sized tensors (``1 / head_dim`` of a query each) are left out."""
    fp32 = 4 / element
    return int(world * kv + kv + MERGE_QUERIES * q), int(world * kv + (q + 3 * kv) * fp32 + q + 2 * kv)
