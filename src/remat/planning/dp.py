"""The solver's dynamic program over the block sequence (:mod:`remat.planning.solver` says what
it solves and why it is exact for the simulator's bound).

How: :class:`Tables` turns a profile into, per block and per (previous, current) treatment, the
kept bytes the block adds, its forward and backward peaks above what earlier blocks keep, its
seconds (FSDP2's exposed collectives and offload copies its neighbours cannot hide included),
its score (the seconds plus the recompute margin) and the bytes it hands the offload engine.
:func:`dp` walks the blocks in forward order over states (previous treatment, whether any earlier
block offloaded) x kept-bytes levels (rounded *up* to ``scale / resolution``), keeping per state
the best value of an objective and a back pointer. Two objectives share the states, transitions
and memory terms: :class:`MinTime` (the least score, transitions past the budget cut) and
:class:`MinPeak` (the least peak). Each block's step only works on the levels some plan reaches so
far, which the early blocks keep few of.

- recompute margin (``margin``): a treatment other than ``keep`` is charged ``margin`` times the
  block's ``keep`` seconds, so more work is chosen only when memory needs it or its predicted gain
  passes the profile's noise; :func:`head_margin` holds the chunked head to the same rule;
- tiled chunk sizes: a tiled treatment profiled at several chunks is one option with a variant
  per chunk, chosen within each transition (a chunk changes the block's transient peaks and
  seconds, never the state), the best-scoring one whose phase fits, the largest on a tie.

Why variants rather than options: the states and transitions grow with the square of the
options, a variant costs a few more vectorised steps. So the chunk is chosen per block: the blocks
whose backward sets the peak may take small chunks while the others keep large, faster ones.
Design notes: docs/design/planning.md.
"""
from __future__ import annotations

import numpy as np

from remat.planning.memory import LiveBytes, block_terms, freed_input, input_bytes
from remat.planning.offload_model import engine_bounds
from remat.planning.plans import OFFLOADING_TREATMENTS, TILED_TREATMENTS
from remat.planning.simulator import largest_offload, offload_sizes


def head_seconds(profile, head) -> float:
    """The step's seconds outside the blocks: embeddings, head, fixed overhead, the optimizer's step
    and, under FSDP2, the root's collectives no compute hides."""
    seconds = (head.pre_fwd_s + head.head_fwd_s + head.head_bwd_s + head.pre_bwd_s + profile.step_overhead_s
               + profile.optimizer_s)
    return seconds + (profile.comm.fixed_exposed_s(head) if profile.comm is not None else 0.0)


def head_margin(profile, head, margin: float) -> float:
    """The recompute margin's seconds for ``head`` (see the module doc): none for the plain head,
    ``margin`` of the plain head's own forward and backward seconds (not the embeddings', the
    step's overhead or collectives, which the chunked head does not replace) for another."""
    if not margin or head.mode == "plain" or "plain" not in {h.mode for h in profile.heads}:
        return 0.0
    plain = profile.head("plain")
    return margin * (plain.head_fwd_s + plain.head_bwd_s)


def engine_states(window, largest, prev_off, f_of, prefetch_blocks):
    """The offload engine's forward and backward bytes bound per DP state (arrays over the states'
    previous offloaded bytes ``prev_off`` and flags ``f_of``): :func:`engine_bounds` for each."""
    pairs = [engine_bounds(window, largest, o, bool(f), prefetch_blocks) for o, f in zip(prev_off, f_of)]
    return np.array([p[0] for p in pairs], dtype=float), np.array([p[1] for p in pairs], dtype=float)


class Tables:
    """Per block, per (previous, current) treatment and per chunk variant of the current one (see the
    module doc; a treatment that does not tile has the one variant 0): the numbers the DP's
    constraints and time need."""

    def __init__(self, profile, options, head, margin: float = 0.0):
        rates = profile.rates
        L, T = len(profile.block_names), len(options)
        h = profile.hidden_bytes
        sizes = [largest_offload(profile, t) for t in options]
        self.window, self.largest = profile.engine.window(sizes), max(sizes)
        self.prefetch = profile.engine.prefetch_blocks
        # the chunk sizes any option is profiled at, largest first: variant z of a tiled option is tiles[z]
        self.tiles = tuple(sorted({s for i in range(L) for t in options for s in _tile_sizes(profile, i, t)},
                                  reverse=True))
        self.options = list(options)
        self.tiled = [t in TILED_TREATMENTS for t in options]
        Z = max(1, len(self.tiles))
        self.d = np.zeros((L, T, T))        # kept bytes added by block i (BlockTerms.kept; the largest over variants)
        self.fwd = np.zeros((L, T, T, Z))   # forward peak above kept(0..i-1), without the engine's bytes
        self.bwd = np.zeros((L, T, T, Z))   # backward peak above kept(0..i-1) + later blocks' leftovers
        self.time = np.zeros((L, T, T, Z))
        self.off = np.zeros((L, T))         # bytes block i hands to the engine
        self.tie = np.zeros((L, T))         # the recompute margin's seconds (see the module doc)
        self.left = np.zeros(L)             # block i's leftover after its backward (the largest over treatments)
        # a treatment block i cannot take (a hybrid's mamba block has no mlp) is never chosen for
        # it; its table entries are filled with a treatment it can take, only to keep them finite
        self.allowed = np.array([[t in profile.treatments(i) for t in options] for i in range(L)])
        # the variants block i's option t can take: 0 alone for an untiled one, its profiled chunks for a tiled one
        self.variant = np.zeros((L, T, Z), dtype=bool)
        for i in range(L):
            costs = [_cost(profile, i, t) for t in options]
            variants = []                   # per option: [(z, cost)] of the chunks block i can take
            for t, (name, c) in enumerate(zip(options, costs)):
                chunks = _tile_sizes(profile, i, name) if self.allowed[i, t] else ()
                variants.append([(self.tiles.index(s), profile.cost(i, name, s)) for s in chunks] or [(0, c)])
                self.variant[i, t, [z for z, _ in variants[-1]]] = True
            if margin and "keep" in profile.treatments(i):  # whether or not the plan may use keep
                keep = profile.cost(i, "keep")
                self.tie[i] = [0.0 if t == "keep" else margin * (keep.fwd_s + keep.bwd_s) for t in options]
            self.off[i] = [c.offload_bytes if t in OFFLOADING_TREATMENTS else 0 for c, t in zip(costs, options)]
            prev_costs = [_cost(profile, i - 1, t) for t in options] if i else [None] * T
            for p, previous in enumerate(prev_costs):
                prev_off = self.off[i - 1, p] if i else 0.0
                for t, chunks in enumerate(variants):
                    kept = []
                    for k, (z, c) in enumerate(chunks):
                        # the first variant fills all: those the option cannot take stay finite, never chosen
                        z = slice(None) if k == 0 else z
                        terms = block_terms(c, freed_input(previous, h), input_bytes(previous, h), self.off[i, t])
                        kept.append(terms.kept)
                        self.fwd[i, p, t, z], self.bwd[i, p, t, z] = terms.forward, terms.backward
                        seconds = c.fwd_s + c.bwd_s
                        if profile.comm is not None:  # FSDP2: what this block's compute cannot hide
                            seconds += profile.comm.block_exposed_s(i, c.fwd_s, c.bwd_s)
                        if prev_off:  # block i-1's copy to host hides behind this forward; its fetch behind this backward
                            seconds += max(0.0, prev_off / rates.d2h_Bps - c.fwd_s)
                            seconds += max(0.0, prev_off / rates.h2d_Bps - c.bwd_s)
                        if i == L - 1 and self.off[i, t]:
                            seconds += (max(0.0, self.off[i, t] / rates.d2h_Bps - head.head_fwd_s)
                                        + self.off[i, t] / rates.h2d_Bps)
                        self.time[i, p, t, z] = seconds
                    self.d[i, p, t] = max(kept)
            # what a block leaves depends on the block before it (the input it frees) and on its
            # own treatment; the DP, which has not chosen them yet, takes the largest
            self.left[i] = max((block_terms(c, freed_input(previous, h), input_bytes(previous, h)).left
                                for previous in prev_costs
                                for chunks, ok in zip(variants, self.allowed[i]) if ok for _, c in chunks),
                               default=0.0)
        self.score = self.time + self.tie[:, None, :, None]  # what MinTime minimises
        self.after = np.zeros(L)            # leftovers of blocks i+1 .. L-1
        running = 0.0
        for i in reversed(range(L)):
            self.after[i] = running
            running += self.left[i]
        live = LiveBytes(profile.static_bytes, head)
        # the phases whose bytes no treatment changes beyond ``left``: embeddings forward and backward,
        # the optimizer's step
        self.ends = max(live.embeddings_forward().peak, live.static + running + head.pre_bwd_peak,
                        live.static + running + head.pre_bwd_end + profile.optimizer_temp_bytes)

    def variant_of(self, profile, index: int, option: int, tile_tokens) -> int:
        """The variant of block ``index``'s option ``option`` that prices a chunk of ``tile_tokens``
        (:meth:`~remat.planning.costs.Profile.tile_size`; 0 for an option that does not tile)."""
        size = profile.tile_size(index, self.options[option], tile_tokens) if self.tiled[option] else None
        return self.tiles.index(size) if size in self.tiles else 0

    def tile_of(self, option: int, variant: int):
        """The chunk size of ``variant`` of ``option`` (None for an option that does not tile)."""
        return self.tiles[variant] if self.tiled[option] and self.tiles else None


def _tile_sizes(profile, index: int, treatment: str) -> tuple:
    """The chunks block ``index`` can take under ``treatment`` (none where it cannot take the treatment)."""
    return profile.tile_sizes(index, treatment) if treatment in profile.treatments(index) else ()


def _cost(profile, index: int, treatment: str):
    """Block ``index``'s cost under ``treatment``, or under the first treatment it can take
    where it cannot take this one (a placeholder: :attr:`Tables.allowed` keeps it unchosen)."""
    available = profile.treatments(index)
    return profile.cost(index, treatment if treatment in available else available[0])


class MinTime:
    """The least step score within ``budget`` (the time, with the recompute margin): a state's
    value is the score so far, and a transition whose phase would pass the budget is cut."""

    def __init__(self, budget):
        self.budget = budget

    def start(self, first_phase):
        return 0.0 if first_phase <= self.budget else np.inf

    def step(self, value, levels, phase, seconds):
        ok = levels[None, :] <= (self.budget - phase)[:, None]
        return np.where(ok, value + seconds[:, None], np.inf)

    def finish(self, value, levels, phase):
        return np.where(levels[None, :] <= (self.budget - phase)[:, None], value, np.inf)


class MinPeak:
    """The least peak: a state's value is the largest phase bound so far."""

    def start(self, first_phase):
        return first_phase

    def step(self, value, levels, phase, seconds):
        return np.maximum(value, levels[None, :] + phase[:, None])

    def finish(self, value, levels, phase):
        return np.maximum(value, levels[None, :] + phase[:, None])


def dp(profile, options, head, objective, scale, resolution, margin: float = 0.0):
    """(objective's value, treatments, chunks) of the best plan using ``options`` with ``head``, or
    None; ``chunks``: per block the chunk size of its tiled treatment (None for one that does not
    tile). ``margin``: the recompute margin (see the module doc).

    States are (previous treatment p, flag F: any block before p offloaded), flattened as
    ``2 * p + F``; each holds the objective's best value per kept-bytes level, levels being
    multiples of ``scale / resolution`` (kept bytes rounded up). A tiled treatment's chunk is
    chosen per state and level, the largest first (see the module doc).
    """
    L, T = len(profile.block_names), len(options)
    tab = Tables(profile, options, head, margin)
    if not tab.allowed.any(axis=1).all():  # a block can take none of the options (a pinned call's is not there)
        return None
    live = LiveBytes(profile.static_bytes, head)
    q = max(scale / resolution, 1.0)
    N = resolution + 2
    levels = np.arange(N) * q                          # upper bound of kept bytes per state
    S = 2 * T
    p_of, f_of = np.arange(S) // 2, np.arange(S) % 2
    value = np.full((S, N), np.inf)
    value[0, 0] = objective.start(tab.ends)            # block 0: no previous block, nothing offloaded
    back = np.zeros((L, S, N), dtype=np.int64)          # previous state * N + previous level
    chunk_back = np.zeros((L, S, N), dtype=np.int8)     # the variant (chunk) of the state's treatment
    cols = np.arange(N)
    for i in range(L):
        finite = np.isfinite(value)
        reached = np.flatnonzero(finite.any(axis=1))  # states some plan reaches
        # levels at or past ``hi`` hold no plan yet: the work below runs on the levels under it only
        hi = int(np.flatnonzero(finite[reached].any(axis=0))[-1]) + 1 if reached.size else 0
        prev_off = tab.off[i - 1, p_of[reached]] if i else np.zeros(reached.size)
        res_f, res_b = engine_states(tab.window, tab.largest, prev_off, f_of[reached], tab.prefetch)
        flag = f_of[reached].astype(bool) | (prev_off > 0)     # the next state's flag
        groups = [(f, np.flatnonzero(flag == f)) for f in (0, 1)]
        new = np.full((S, N), np.inf)
        values, p = value[reached, :hi], p_of[reached]
        for t in range(T):
            if not tab.allowed[i, t]:
                continue
            variants = np.flatnonzero(tab.variant[i, t])
            # the variant each value came from (one variant: that one)
            candidate, which = None, np.full(values.shape, variants[0], dtype=np.int8) if variants.size > 1 else None
            for z in variants:  # largest chunk first: it keeps a tie
                phase = np.maximum(live.forward_base() + tab.fwd[i, p, t, z] + res_f,
                                   live.backward_base() + tab.after[i] + tab.bwd[i, p, t, z] + res_b)
                value_z = objective.step(values, levels[:hi], phase, tab.score[i, p, t, z])
                if candidate is None:
                    candidate = value_z
                else:
                    better = value_z < candidate
                    np.copyto(candidate, value_z, where=better)
                    which[better] = z
            step = np.ceil(np.maximum(tab.d[i, p, t], 0.0) / q).astype(np.int64)
            width = int(min(N, hi + step.max())) if step.size else 0  # the levels a plan can reach now
            shifted = np.full((len(reached), width), np.inf)  # a state's values moved up by its kept bytes
            for row, k in enumerate(step):
                if k < width:
                    shifted[row, k:k + hi] = candidate[row, :width - k]
            columns = cols[:width]
            for f, rows in groups:
                if rows.size == 0:
                    continue
                sub = shifted[rows]
                k = np.argmin(sub, axis=0) if rows.size > 1 else np.zeros(width, dtype=np.int64)
                state = 2 * t + f
                new[state, :width] = sub[k, columns]
                before = np.clip(columns - step[rows[k]], 0, N - 1)
                back[i, state, :width] = reached[rows[k]] * N + before
                chunk_back[i, state, :width] = variants[0] if which is None else \
                    which[rows[k], np.minimum(before, max(hi - 1, 0))]
        value = new
    resident, _ = engine_states(tab.window, tab.largest, tab.off[L - 1, p_of], f_of, tab.prefetch)
    total = objective.finish(value, levels, live.head_peak() + resident)
    if not np.isfinite(total).any():
        return None
    state, n = np.unravel_index(np.argmin(total), total.shape)
    best = float(total[state, n])
    chosen, chunks = [], []
    for i in reversed(range(L)):
        chosen.append(options[state // 2])
        chunks.append(tab.tile_of(state // 2, int(chunk_back[i, state, n])))
        state, n = divmod(int(back[i, state, n]), N)
    chosen.reverse()
    chunks.reverse()
    return best, chosen, chunks
