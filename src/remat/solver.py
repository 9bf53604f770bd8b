"""``remat.solve``: the fastest plan whose predicted peak fits a memory budget.

How: dynamic programming over the block sequence, in forward order, for each head option
(plain, and chunked at each profiled chunk size). The state after block i is the pair
(bytes the blocks 0..i keep, rounded *up* to 1/``resolution`` of the budget; the
treatment of block i), and its value the least step time to reach it. Every peak that
:mod:`remat.simulator` checks is a function of that state and of block i's own treatment:

- forward of block i: static + embeddings + kept(0..i-1) + offload in flight (block i-1) + its forward peak;
- backward of block i: static + head leftovers + kept(0..i-1) + gradients of blocks after i
  (the same whatever they chose) + its backward peak + block i-1's prefetch;
- head: static + kept(all) + the head's working set (checked after the last block).

Offload copies couple neighbours only (the simulator's pairwise model), which the previous
treatment in the state covers; so the DP is exact for the simulator up to the rounding of
kept bytes, which only ever makes it conservative: every plan it returns simulates within
the budget, and no plan is missed unless it fits by less than ``budget / resolution``
per block. Cost: blocks x treatments^2 x resolution, vectorised over the resolution with
numpy: a few hundred ms for 80 blocks.

The obvious alternative, greedy (checkpoint the biggest block until it fits), is not
optimal once treatments trade memory and time at different rates (selective vs mlp vs
full) or once the head mode changes which phase sets the peak; the tests compare against
brute force. When nothing fits, the smallest achievable peak is found by bisection on the
budget and named in the error, with its plan.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .plans import OFFLOADING_TREATMENTS, Plan
from .simulator import simulate
from .units import format_size, parse_size


class NoPlanFits(ValueError):
    """No plan fits the budget; ``smallest_peak`` and ``plan`` say what would."""

    def __init__(self, message, smallest_peak=None, plan=None):
        super().__init__(message)
        self.smallest_peak = smallest_peak
        self.plan = plan


def solve(profile, budget, *, treatments: Optional[Sequence[str]] = None, heads: Optional[Sequence[str]] = None,
          resolution: int = 4000) -> Plan:
    """The plan with the least predicted step time whose predicted peak is within ``budget``.

    ``budget``: bytes or a size string ("24GiB"). ``treatments``: the ones the solver may
    use (default: every profiled one). ``heads``: head modes allowed (default: profiled).
    Raises :class:`NoPlanFits` (a ValueError) naming the smallest achievable peak.
    """
    budget = parse_size(budget)
    options = _options(profile, treatments)
    head_options = [h for h in profile.heads if heads is None or h.mode in heads]
    if not head_options:
        raise ValueError(f"no head mode left to plan with: asked for {list(heads)}, profiled "
                         f"{sorted({h.mode for h in profile.heads})}")
    best = None
    for head in head_options:
        found = _dp(profile, options, head, budget, resolution)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], found[1], head)
    if best is None:
        smallest, plan = _smallest(profile, options, head_options, resolution)
        raise NoPlanFits(
            f"no plan fits {format_size(budget)}: the smallest predicted peak is {format_size(smallest)} "
            f"({plan.summary()}; it sets in: {plan.notes.get('peak_at')}). Raise the budget to at least "
            f"{format_size(smallest)}, shorten the batch or sequence, or free static memory "
            f"(static alone is {format_size(profile.static_bytes)}).", smallest, plan)
    _, chosen, head = best
    return _plan(profile, chosen, head, budget)


def _options(profile, treatments) -> list:
    available = profile.treatments(0)
    for i in range(len(profile.block_names)):
        available = tuple(t for t in available if t in profile.treatments(i))
    if treatments is not None:
        unknown = [t for t in treatments if t not in available]
        if unknown:
            raise ValueError(f"treatments {unknown} are not in the profile (profiled: {', '.join(available)})")
        available = tuple(t for t in available if t in treatments)
    return list(available)


def _plan(profile, chosen, head, budget) -> Plan:
    draft = Plan(dict(zip(profile.block_names, chosen)), head.mode,
                 head.chunk_tokens if head.mode == "chunked" else None)
    result = simulate(profile, draft)
    notes = {"predicted_peak_bytes": result.peak_bytes, "predicted_step_s": round(result.step_s, 5),
             "predicted_tokens_per_s": round(result.tokens_per_s, 1), "budget_bytes": budget,
             "peak_at": result.peak_at, "gpu": profile.rates.name, "measured_rates": profile.rates.measured,
             "batch": profile.batch, "seq": profile.seq, "optimizer": profile.optimizer}
    return Plan(draft.blocks, draft.head, draft.chunk_tokens, notes)


def _terms(profile, options, head):
    """Per block, per (previous, current) treatment: the numbers the constraints need."""
    rates = profile.rates
    L, T = len(profile.block_names), len(options)
    h = profile.hidden_bytes
    d = np.zeros((L, T, T))        # kept bytes added by block i
    fwd = np.zeros((L, T, T))      # forward peak above kept(0..i-1), offload in flight included
    bwd = np.zeros((L, T, T))      # backward peak above kept(0..i-1) + later blocks' leftovers
    time = np.zeros((L, T, T))
    suffix = np.zeros(L + 1)       # leftovers of blocks after i during the backward (max over treatments)
    for i in range(L):
        costs = [profile.cost(i, t) for t in options]
        off = [c.offload_bytes if t in OFFLOADING_TREATMENTS else 0 for c, t in zip(costs, options)]
        prev_costs = [profile.cost(i - 1, t) for t in options] if i else [None] * T
        prev_off = [(c.offload_bytes if t in OFFLOADING_TREATMENTS else 0) if c else 0
                    for c, t in zip(prev_costs, options)]
        for p in range(T):
            x_free = prev_costs[p].out_alive if i else h
            for t, c in enumerate(costs):
                d[i, p, t] = c.kept + (0 if c.saves_input else -x_free) + c.out_alive - off[t]
                fwd[i, p, t] = prev_off[p] + c.fwd_peak
                bwd[i, p, t] = (c.bwd_peak - c.out_bytes + c.out_alive - (0 if c.saves_input else x_free)
                                + prev_off[p])
                seconds = c.fwd_s + c.bwd_s
                if prev_off[p]:  # block i-1's copy to host hides behind this forward; its fetch behind this backward
                    seconds += max(0.0, prev_off[p] / rates.d2h_Bps - c.fwd_s)
                    seconds += max(0.0, prev_off[p] / rates.h2d_Bps - c.bwd_s)
                if i == L - 1 and off[t]:
                    seconds += max(0.0, off[t] / rates.d2h_Bps - head.head_fwd_s) + off[t] / rates.h2d_Bps
                time[i, p, t] = seconds
        # a later block's leftover during the backward: gradients + input gradient - its input
        left = [c.bwd_end - (0 if c.saves_input else h) - (h if c.saves_input else 0) + c.out_alive - c.out_bytes
                for c in costs]
        suffix[i] = max(left)
    return d, fwd, bwd, time, _after(suffix, L)


def _after(suffix, L):
    """``out[i]`` = sum of leftovers of blocks i+1 .. L-1."""
    out = np.zeros(L)
    running = 0.0
    for i in reversed(range(L)):
        out[i] = running
        running += suffix[i]
    return out


def _dp(profile, options, head, budget, resolution):
    """(step seconds, treatments) of the fastest plan within ``budget`` for ``head``, or None."""
    L, T = len(profile.block_names), len(options)
    d, fwd, bwd, time, after = _terms(profile, options, head)
    static = profile.static_bytes
    if static + head.pre_peak > budget:
        return None
    q = max(budget / resolution, 1.0)
    N = resolution + 2
    levels = np.arange(N) * q                          # upper bound of kept bytes per state
    inf = np.inf
    cost = np.full((T, N), inf)
    cost[0, 0] = 0.0                                   # "previous" of block 0: any, pick index 0
    first_prev = [0]
    back = np.zeros((L, T, N, 2), dtype=np.int32)
    for i in range(L):
        new = np.full((T, N), inf)
        prevs = first_prev if i == 0 else range(T)
        for t in range(T):
            for p in prevs:
                base = cost[p]
                if not np.isfinite(base).any():
                    continue
                ok_f = static + head.pre_end + levels + fwd[i, p, t] <= budget
                ok_b = static + head.head_bwd_end + levels + after[i] + bwd[i, p, t] <= budget
                step = int(np.ceil(max(d[i, p, t], 0.0) / q))
                candidate = np.where(ok_f & ok_b, base + time[i, p, t], inf)
                if step:
                    candidate = np.concatenate([np.full(step, inf), candidate[:-step]]) if step < N else np.full(N, inf)
                better = candidate < new[t]
                new[t] = np.where(better, candidate, new[t])
                src = np.arange(N) - step
                back[i, t, better, 0] = p
                back[i, t, better, 1] = src[better]
        cost = new
    head_ok = np.zeros((T, N), dtype=bool)
    last = [profile.cost(L - 1, t) for t in options]
    for t in range(T):
        off = last[t].offload_bytes if options[t] in OFFLOADING_TREATMENTS else 0
        head_ok[t] = ((static + levels + head.head_fwd_peak + off <= budget)
                      & (static + levels + head.head_bwd_peak <= budget))
    total = np.where(head_ok, cost, inf)
    if not np.isfinite(total).any():
        return None
    t, n = np.unravel_index(np.argmin(total), total.shape)
    best = float(total[t, n]) + head.pre_fwd_s + head.head_fwd_s + head.head_bwd_s + head.pre_bwd_s
    chosen = []
    for i in reversed(range(L)):
        chosen.append(options[t])
        t, n = back[i, t, n]
    chosen.reverse()
    if simulate(profile, chosen, head=head.mode, chunk_tokens=head.chunk_tokens).peak_bytes > budget:
        return None  # the end-of-backward phase (embeddings) is the only one not bounded above
    return best, chosen


def _smallest(profile, options, head_options, resolution):
    """The plan with the smallest predicted peak (bisection on the budget over the DP)."""
    candidates = [(simulate(profile, [t] * len(profile.block_names), head=h.mode, chunk_tokens=h.chunk_tokens).peak_bytes,
                   t, h) for t in options for h in head_options]
    high, t, h = min(candidates, key=lambda c: c[0])
    best = (high, [t] * len(profile.block_names), h)
    low = profile.static_bytes
    while high - low > max(high * 1e-3, 2**20):
        mid = (low + high) / 2
        found = [(_dp(profile, options, h, mid, resolution), h) for h in head_options]
        found = [(f, h) for f, h in found if f is not None]
        if found:
            (seconds, chosen), h = min(found, key=lambda fh: fh[0][0])
            high = mid
            best = (simulate(profile, chosen, head=h.mode, chunk_tokens=h.chunk_tokens).peak_bytes, chosen, h)
        else:
            low = mid
    peak, chosen, h = best
    return peak, _plan(profile, chosen, h, peak)
