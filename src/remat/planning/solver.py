"""``remat.solve``: the fastest plan whose predicted peak fits a memory budget.

How: dynamic programming over the block sequence, in forward order, for each head option
(plain, and chunked at each profiled chunk size). The state after block i is (bytes the
blocks 0..i keep, rounded *up* to 1/``resolution`` of the budget; the treatment of block
i; whether any block before it was offloaded), and its value the least step time to reach
it. Every peak that :mod:`remat.planning.simulator` bounds is a function of that state and of
block i's own treatment:

- forward of block i: static + embeddings + kept(0..i-1) + its forward peak + what the
  offload engine may still hold (:func:`engine_bounds`: from the previous block's
  offloaded bytes and the flag, an upper bound of the engine's own rule);
- backward of block i: static + head leftovers + kept(0..i-1) + gradients of blocks after
  i (the same whatever they chose) + its backward peak + the engine's bytes (prefetch
  included);
- head: static + kept(all) + the head's working set + the engine's bytes.

So the DP is exact for the simulator's *bound* (the peak whatever the copy timing) up to
the rounding of kept bytes, and, for plans that offload, up to :func:`engine_bounds`
(which equals the engine's rule for uniform offload and can exceed it by up to one window
when offloaded and kept blocks alternate); both only ever make it conservative: every plan
it returns simulates within the budget, and no plan is missed unless it fits by less than
``budget / resolution`` per block (plus that slack, with offload). The time it minimises
is additive: each block's seconds plus, for offload, the copy time its neighbours cannot
hide (pairwise). Without offload that is the simulator's step time; with offload it is a
pessimistic stand-in for the simulator's bus model (a copy can also hide behind blocks
further on), so the DP may prefer recompute where offload would be as fast; the plan's
reported time is the simulator's. Cost: blocks x treatments x 2 x treatments x
resolution, vectorised with numpy; one DP per head option, and one more per offload
window (without offload, with ``full+offload`` only, with both): ~1.5 s for 16 blocks,
~5 s for 80 on a 2-core CPU.

Safety margin: the memory model is exact (0.0-0.4% on an H200, three models) for every
treatment, but the offload engine's bytes depend on when copies land. For plans that
offload the solver uses the engine's bound and, on top, keeps ``offload_margin`` (default
2%) of the budget free: such a plan must have ``bound <= budget * (1 - offload_margin)``;
a plan without offload may use the whole budget.

The obvious alternative, greedy (checkpoint the biggest block until it fits), is not
optimal once treatments trade memory and time at different rates (selective vs mlp vs
full) or once the head mode changes which phase sets the peak; the tests compare against
brute force. When nothing fits, the smallest budget that fits is found by a second DP that
minimises the peak itself, and named in the error, with its plan.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from remat.planning.plans import OFFLOADING_TREATMENTS, Plan
from remat.planning.simulator import offload_sizes, simulate, window_bytes
from remat.units import format_size, parse_size

OFFLOAD_MARGIN = 0.02


class NoPlanFits(ValueError):
    """No plan fits the budget; ``smallest_peak`` and ``plan`` say what would."""

    def __init__(self, message, smallest_peak=None, plan=None):
        super().__init__(message)
        self.smallest_peak = smallest_peak
        self.plan = plan


def solve(profile, budget, *, treatments: Optional[Sequence[str]] = None, heads: Optional[Sequence[str]] = None,
          resolution: int = 4000, offload_margin: float = OFFLOAD_MARGIN) -> Plan:
    """The plan with the least predicted step time whose predicted peak is within ``budget``.

    ``budget``: bytes or a size string ("24GiB"). ``treatments``: the ones the solver may
    use (default: every profiled one). ``heads``: head modes allowed (default: profiled).
    ``offload_margin``: the fraction of the budget a plan that offloads leaves free (see
    the module doc). Raises :class:`NoPlanFits` (a ValueError) naming the smallest budget
    that fits and its plan.
    """
    budget = parse_size(budget)
    if not 0 <= offload_margin < 1:
        raise ValueError(f"offload_margin is a fraction of the budget in [0, 1), got {offload_margin!r}")
    options = _options(profile, treatments)
    head_options = [h for h in profile.heads if heads is None or h.mode in heads]
    if not head_options:
        raise ValueError(f"no head mode left to plan with: asked for {list(heads)}, profiled "
                         f"{sorted({h.mode for h in profile.heads})}")
    best = _best(profile, options, head_options, budget, resolution, offload_margin)
    if best is None:
        smallest, plan = _smallest(profile, options, head_options, resolution, offload_margin)
        n = plan.notes
        raise NoPlanFits(
            f"no plan fits {format_size(budget)}: the smallest budget that fits is {format_size(smallest)} "
            f"({plan.summary()}: predicted peak {format_size(n['predicted_peak_bytes'])}, set in "
            f"{n.get('peak_at')}). Raise the budget to at least {format_size(smallest)}, shorten the batch "
            f"or sequence, or free static memory (static alone is {format_size(profile.static_bytes)}).",
            smallest, plan)
    _, chosen, head = best
    return _plan(profile, chosen, head, budget)


def _best(profile, options, head_options, budget, resolution, margin):
    """(seconds, treatments, head) of the fastest plan within ``budget``, or None.

    Plans that offload are held to ``budget * (1 - margin)``; each window the engine may
    use (it can depend on the largest offloaded block) gets its own DP.
    """
    plain = [t for t in options if t not in OFFLOADING_TREATMENTS]
    runs = [(plain, budget)] if plain else []
    offloading = sorted({t for t in options if t in OFFLOADING_TREATMENTS},
                        key=lambda t: max(offload_sizes(profile, [t] * len(profile.block_names))))
    for k in range(len(offloading)):  # offload treatments up to the k-th largest: its window
        runs.append((plain + offloading[:k + 1], int(budget * (1 - margin))))
    best = None
    for allowed, limit in runs:
        for head in head_options:
            found = _dp(profile, allowed, head, limit, resolution)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], head)
    return best


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
    notes = {"predicted_peak_bytes": result.peak_bytes, "predicted_bound_bytes": result.bound_bytes,
             "predicted_step_s": round(result.step_s, 5),
             "predicted_tokens_per_s": round(result.tokens_per_s, 1), "budget_bytes": budget,
             "peak_at": result.peak_at, "gpu": profile.rates.name, "measured_rates": profile.rates.measured,
             "batch": profile.batch, "seq": profile.seq, "optimizer": profile.optimizer}
    if result.offload_bytes:
        notes.update(offload_bytes=result.offload_bytes, moved_bytes=result.moved_bytes,
                     exposed_copy_s=round(result.exposed_copy_s, 5), bound_at=result.bound_at)
    return Plan(draft.blocks, draft.head, draft.chunk_tokens, notes)


def plan_seconds(profile, treatments, head) -> float:
    """The additive step time the DP minimises for ``treatments`` (see the module doc)."""
    return _evaluate(profile, list(treatments), head)[0]


def plan_bound(profile, treatments, head) -> float:
    """The peak the DP checks for ``treatments``, without its rounding (for tests and reports)."""
    return _evaluate(profile, list(treatments), head)[1]


def _evaluate(profile, treatments, head):
    options = sorted(set(treatments), key=list(profile.treatments(0)).index)
    L = len(treatments)
    sizes = [max(offload_sizes(profile, [t] * L)) for t in options]
    window, largest, prefetch = window_bytes(profile, sizes), max(sizes), profile.engine.prefetch_blocks
    d, fwd, bwd, time, after, off = _terms(profile, options, head, window)
    static = profile.static_bytes
    index = [options.index(t) for t in treatments]
    seconds, kept, flag, peak = _head_seconds(head), 0.0, False, static + head.pre_peak
    for i, t in enumerate(index):
        p = index[i - 1] if i else 0
        prev_off = off[i - 1, p] if i else 0.0
        res_f, res_b = engine_bounds(window, largest, prev_off, flag, prefetch)
        peak = max(peak, static + head.pre_end + kept + fwd[i, p, t] + res_f,
                   static + head.head_bwd_end + kept + after[i] + bwd[i, p, t] + res_b)
        seconds += time[i, p, t]
        kept += max(d[i, p, t], 0.0)
        flag = flag or prev_off > 0
    res, _ = engine_bounds(window, largest, off[L - 1, index[-1]], flag, prefetch)
    peak = max(peak, static + kept + max(head.head_fwd_peak, head.head_bwd_peak) + res)
    return float(seconds), float(peak)


def _head_seconds(head) -> float:
    return head.pre_fwd_s + head.head_fwd_s + head.head_bwd_s + head.pre_bwd_s


def engine_bounds(window: float, largest: float, previous: float, earlier: bool, prefetch_blocks: int = 1):
    """(forward and head, backward) bytes the DP allows the offload engine for the blocks before one.

    ``previous``: the block before's offloaded bytes; ``earlier``: whether any block before
    that one offloaded; ``largest``: the largest offloaded block. Upper bounds of the engine's
    own rule (:func:`remat.offload.engine.gpu_overhead_bytes`: ``min(W, bytes before)`` in forward,
    the prefetched block plus the older part of the forward's last ``W`` bytes in backward)
    that depend on the previous block only, which is what the DP's state carries.
    """
    forward = min(window, previous + (window if earlier else 0))
    if prefetch_blocks == 0:     # no prefetch: only the forward's last bytes
        backward = forward
    elif prefetch_blocks == 1:   # the nearest offloaded block before + the older part of the last W bytes
        if previous:
            backward = previous + (max(0.0, window - previous) if earlier else 0.0)
        else:
            backward = max(window, largest) if earlier else 0.0
    else:
        backward = prefetch_blocks * largest + window if (previous or earlier) else 0.0
    return forward, backward


def _states(window, largest, prev_off, f_of, prefetch_blocks):
    pairs = [engine_bounds(window, largest, o, bool(f), prefetch_blocks) for o, f in zip(prev_off, f_of)]
    return np.array([p[0] for p in pairs], dtype=float), np.array([p[1] for p in pairs], dtype=float)


def _terms(profile, options, head, window):
    """Per block, per (previous, current) treatment: the numbers the constraints need."""
    rates = profile.rates
    L, T = len(profile.block_names), len(options)
    h = profile.hidden_bytes
    d = np.zeros((L, T, T))        # kept bytes added by block i
    fwd = np.zeros((L, T, T))      # forward peak above kept(0..i-1), without the engine's bytes
    bwd = np.zeros((L, T, T))      # backward peak above kept(0..i-1) + later blocks' leftovers
    time = np.zeros((L, T, T))
    off = np.zeros((L, T))         # bytes block i hands to the engine
    suffix = np.zeros(L + 1)       # leftovers of blocks after i during the backward (max over treatments)
    for i in range(L):
        costs = [profile.cost(i, t) for t in options]
        off[i] = [c.offload_bytes if t in OFFLOADING_TREATMENTS else 0 for c, t in zip(costs, options)]
        prev_costs = [profile.cost(i - 1, t) for t in options] if i else [None] * T
        for p in range(T):
            x_free = prev_costs[p].out_alive if i else h
            prev_off = off[i - 1, p] if i else 0.0
            for t, c in enumerate(costs):
                d[i, p, t] = c.kept + (0 if c.saves_input else -x_free) + c.out_alive - off[i, t]
                fwd[i, p, t] = c.fwd_peak
                bwd[i, p, t] = c.bwd_peak - c.out_bytes + c.out_alive - (0 if c.saves_input else x_free)
                seconds = c.fwd_s + c.bwd_s
                if prev_off:  # block i-1's copy to host hides behind this forward; its fetch behind this backward
                    seconds += max(0.0, prev_off / rates.d2h_Bps - c.fwd_s)
                    seconds += max(0.0, prev_off / rates.h2d_Bps - c.bwd_s)
                if i == L - 1 and off[i, t]:
                    seconds += max(0.0, off[i, t] / rates.d2h_Bps - head.head_fwd_s) + off[i, t] / rates.h2d_Bps
                time[i, p, t] = seconds
        # a later block's leftover during the backward: gradients + input gradient - its input
        left = [c.bwd_end - (0 if c.saves_input else h) - (h if c.saves_input else 0) + c.out_alive - c.out_bytes
                for c in costs]
        suffix[i] = max(left)
    return d, fwd, bwd, time, _after(suffix, L), off


def _after(suffix, L):
    """``out[i]`` = sum of leftovers of blocks i+1 .. L-1."""
    out = np.zeros(L)
    running = 0.0
    for i in reversed(range(L)):
        out[i] = running
        running += suffix[i]
    return out


def _dp(profile, options, head, budget, resolution):
    """(step seconds, treatments) of the fastest plan within ``budget`` for ``head``, or None.

    States are (previous treatment p, flag F: any block before p offloaded), flattened as
    ``2 * p + F``; each holds the least time per kept-bytes level.
    """
    L, T = len(profile.block_names), len(options)
    sizes = [max(offload_sizes(profile, [t] * L)) for t in options]
    window, largest, prefetch = window_bytes(profile, sizes), max(sizes), profile.engine.prefetch_blocks
    d, fwd, bwd, time, after, off = _terms(profile, options, head, window)
    static = profile.static_bytes
    if static + head.pre_peak > budget:
        return None
    q = max(budget / resolution, 1.0)
    N = resolution + 2
    levels = np.arange(N) * q                          # upper bound of kept bytes per state
    S = 2 * T
    p_of, f_of = np.arange(S) // 2, np.arange(S) % 2
    cost = np.full((S, N), np.inf)
    cost[0, 0] = 0.0                                   # block 0: no previous block, nothing offloaded
    back = np.zeros((L, S, N), dtype=np.int64)          # previous state * N + previous level
    cols = np.arange(N)
    for i in range(L):
        prev_off = off[i - 1, p_of] if i else np.zeros(S)
        res_f, res_b = _states(window, largest, prev_off, f_of, prefetch)
        flag = (f_of.astype(bool) | (prev_off > 0)).astype(int)   # the next state's flag
        new = np.full((S, N), np.inf)
        for t in range(T):
            limit_f = budget - static - head.pre_end - fwd[i, p_of, t] - res_f
            limit_b = budget - static - head.head_bwd_end - after[i] - bwd[i, p_of, t] - res_b
            ok = levels[None, :] <= np.minimum(limit_f, limit_b)[:, None]
            candidate = np.where(ok, cost + time[i, p_of, t][:, None], np.inf)
            step = np.ceil(np.maximum(d[i, p_of, t], 0.0) / q).astype(np.int64)
            src = cols[None, :] - step[:, None]
            shifted = np.where(src >= 0, np.take_along_axis(candidate, np.clip(src, 0, N - 1), axis=1), np.inf)
            for f in (0, 1):
                rows = np.flatnonzero(flag == f)
                if rows.size == 0:
                    continue
                sub = shifted[rows]
                k = np.argmin(sub, axis=0)
                value = sub[k, cols]
                state = 2 * t + f
                new[state] = value
                back[i, state] = rows[k] * N + np.clip(cols - step[rows[k]], 0, N - 1)
        cost = new
    resident, _ = _states(window, largest, off[L - 1, p_of], f_of, prefetch)
    head_ok = (levels[None, :] <= (budget - static - max(head.head_fwd_peak, head.head_bwd_peak)
                                   - resident)[:, None])
    total = np.where(head_ok, cost, np.inf)
    if not np.isfinite(total).any():
        return None
    state, n = np.unravel_index(np.argmin(total), total.shape)
    best = float(total[state, n]) + _head_seconds(head)
    chosen = []
    for i in reversed(range(L)):
        chosen.append(options[state // 2])
        state, n = divmod(int(back[i, state, n]), N)
    chosen.reverse()
    if simulate(profile, chosen, head=head.mode, chunk_tokens=head.chunk_tokens).bound_bytes > budget:
        return None  # the end-of-backward phase (embeddings) is the only one not bounded above
    return best, chosen


def _smallest(profile, options, head_options, resolution, margin):
    """The smallest budget that :func:`solve` accepts, and its plan.

    A second DP over the same states minimises the bound peak itself (the value of a state
    is the largest phase bound so far instead of the time), once per head option and for
    plans with and without offload (those need ``1 / (1 - margin)`` of their peak); the
    result is then confirmed by :func:`solve`'s own DP, whose rounding can differ by a few
    levels, nudging the budget up until it accepts.
    """
    L = len(profile.block_names)
    high = min(_need(simulate(profile, [t] * L, head=h.mode, chunk_tokens=h.chunk_tokens).bound_bytes, t, margin)
               for t in options for h in head_options)
    plain = [t for t in options if t not in OFFLOADING_TREATMENTS]
    groups = [(plain, 0.0)] if plain else []
    if len(plain) < len(options):
        groups.append((options, margin))
    need = high
    for allowed, m in groups:
        for head in head_options:
            peak = _dp_min_peak(profile, allowed, head, high, resolution)
            if peak is not None:
                need = min(need, int(peak / (1 - m)) + 1)
    for _ in range(200):
        found = _best(profile, options, head_options, need, resolution, margin)
        if found is not None:
            _, chosen, h = found
            return need, _plan(profile, chosen, h, need)
        need = int(need * 1.002) + 1
    raise AssertionError("the smallest uniform plan always fits its own bound")  # pragma: no cover


def _need(bound, treatment, margin) -> int:
    return int(bound / (1 - margin)) + 1 if treatment in OFFLOADING_TREATMENTS else int(bound)


def _dp_min_peak(profile, options, head, scale, resolution):
    """The least bound peak over plans using ``options`` with ``head`` (kept levels of ``scale``)."""
    L, T = len(profile.block_names), len(options)
    sizes = [max(offload_sizes(profile, [t] * L)) for t in options]
    window, largest, prefetch = window_bytes(profile, sizes), max(sizes), profile.engine.prefetch_blocks
    d, fwd, bwd, _, after, off = _terms(profile, options, head, window)
    static = profile.static_bytes
    q = max(scale / resolution, 1.0)
    N = resolution + 2
    levels = np.arange(N) * q
    S = 2 * T
    p_of, f_of = np.arange(S) // 2, np.arange(S) % 2
    value = np.full((S, N), np.inf)
    value[0, 0] = static + head.pre_peak
    cols = np.arange(N)
    for i in range(L):
        prev_off = off[i - 1, p_of] if i else np.zeros(S)
        res_f, res_b = _states(window, largest, prev_off, f_of, prefetch)
        flag = (f_of.astype(bool) | (prev_off > 0)).astype(int)
        new = np.full((S, N), np.inf)
        for t in range(T):
            phase = np.maximum(static + head.pre_end + fwd[i, p_of, t] + res_f,
                               static + head.head_bwd_end + after[i] + bwd[i, p_of, t] + res_b)
            candidate = np.maximum(value, levels[None, :] + phase[:, None])
            step = np.ceil(np.maximum(d[i, p_of, t], 0.0) / q).astype(np.int64)
            src = cols[None, :] - step[:, None]
            shifted = np.where(src >= 0, np.take_along_axis(candidate, np.clip(src, 0, N - 1), axis=1), np.inf)
            for f in (0, 1):
                rows = np.flatnonzero(flag == f)
                if rows.size:
                    new[2 * t + f] = np.minimum(new[2 * t + f], shifted[rows].min(axis=0))
        value = new
    resident, _ = _states(window, largest, off[L - 1, p_of], f_of, prefetch)
    total = np.maximum(value, levels[None, :] + static + max(head.head_fwd_peak, head.head_bwd_peak)
                       + resident[:, None])
    best = float(total.min())
    return best if np.isfinite(best) else None
