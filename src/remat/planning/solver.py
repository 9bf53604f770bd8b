"""``remat.solve``: the fastest plan whose predicted peak fits a memory budget.

How: dynamic programming over the block sequence in forward order (:mod:`remat.planning.dp`),
once per head option left after :func:`undominated_heads`. The state after block i is (the bytes
blocks 0..i keep, rounded *up* to ``budget / resolution``; block i's treatment; whether any earlier
block offloaded); its value the least score to reach it. Every peak that
:mod:`remat.planning.simulator` bounds (each block's forward and backward, the head, the
embeddings) is a function of that state and block i's own treatment, in the terms of
:mod:`remat.planning.memory`, so the DP is exact for the simulator's bound up to the rounding,
and only ever conservative: every plan it returns simulates within the budget.

- exact candidates: every uniform plan (one treatment on every block, per head option) is also
  simulated and the best of those and the DP's plan wins (:func:`plan_score`), so a budget taken
  from a uniform plan's own peak is never missed by the rounding;
- recompute margin: the score is each block's seconds plus :data:`RECOMPUTE_MARGIN` of its
  ``keep`` seconds for any other treatment (the chunked head likewise, against the plain head), so
  profile noise does not buy a recompute that runs slower; the reported time is the simulator's;
- offload: plans that offload keep ``offload_margin`` of the budget free above the engine's bound;
- tied blocks (one module called several times a step: :mod:`remat.planning.calls`) get one
  treatment for all calls (:func:`_tied`); tiled treatments take a chunk size per block.

Why not greedy (checkpoint the biggest block until it fits): it is not optimal once treatments
trade memory and time at different rates, or once the head mode moves the peak; the tests compare
the DP against brute force. When nothing fits, the same DP minimising the peak names the smallest
budget that fits in :class:`NoPlanFits`, with its plan.

Limits: mixed plans that fit by less than the rounding can be missed; with offload the DP's time is
a pessimistic pairwise stand-in for the simulator's bus model. The exactness argument, costs and
the plans that set the margin: docs/design/planning.md.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import NamedTuple, Optional, Sequence

from remat.planning.calls import each_call, per_block, per_call, pinned, repeated, unrolled
from remat.planning.context import context_notes
from remat.planning.dp import MinPeak, MinTime, Tables, dp, head_margin, head_seconds
from remat.planning.memory import BlockTerms, LiveBytes
from remat.planning.offload_model import engine_bounds
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan, made_for_notes
from remat.planning.sharding import comm_notes
from remat.planning.simulator import host_bytes, largest_offload, simulate
from remat.units import format_size, parse_budget

OFFLOAD_MARGIN = 0.02
RECOMPUTE_MARGIN = 0.01
"""The fraction of a block's ``keep`` seconds another treatment must save to be chosen over
``keep`` where both fit (see the module doc)."""


class NoPlanFits(ValueError):
    """No plan fits the budget (a ValueError), raised by :func:`solve`, :func:`remat.plan` and
    :class:`remat.Guard`; its message names the smallest budget that fits.

    Attributes:
        smallest_peak: the smallest budget, in bytes, that a plan fits (None where none is known).
        plan: the plan that fits it (None likewise).
        host_limited: True where the plans that fit the GPU need more pinned host memory than the
            profile's ``host_limit``; ``smallest_peak`` and ``plan`` are then the smallest without
            offload, or None.

    Example:
        >>> try:                                                        # doctest: +SKIP
        ...     plan = remat.plan(model, batch, "8GiB")
        ... except remat.NoPlanFits as error:
        ...     plan = remat.plan(model, batch, error.smallest_peak)
    """

    def __init__(self, message, smallest_peak=None, plan=None, host_limited=False):
        super().__init__(message)
        self.smallest_peak = smallest_peak
        self.plan = plan
        self.host_limited = host_limited


def solve(profile, budget, *, treatments: Optional[Sequence[str]] = None, heads: Optional[Sequence[str]] = None,
          resolution: int = 4000, offload_margin: float = OFFLOAD_MARGIN,
          recompute_margin: float = RECOMPUTE_MARGIN) -> Plan:
    """The plan with the least predicted step time whose predicted peak is within ``budget``.

    Pure: numbers in (a profile), a plan out; nothing runs on a GPU.

    Args:
        profile: a :class:`~remat.planning.costs.Profile` (:func:`remat.profile`, possibly
            transformed for several ranks).
        budget: bytes or a size string (``"24GiB"``).
        treatments: the treatments the solver may use (default: every profiled one).
        heads: the head modes allowed (default: every profiled one).
        resolution: kept-bytes levels of the DP (finer: slower, misses less).
        offload_margin: the fraction of the budget a plan that offloads leaves free (module doc).
        recompute_margin: the fraction of a block's ``keep`` seconds another treatment must save to
            be chosen over ``keep`` (0: the least predicted time, however small the gain).

    Returns:
        A :class:`~remat.planning.plans.Plan` whose ``notes`` hold the prediction (peak, step time,
        where the peak is set) and what it was made for.

    Raises:
        ValueError: a bad budget or margin, no head mode left, a treatment the profile lacks.
        NoPlanFits: nothing fits; it names the smallest budget that fits, with that plan.

    Example:
        >>> prof = remat.profile(model, batch)                          # doctest: +SKIP
        >>> for budget in ("16GiB", "24GiB"):                           # doctest: +SKIP
        ...     print(budget, remat.solve(prof, budget).summary())
    """
    budget = parse_budget(budget)
    if not 0 <= offload_margin < 1:
        raise ValueError(f"offload_margin is a fraction of the budget in [0, 1), got {offload_margin!r}")
    if not 0 <= recompute_margin < 1:
        raise ValueError(f"recompute_margin is a fraction of a block's keep time in [0, 1), got {recompute_margin!r}")
    if profile.block_calls:  # a block runs several times a step: one treatment for all its calls
        return _tied(profile, budget, treatments, heads, resolution, offload_margin, recompute_margin)
    options = _options(profile, treatments)
    head_options = [h for h in profile.heads if heads is None or h.mode in heads]
    if not head_options:
        raise ValueError(f"no head mode left to plan with: asked for {list(heads)}, profiled "
                         f"{sorted({h.mode for h in profile.heads})}")
    head_options = undominated_heads(profile, head_options, recompute_margin)
    exact = _uniform(profile, options, head_options, offload_margin, recompute_margin)
    best = _best(profile, options, head_options, budget, resolution, offload_margin, exact, recompute_margin)
    if best is not None and _over_host(profile, best):
        best = _within_host(profile, options, head_options, budget, resolution, offload_margin, recompute_margin)
    if best is None:
        smallest, plan = _smallest(profile, options, head_options, resolution, offload_margin, exact,
                                   recompute_margin)
        n = plan.notes
        raise NoPlanFits(
            f"no plan fits {format_size(budget)}: the smallest budget that fits is {format_size(smallest)} "
            f"({plan.summary()}: predicted peak {format_size(n['predicted_peak_bytes'])}, set in "
            f"{n.get('peak_at')}). Raise the budget to at least {format_size(smallest)}, shorten the batch "
            f"or sequence, or free static memory (static alone is {format_size(profile.static_bytes)}).",
            smallest, plan)
    return _plan(profile, best, budget)


HEAD_BYTES = ("pre_peak", "pre_end", "head_fwd_peak", "head_fwd_end", "head_bwd_peak", "head_bwd_end",
              "pre_bwd_peak", "pre_bwd_end")
"""The fields of a :class:`~remat.planning.costs.HeadCost` that a step's bytes add (:mod:`remat.planning.memory`)."""
TIE_S = 1e-9
"""Seconds by which a head must beat another to drop it (:func:`undominated_heads`): far above the
rounding of a step's sums, far below any difference a profile measures."""


def undominated_heads(profile, heads, recompute_margin: float = RECOMPUTE_MARGIN) -> list:
    """``heads`` less those another of them beats whatever the blocks do: no more bytes in any phase
    (:data:`HEAD_BYTES`) and fewer seconds, its recompute margin and what it can expose of the last
    block's offload copy included (a head whose forward is shorter hides less of that copy: up to the
    difference). Every plan with a dropped head fits wherever the same blocks with the other head fit
    and scores more, so the search finds the same plan without it; on a tie both stay.

    Why: the solver runs one dynamic programme per head option and offload window, most of its time
    on a large model, and a model's plain head is often beaten so by a chunked one, the largest chunk
    by a smaller one."""
    def seconds(head):
        return head_seconds(profile, head) + head_margin(profile, head, recompute_margin)

    def beats(a, b):
        return (all(getattr(a, f) <= getattr(b, f) for f in HEAD_BYTES)
                and seconds(a) + max(0.0, b.head_fwd_s - a.head_fwd_s) + TIE_S < seconds(b))
    return [b for b in heads if not any(a is not b and beats(a, b) for a in heads)]


TIED_CHOICES = 64
"""Most treatment choices for the blocks called several times a step that :func:`_tied` solves
one by one; beyond it they all get one treatment (ALBERT's released configs have one such block)."""


def _tied(profile, budget, treatments, heads, resolution, margin, recompute_margin) -> Plan:
    """:func:`solve` for a profile whose blocks run several times a step (:mod:`remat.planning.calls`).

    A treatment is installed on a module, so every call of a block gets the same one: for each choice
    of treatments for the repeated blocks (all of them up to :data:`TIED_CHOICES`, else one treatment
    for all), the calls are solved as a stack of their own (:func:`~remat.planning.calls.pinned`: a
    repeated block's calls can take only its choice, the others anything), and the best-scoring plan
    wins; :class:`NoPlanFits` names the smallest budget over all choices."""
    shared = repeated(profile)
    options = _options(profile, treatments)
    choices = [[t for t in options if t in profile.treatments(index)] for index in shared]
    for index, own in zip(shared, choices):
        if not own:
            raise ValueError(f"block {profile.block_names[index]} can take none of the treatments {options} "
                             f"(profiled: {', '.join(profile.treatments(index))}); allow one of those")
    combos = list(itertools.islice(itertools.product(*choices), TIED_CHOICES + 1))
    if len(combos) > TIED_CHOICES:
        combos = [(t,) * len(shared) for t in options if all(t in c for c in choices)] or combos[:TIED_CHOICES]
    best, refusals = None, []
    for combo in combos:
        flat = pinned(profile, dict(zip(shared, combo)))
        allowed = [t for t in options if t in flat.treatments()]
        try:
            found = solve(flat, budget, treatments=allowed, heads=heads, resolution=resolution,
                          offload_margin=margin, recompute_margin=recompute_margin)
        except NoPlanFits as error:
            refusals.append(error)
            continue
        chosen = [found.blocks[name] for name in flat.block_names]
        score = plan_score(flat, chosen, flat.head(found.head, found.chunk_tokens), recompute_margin)
        if best is None or score < best[0]:
            best = (score, found, chosen)
    if best is not None:
        _, found, chosen = best
        return replace(found, blocks=dict(zip(profile.block_names, per_block(profile, chosen))),
                       tile_tokens=_per_module_tiles(profile, flat, found))
    error = min(refusals, key=lambda e: float("inf") if e.smallest_peak is None else e.smallest_peak)
    plan = error.plan
    if plan is not None:
        flat = unrolled(profile)
        per_module = replace(plan, blocks=dict(zip(profile.block_names,
                                                   per_block(profile, [plan.blocks[n] for n in flat.block_names]))))
        raise NoPlanFits(str(error).replace(plan.summary(), per_module.summary()), error.smallest_peak, per_module,
                         error.host_limited)
    raise error




def _per_module_tiles(profile, flat, found: Plan):
    """``found``'s ``tile_tokens`` (solved over ``flat``, one name per call) per module of ``profile``:
    a block's calls share its module, so each takes its first call's chunk."""
    sizes = found.tile_tokens
    if not isinstance(sizes, dict):
        return sizes
    per_block_sizes = per_block(profile, [sizes.get(name) for name in flat.block_names])
    return tile_tokens(profile.block_names, per_block_sizes)

class _Found(NamedTuple):
    """A plan the search found: what it scores, each block's treatment, the head, and each block's
    chunk (None for a block not tiled)."""

    score: float
    treatments: list
    head: object
    tiles: list


def _over_host(profile, found: _Found) -> bool:
    return profile.host_limit is not None and host_bytes(profile, found.treatments, found.tiles) > profile.host_limit


def _within_host(profile, options, head_options, budget, resolution, margin, recompute_margin):
    """The best plan within ``budget`` whose offloaded tensors fit the host's pinned memory
    (``profile.host_limit``), or a :class:`NoPlanFits` that names the host as the limit.

    A Lagrangian search: each offloading block is charged ``price`` seconds per pinned byte, and
    the least price at which the best plan fits the host is found by bisection (on a log scale);
    a plan that fits at some price is returned with its true score. At a price no offload is
    worth (one second per kilobyte), a plan that still offloads beyond the host means no plan
    fits both memories."""
    def solve_at(price):
        charged = _charged(profile, price)
        exact = _uniform(charged, options, head_options, margin, recompute_margin)
        return _best(charged, options, head_options, budget, resolution, margin, exact, recompute_margin)
    low, high = 0.0, 1e-12  # seconds per byte: from a millisecond per GB ...
    found = solve_at(high)
    while found is not None and _over_host(profile, found) and high < 1e-3:  # ... to seconds per KB
        low, high = high, high * 100
        found = solve_at(high)
    if found is None or _over_host(profile, found):
        last = found or solve_at(0.0)
        offloading = _plan(profile, last, budget)
        plain = [t for t in options if t not in OFFLOADING_TREATMENTS]
        smallest, plan = _smallest(profile, plain, head_options, resolution, margin,
                                   _uniform(profile, plain, head_options, margin, recompute_margin),
                                   recompute_margin) if plain else (None, None)
        without = (f" Without offload the smallest GPU budget is {format_size(smallest)} ({plan.summary()})."
                   if smallest is not None else "")
        raise NoPlanFits(
            f"no plan fits {format_size(budget)} of GPU memory within the host's "
            f"{format_size(profile.host_limit)} of pinned memory for offloaded tensors: the fastest that fits the "
            f"GPU offloads {format_size(offloading.notes['host_bytes'])} ({offloading.summary()}).{without} Give "
            "offload more host memory (remat.plan(..., host_memory=...), `remat plan --host-memory`; without it, a "
            "plan measured on this machine's GPU may pin 60% of its available memory and a fake-tensor plan has no "
            "limit), raise the GPU budget, or shorten the batch or sequence.",
            smallest, plan, host_limited=True)
    for _ in range(12 if low else 0):  # the least price whose plan fits: offload as much as the host allows
        middle = (low * high) ** 0.5
        attempt = solve_at(middle)
        if attempt is not None and not _over_host(profile, attempt):
            high, found = middle, attempt
        else:
            low = middle
    return found._replace(score=plan_score(profile, found.treatments, found.head, recompute_margin, found.tiles))


def _charged(profile, price):
    """``profile`` whose offloading treatments cost ``price`` seconds more per pinned host byte."""
    return profile.with_costs(lambda _, t, c: replace(c, fwd_s=c.fwd_s + price * c.host_bytes)
                              if t in OFFLOADING_TREATMENTS else c)


def _best(profile, options, head_options, budget, resolution, margin, exact, recompute_margin):
    """The best-scoring plan within ``budget`` (a :class:`_Found`), or None.

    Plans that offload are held to ``budget * (1 - margin)``; each window the engine may
    use (it can depend on the largest offloaded block) gets its own DP. ``exact``: plans
    checked without rounding (:func:`_uniform`), taken where their bytes fit ``budget``.
    """
    plain = [t for t in options if t not in OFFLOADING_TREATMENTS]
    runs = [(plain, budget)] if plain else []
    # in the options' order where the largest offloads tie (a set's order would follow the hash seed)
    offloading = sorted(dict.fromkeys(t for t in options if t in OFFLOADING_TREATMENTS),
                        key=lambda t: largest_offload(profile, t))
    sizes = [largest_offload(profile, t) for t in offloading]
    for k in range(len(offloading)):  # offload treatments up to the k-th largest: its window
        if k + 1 < len(offloading) and sizes[k + 1] == sizes[k]:
            continue  # the next run has this window too and more treatments: it finds what this one would
        runs.append((plain + offloading[:k + 1], int(budget * (1 - margin))))
    best = None
    for allowed, limit in runs:
        for head in head_options:
            found = _fastest(profile, allowed, head, limit, resolution, recompute_margin)
            if found is not None and (best is None or found.score < best.score):
                best = found
    for need, found in exact:
        if need <= budget and (best is None or found.score < best.score):
            best = found
    return best


def _uniform(profile, options, head_options, margin, recompute_margin) -> list:
    """(smallest budget that fits, :class:`_Found`) of every uniform plan: one treatment on every
    block, for each head option, and for a tiled treatment each chunk size, largest first.

    The simulator's bound, not the DP's rounded one, so a plan that fits by less than the
    DP's rounding is still found; its score is the DP's own (:func:`plan_score`). A block that can
    take one treatment only (a call :func:`_tied` pinned) takes it in every such plan.
    """
    L = len(profile.block_names)
    out, seen, tables = [], set(), {}
    for t in options:
        only = [profile.treatments(i) for i in range(L)]
        chosen = [t if t in own else own[0] if len(own) == 1 else None for own in only]
        if None in chosen or any(c not in options for c in chosen) or tuple(chosen) in seen:
            continue
        seen.add(tuple(chosen))
        offloads = next((c for c in chosen if c in OFFLOADING_TREATMENTS), t)
        chunks = sorted({s for i in range(L) for s in profile.tile_sizes(i, t)}, reverse=True) or [None]
        for head in head_options:
            for chunk in chunks:
                tiles = [chunk if c == t else None for c in chosen]
                bound = simulate(profile, chosen, head=head.mode, chunk_tokens=head.chunk_tokens,
                                 tile_tokens=tiles).bound_bytes
                out.append((_need(bound, offloads, margin),
                            _Found(_score(profile, chosen, head, recompute_margin, tiles, tables), chosen, head,
                                   tiles)))
    return out


def _options(profile, treatments) -> list:
    """The treatments some block can take (the DP offers each block only its own), filtered by
    ``treatments``; one that no block can take is an error."""
    available = profile.treatments()
    if treatments is not None:
        unknown = [t for t in treatments if t not in available]
        if unknown:
            why = "".join(f"; {t}: {profile.notes[t]}" for t in unknown if isinstance(profile.notes.get(t), str))
            raise ValueError(f"treatments {unknown} are not in the profile (profiled: {', '.join(available)}){why}")
        available = tuple(t for t in available if t in treatments)
    return list(available)


def _plan(profile, found: _Found, budget) -> Plan:
    chosen, head = found.treatments, found.head
    draft = Plan(blocks=dict(zip(profile.block_names, chosen)), head=head.mode,
                 chunk_tokens=head.chunk_tokens if head.mode == "chunked" else None,
                 tile_tokens=tile_tokens(profile.block_names, found.tiles))
    result = simulate(profile, draft)
    notes = {"predicted_peak_bytes": result.peak_bytes, "predicted_bound_bytes": result.bound_bytes,
             "predicted_step_s": round(result.step_s, 5),
             "predicted_tokens_per_s": round(result.tokens_per_s, 1), "budget_bytes": budget,
             "peak_at": result.peak_at, "gpu": profile.rates.name, "measured_rates": profile.rates.measured,
             "batch": profile.batch, "seq": profile.seq, "optimizer": profile.optimizer}
    notes.update(made_for_notes(model=profile.model, dtype=profile.dtype))   # what apply and doctor compare
    notes.update(comm_notes(profile, result))
    notes.update(context_notes(profile))
    if result.optimizer_s:
        notes["predicted_optimizer_s"] = round(result.optimizer_s, 5)
    if result.offload_bytes:
        notes.update(offload_bytes=result.offload_bytes, moved_bytes=result.moved_bytes,
                     exposed_copy_s=round(result.exposed_copy_s, 5), bound_at=result.bound_at,
                     host_bytes=host_bytes(profile, chosen, found.tiles), host_limit=profile.host_limit)
    return replace(draft, notes=notes)


def tile_tokens(block_names, tiles):
    """A plan's ``tile_tokens`` for blocks chunked as ``tiles`` (a size per block, None where it is
    not tiled): None when none is tiled, one size when every tiled block takes the same, else a
    ``{block name: size}`` mapping of the tiled blocks."""
    named = {name: size for name, size in zip(block_names, tiles) if size is not None}
    sizes = set(named.values())
    if not sizes:
        return None
    return sizes.pop() if len(sizes) == 1 else named


def _calls(profile, treatments, tiles):
    """``(profile, treatments, tiles)`` per block call (:func:`~remat.planning.calls.per_call`)."""
    tiles = None if tiles is None else each_call(profile, tiles)
    profile, treatments = per_call(profile, treatments)
    return profile, treatments, tiles


def plan_seconds(profile, treatments, head, tiles=None) -> float:
    """The additive step time of ``treatments`` in the DP's terms (see the module doc); ``tiles``:
    each block's chunk (None: the default)."""
    profile, treatments, tiles = _calls(profile, treatments, tiles)
    return _evaluate(profile, treatments, head, tiles=tiles)[0]


def plan_score(profile, treatments, head, recompute_margin: float = RECOMPUTE_MARGIN, tiles=None) -> float:
    """What the solver minimises for ``treatments`` (chunked as ``tiles``) and ``head``:
    :func:`plan_seconds` plus the recompute margin (its blocks' and its head's)."""
    profile, treatments, tiles = _calls(profile, treatments, tiles)
    return _evaluate(profile, treatments, head, margin=recompute_margin, tiles=tiles)[2]


def _score(profile, treatments, head, recompute_margin, tiles, tables: dict) -> float:
    """:func:`plan_score`, the DP's tables of each set of options and head built once in ``tables``
    (a plan's chunks change which entries it reads, not the tables)."""
    profile, treatments, tiles = _calls(profile, treatments, tiles)
    options = sorted(set(treatments), key=list(profile.treatments()).index)
    key = (tuple(options), id(head))
    if key not in tables:
        tables[key] = Tables(profile, options, head, recompute_margin)
    return _evaluate(profile, treatments, head, options=options, margin=recompute_margin, tiles=tiles,
                     tables=tables[key])[2]


def plan_bound(profile, treatments, head, tiles=None) -> float:
    """The peak the DP checks for ``treatments`` (chunked as ``tiles``), without its rounding (for
    tests and reports)."""
    profile, treatments, tiles = _calls(profile, treatments, tiles)
    return _evaluate(profile, treatments, head, tiles=tiles)[1]


def _evaluate(profile, treatments, head, options=None, margin=0.0, tiles=None, tables=None):
    """(seconds, bound, score) of one plan in the DP's own terms: :class:`LiveBytes` over the DP's
    tables; ``margin``: the recompute margin in the score; ``tiles``: each block's chunk (None: the
    default).

    ``options``: the treatments the DP chose from (they set the engine's window); default: the plan's.
    ``tables``: those options' :class:`Tables` (with this head and margin), built once by a caller
    that evaluates many plans over the same options.
    """
    options = list(options or sorted(set(treatments), key=list(profile.treatments()).index))
    tab = tables if tables is not None else Tables(profile, options, head, margin)
    index = [options.index(t) for t in treatments]
    tiles = list(tiles) if tiles is not None else [None] * len(index)
    variant = [tab.variant_of(profile, i, t, s) for i, (t, s) in enumerate(zip(index, tiles))]
    live = LiveBytes(profile.static_bytes, head, profile.optimizer_temp_bytes)
    seconds, flag, peak = head_seconds(profile, head), False, live.embeddings_forward().peak
    score = seconds + head_margin(profile, head, margin)
    terms, backward_engine = [], []
    for i, t in enumerate(index):
        p = index[i - 1] if i else 0
        prev_off = tab.off[i - 1, p] if i else 0.0
        res_f, res_b = engine_bounds(tab.window, tab.largest, prev_off, flag, tab.prefetch)
        # the DP counts no block as freeing kept bytes, and later blocks' leftovers at their largest
        z = variant[i]
        terms.append(BlockTerms(kept=max(tab.d[i, p, t], 0.0), forward=tab.fwd[i, p, t, z], carried=0,
                                backward=tab.bwd[i, p, t, z], left=tab.left[i]))
        peak = max(peak, live.forward(terms[i]).peak + res_f)
        backward_engine.append(res_b)
        seconds += tab.time[i, p, t, z]
        score += tab.score[i, p, t, z]
        flag = flag or prev_off > 0
    res, _ = engine_bounds(tab.window, tab.largest, tab.off[-1, index[-1]], flag, tab.prefetch)
    peak = max(peak, live.head_peak() + live.kept + res)
    for i in reversed(range(len(index))):
        peak = max(peak, live.backward(i, terms[i]).peak + backward_engine[i])
    peak = max(peak, live.embeddings().peak, live.optimizer_step().peak)
    return float(seconds), float(peak), float(score)


def _fastest(profile, options, head, budget, resolution, recompute_margin):
    """The best-scoring plan within ``budget`` for ``head`` (a :class:`_Found`), or None."""
    found = dp(profile, options, head, MinTime(budget), budget, resolution, recompute_margin)
    if found is None:
        return None
    score, chosen, tiles = found
    if simulate(profile, chosen, head=head.mode, chunk_tokens=head.chunk_tokens, tile_tokens=tiles).bound_bytes > budget:
        return None  # never: the DP bounds every phase from above (kept for safety)
    return _Found(score + head_seconds(profile, head) + head_margin(profile, head, recompute_margin), chosen, head, tiles)


def _smallest(profile, options, head_options, resolution, margin, exact, recompute_margin):
    """The smallest budget that :func:`solve` accepts, and its plan.

    The least that a uniform plan needs (``exact``, from :func:`_uniform`) is an upper
    bound, which :func:`_best` accepts exactly. The DP with :class:`~remat.planning.dp.MinPeak` (a state's
    value is the largest phase bound so far instead of the time), once per head option and
    for plans with and without offload (those need ``1 / (1 - margin)`` of their peak), may
    find less; :func:`solve`'s own search then confirms it, its rounding (relative to the
    budget) differing by a few levels, with the budget nudged up by 0.2% until it accepts,
    never past the uniform plans' least.
    """
    high = min(need for need, _ in exact)
    plain = [t for t in options if t not in OFFLOADING_TREATMENTS]
    groups = [(plain, 0.0)] if plain else []
    if len(plain) < len(options):
        groups.append((options, margin))
    need = high
    for allowed, m in groups:
        for head in head_options:
            found = dp(profile, allowed, head, MinPeak(), high, resolution)
            if found is not None:
                need = min(need, int(found[0] / (1 - m)) + 1)
    for _ in range(200):
        found = _best(profile, options, head_options, need, resolution, margin, exact, recompute_margin)
        if found is not None:
            return need, _plan(profile, found, need)
        need = min(int(need * 1.002) + 1, high)
    raise AssertionError("the smallest uniform plan always fits its own bound")  # pragma: no cover


def _need(bound, treatment, margin) -> int:
    return int(bound / (1 - margin)) + 1 if treatment in OFFLOADING_TREATMENTS else int(bound)
