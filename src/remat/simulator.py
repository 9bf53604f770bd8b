"""``remat.simulate``: the peak memory and step time of one training step under a plan.

How: a pure walk over the profile (:mod:`remat.profiler`), phase by phase, in the order the
step runs: embeddings, each block's forward, the head's forward, the head's backward, each
block's backward in reverse, the embeddings' backward. It carries the live bytes from one
phase to the next and adds each phase's own peak on top:

- static: parameters, buffers, optimizer state (allocated before the step);
- forward of block i: what blocks 0..i-1 keep + the hidden state + block i's forward
  peak + the offloaded bytes of block i-1 still being copied to the host;
- head: everything the blocks keep + the head's working set (logits, loss);
- backward of block i: what blocks 0..i-1 keep + gradients produced so far + block i's
  backward peak (its recompute included; offloaded tensors are back) + block i-1's
  offloaded tensors being prefetched.

Block costs were measured alone, with their input and shared inputs (rotary tables) as
the zero; the head's in a step whose blocks keep nothing. The simulator rebases each on
the live set at that point, so the sum is exact for a sequential stack whatever mix of
treatments is chosen.

Offload (the model :mod:`remat.offload` is held to): a block's offloaded bytes leave the
GPU once copied, while the next block computes, and return during the backward of the
block after it (one block ahead); a copy that takes longer than the compute it overlaps
adds the difference to the step. Copies run at the pinned rates of the profile's GPU.

The same pairwise model is what :mod:`remat.solver` optimises, so its plans and this
simulator agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .plans import OFFLOADING_TREATMENTS, Plan


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    step_s: float
    tokens_per_s: float
    peak_at: str
    static_bytes: int
    head: str
    chunk_tokens: Optional[int]
    timeline: tuple = field(default=(), repr=False)  # (phase, peak_bytes, end_bytes, start_s, end_s)
    offload_bytes: int = 0
    exposed_copy_s: float = 0.0


def block_treatments(profile, plan) -> list:
    """Treatments in block order from a Plan, a ``{name: treatment}`` mapping, a list or one name."""
    names = profile.block_names
    if isinstance(plan, str):
        return [plan] * len(names)
    if isinstance(plan, Plan):
        plan = plan.blocks
    if isinstance(plan, (list, tuple)):
        if len(plan) != len(names):
            raise ValueError(f"a plan as a list needs one treatment per block ({len(names)}), got {len(plan)}")
        return list(plan)
    if hasattr(plan, "get"):
        unknown = [n for n in plan if n not in names]
        if unknown:
            raise ValueError(f"plan names blocks the profile does not have: {unknown[:3]} "
                             f"(profiled blocks: {list(names[:3])} ...)")
        return [plan.get(name, "keep") for name in names]
    raise TypeError(f"plan must be a remat.Plan, a mapping, a list of treatments or a treatment name, "
                    f"got {type(plan).__name__}")


def simulate(profile, plan, *, head: Optional[str] = None, chunk_tokens: Optional[int] = None) -> Simulation:
    """Predicted peak bytes, step seconds and what sets the peak, for ``plan`` on ``profile``.

    ``head``/``chunk_tokens`` default to the plan's own (a Plan) or ``"plain"``.
    """
    treatments = block_treatments(profile, plan)
    if isinstance(plan, Plan):
        head = head or plan.head
        chunk_tokens = chunk_tokens or plan.chunk_tokens
    head_cost = profile.head(head or "plain", chunk_tokens)
    costs = [profile.cost(i, t) for i, t in enumerate(treatments)]
    rates = profile.rates
    off = [c.offload_bytes if t in OFFLOADING_TREATMENTS else 0 for c, t in zip(costs, treatments)]
    names = profile.block_names
    static = profile.static_bytes
    timeline = []
    clock = 0.0
    exposed = 0.0

    def phase(name, peak, end, seconds):
        nonlocal clock
        timeline.append((name, int(peak), int(end), clock, clock + seconds))
        clock += seconds

    h = head_cost
    phase("forward: embeddings", static + h.pre_peak, static + h.pre_end, h.pre_fwd_s)
    live = static + h.pre_end
    x_free = profile.hidden_bytes  # bytes freed when a block does not save its input
    for i, c in enumerate(costs):
        inflight = off[i - 1] if i else 0
        peak = live + inflight + c.fwd_peak
        live += c.kept + (0 if c.saves_input else -x_free) + c.out_alive - off[i]
        x_free = c.out_alive
        next_fwd = costs[i + 1].fwd_s if i + 1 < len(costs) else h.head_fwd_s
        hidden = max(0.0, off[i] / rates.d2h_Bps - next_fwd) if off[i] else 0.0
        exposed += hidden
        phase(f"forward of block {i} ({names[i]}, {treatments[i]})", peak, live, c.fwd_s + hidden)
    extra = live - (static + h.pre_end)  # what the blocks keep beyond the stubbed run
    phase("forward: head and loss", static + extra + h.head_fwd_peak + (off[-1] if off else 0),
          static + extra + h.head_fwd_end, h.head_fwd_s)
    phase("backward: head and loss", static + extra + h.head_bwd_peak, static + extra + h.head_bwd_end,
          h.head_bwd_s)
    live = static + extra + h.head_bwd_end
    for i in reversed(range(len(costs))):
        c = costs[i]
        base = live - (c.kept + (profile.hidden_bytes if c.saves_input else 0) - off[i]) - c.out_bytes
        prefetch = off[i - 1] if i else 0
        peak = base + c.bwd_peak + (profile.hidden_bytes if c.saves_input else 0) + prefetch
        live = base + c.bwd_end
        wait = off[i] / rates.h2d_Bps if (off[i] and i == len(costs) - 1) else 0.0
        if prefetch:
            wait += max(0.0, prefetch / rates.h2d_Bps - c.bwd_s)
        exposed += wait
        what = "recompute + backward" if treatments[i] not in ("keep", "offload") else "backward"
        phase(f"backward of block {i} ({names[i]}, {treatments[i]}: {what})", peak, live, c.bwd_s + wait)
    # the stubbed run reached the embeddings' backward with ``head_bwd_end`` alive
    phase("backward: embeddings", live + h.pre_bwd_peak - h.head_bwd_end, live + h.pre_bwd_end - h.head_bwd_end,
          h.pre_bwd_s)
    top = max(timeline, key=lambda p: p[1])
    return Simulation(top[1], clock, profile.tokens / clock if clock else 0.0, top[0], static,
                      h.mode, h.chunk_tokens, tuple(timeline), sum(off), exposed)
