"""Properties of the simulator and the solver on synthetic profiles (hypothesis; no model).

Profiles are built directly from random :class:`BlockCost`/:class:`HeadCost` records, each
block its own class, with the five measured-or-derived treatments a profile has (keep,
full, selective, offload, full+offload) and random offload engine settings.
"""
import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat.planning.costs import BlockCost, HeadCost, Profile, rates_for
from remat.planning.offload_model import EngineModel
from remat.planning.plans import HEAD_MODES, OFFLOADING_TREATMENTS, TREATMENTS, Plan
from remat.planning.simulator import simulate
from remat.planning.solver import (OFFLOAD_MARGIN, RECOMPUTE_MARGIN, NoPlanFits, plan_bound, plan_score,
                                   plan_seconds, solve)

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
KiB = 1024
nbytes = st.integers(0, 64).map(lambda n: n * KiB)
seconds = st.floats(1e-5, 1e-2)


@st.composite
def block_costs(draw, hidden):
    """keep/full/selective for one block, and the offload treatments derived from them.

    ``selective`` may time a little faster than ``keep`` (as a compiled block timed alone can)."""
    grads = draw(nbytes) + hidden  # parameter gradients + the input gradient
    out_alive = hidden - draw(st.sampled_from([0, 0, 512]))
    fwd_s, bwd_s = draw(seconds), draw(seconds)
    selective_s = draw(st.sampled_from([-0.02, -0.005, 1 / 3])) * fwd_s
    costs = {}
    for name, saves_input, extra_s in (("keep", False, 0.0), ("selective", True, selective_s), ("full", True, fwd_s)):
        kept = draw(nbytes)
        costs[name] = BlockCost(fwd_peak=kept + out_alive + draw(nbytes), kept=kept, out_alive=out_alive,
                                out_bytes=hidden, saves_input=saves_input, bwd_peak=grads + draw(nbytes),
                                bwd_end=grads, fwd_s=fwd_s, bwd_s=bwd_s + extra_s,
                                offloadable=draw(st.integers(0, kept)) + (hidden if saves_input else 0))
    costs["offload"] = replace(costs["keep"], offload_bytes=costs["keep"].offloadable)
    costs["full+offload"] = replace(costs["full"], offload_bytes=costs["full"].offloadable)
    return costs


@st.composite
def profiles(draw, max_blocks=4):
    hidden = draw(st.integers(1, 16)) * KiB
    n = draw(st.integers(1, max_blocks))
    classes = tuple(draw(block_costs(hidden)) for _ in range(n))
    heads = []
    for mode, chunk in (("plain", None), ("chunked", 1024)):
        pre_end = hidden + draw(nbytes)
        head_fwd_end = pre_end + draw(nbytes)
        head_bwd_end = pre_end + draw(nbytes)
        heads.append(HeadCost(mode=mode, chunk_tokens=chunk, pre_peak=pre_end + draw(nbytes), pre_end=pre_end,
                              head_fwd_peak=head_fwd_end + draw(nbytes), head_fwd_end=head_fwd_end,
                              head_bwd_peak=head_bwd_end + draw(nbytes), head_bwd_end=head_bwd_end,
                              pre_bwd_peak=head_bwd_end + draw(nbytes), pre_bwd_end=draw(nbytes),
                              pre_fwd_s=draw(seconds), head_fwd_s=draw(seconds), head_bwd_s=draw(seconds),
                              pre_bwd_s=draw(seconds)))
    engine = EngineModel(window_bytes=draw(st.one_of(st.none(), nbytes)), window_records=draw(st.integers(1, 2)),
                         issue_bytes=draw(nbytes), prefetch_blocks=draw(st.integers(0, 2)))
    rates = replace(rates_for("h100"), d2h_Bps=draw(st.floats(1e6, 1e9)), h2d_Bps=draw(st.floats(1e6, 1e9)))
    static = draw(st.integers(0, 256)) * KiB
    return Profile(model="synthetic", block_names=tuple(f"blocks.{i}" for i in range(n)),
                   block_class=tuple(range(n)), classes=classes, heads=tuple(heads), param_bytes=static,
                   buffer_bytes=0, optimizer="none", optimizer_bytes=0, static_bytes=static, hidden_bytes=hidden,
                   batch=1, seq=1024, dtype="bfloat16", device="fake", rates=rates, engine=engine)


def uniform_bounds(prof):
    return [simulate(prof, t, head=h.mode, chunk_tokens=h.chunk_tokens).bound_bytes
            for t in prof.treatments(0) for h in prof.heads]


def solved(prof, budget, treatments=None, **options):
    try:
        return solve(prof, budget, treatments=treatments, **options)
    except NoPlanFits:
        return None


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_solved_plan_is_within_budget(prof, data):
    bounds = uniform_bounds(prof)
    budget = data.draw(st.integers(min(bounds) * 9 // 10, max(bounds) * 11 // 10))
    plan = solved(prof, budget)
    if plan is None:
        return
    sim = simulate(prof, plan)
    offloads = any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values())
    assert sim.peak_bytes <= sim.bound_bytes <= (int(budget * (1 - OFFLOAD_MARGIN)) if offloads else budget)
    assert plan.notes["predicted_bound_bytes"] == sim.bound_bytes


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_no_plan_fits_names_a_budget_that_fits(prof, data):
    bounds = uniform_bounds(prof)
    budget = data.draw(st.integers(1, min(bounds)))   # 0 is refused as a budget (units.parse_budget)
    try:
        solve(prof, budget)
    except NoPlanFits as e:
        assert e.smallest_peak > budget
        assert simulate(prof, e.plan).bound_bytes <= e.smallest_peak
        assert solved(prof, e.smallest_peak) is not None


@SETTINGS
@given(prof=profiles(), data=st.data(), plain=st.booleans())
def test_larger_budget_never_slower(prof, data, plain):
    """More memory never makes the solver's plan worse in the score it minimises, nor slower by
    more than the recompute margin of the blocks' keep time (without offload the DP's time is the
    simulator's step time too)."""
    treatments = [t for t in prof.treatments(0) if not (plain and t in OFFLOADING_TREATMENTS)]
    bounds = uniform_bounds(prof)
    small = data.draw(st.integers(min(bounds), max(bounds) * 11 // 10))
    large = small + data.draw(st.integers(0, max(bounds)))
    first = solved(prof, small, treatments)
    assume(first is not None)
    second = solved(prof, large, treatments)
    assert second is not None
    small, large = ((plan_score(prof, list(p.blocks.values()), prof.head(p.head, p.chunk_tokens)),
                     plan_seconds(prof, list(p.blocks.values()), prof.head(p.head, p.chunk_tokens)))
                    for p in (first, second))
    assert large[0] <= small[0] * (1 + 1e-12)
    assert large[1] <= small[1] + given_up(prof) + 1e-12
    if plain:
        assert second.notes["predicted_step_s"] <= first.notes["predicted_step_s"] + given_up(prof) + 1e-5


def given_up(prof):
    """The most seconds the recompute margin may cost: its share of the blocks' keep time and of
    the plain head's forward and backward."""
    from remat.planning.dp import head_margin
    keep = sum(prof.cost(i, "keep").fwd_s + prof.cost(i, "keep").bwd_s for i in range(len(prof.block_names)))
    return RECOMPUTE_MARGIN * keep + max(head_margin(prof, h, RECOMPUTE_MARGIN) for h in prof.heads)


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_recompute_margin_gives_up_at_most_its_share(prof, data):
    """The plan found with the recompute margin is at most the margin's share (:func:`given_up`)
    slower, in the DP's time, than the least-time plan that the solver finds with no margin."""
    bounds = uniform_bounds(prof)
    budget = data.draw(st.integers(min(bounds), max(bounds) * 11 // 10))
    with_margin, least = solved(prof, budget), solved(prof, budget, recompute_margin=0.0)
    assume(least is not None)
    assert with_margin is not None
    seconds = [plan_seconds(prof, list(p.blocks.values()), prof.head(p.head, p.chunk_tokens))
               for p in (with_margin, least)]
    assert seconds[1] <= seconds[0] + 1e-12
    assert seconds[0] <= seconds[1] + given_up(prof) + 1e-12


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_peak_is_monotone_in_what_a_block_keeps(prof, data):
    """Giving one block a treatment that keeps more bytes (all else equal) never lowers the
    predicted peak, the bound or the solver's bound of the plan."""
    n = len(prof.block_names)
    plan = [data.draw(st.sampled_from(prof.treatments(0))) for _ in range(n)]
    head = data.draw(st.sampled_from(prof.heads))
    j, more = data.draw(st.integers(0, n - 1)), data.draw(st.integers(1, 64 * KiB))
    cost = prof.cost(j, plan[j])
    classes = list(prof.classes)
    classes[j] = dict(classes[j], **{plan[j]: replace(cost, kept=cost.kept + more, fwd_peak=cost.fwd_peak + more)})
    more_kept = replace(prof, classes=tuple(classes))
    before = simulate(prof, plan, head=head.mode, chunk_tokens=head.chunk_tokens)
    after = simulate(more_kept, plan, head=head.mode, chunk_tokens=head.chunk_tokens)
    assert after.peak_bytes >= before.peak_bytes and after.bound_bytes >= before.bound_bytes
    assert plan_bound(more_kept, plan, head) >= plan_bound(prof, plan, head)


@SETTINGS
@given(prof=profiles(), data=st.data())
def test_solver_bound_covers_the_simulator(prof, data):
    """The bound the DP checks is never below the simulator's bound: what makes its plans fit."""
    plan = [data.draw(st.sampled_from(prof.treatments(0))) for _ in prof.block_names]
    head = data.draw(st.sampled_from(prof.heads))
    sim = simulate(prof, plan, head=head.mode, chunk_tokens=head.chunk_tokens)
    assert sim.peak_bytes <= sim.bound_bytes <= plan_bound(prof, plan, head)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8)
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3),
                           max_leaves=6)


@settings(max_examples=100, deadline=None, database=None)
@given(blocks=st.dictionaries(st.text(min_size=1, max_size=12), st.sampled_from(TREATMENTS), max_size=6),
       head=st.sampled_from(HEAD_MODES), chunk=st.one_of(st.none(), st.integers(1, 2**20)),
       notes=st.dictionaries(st.text(max_size=10), json_values, max_size=4))
def test_plans_round_trip_through_json(blocks, head, chunk, notes):
    plan = Plan(blocks=blocks, head=head, chunk_tokens=chunk, notes=notes)
    loaded = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert loaded.to_dict() == plan.to_dict()
    assert list(loaded.blocks) == list(plan.blocks)
    assert loaded == plan
