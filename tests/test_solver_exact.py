"""The solver never loses a plan that fits exactly because of its rounding.

The DP rounds each block's kept bytes up to ``budget / resolution``; a uniform plan (one
treatment on every block) whose exact bound is just under the budget used to be excluded by
that rounding (a ViT-L at HF full checkpointing's own peak got a slower offloading plan). The
solver now also checks every uniform plan exactly with the simulator.
"""
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import SETTINGS, profiles

from remat.planning.costs import BlockCost, HeadCost, Profile, rates_for
from remat.planning.offload_model import EngineModel
from remat.planning.plans import OFFLOADING_TREATMENTS
from remat.planning.simulator import simulate
from remat.planning.dp import MinTime, dp
from remat.planning.solver import OFFLOAD_MARGIN, NoPlanFits, plan_score, plan_seconds, solve

MiB = 2**20


def stack(blocks=24, hidden=MiB):
    """Identical blocks whose peak is at the head: ``full`` keeps each block's input (one hidden
    state, not a multiple of the DP's level), ``keep`` 8 MiB more a block, ``full+offload``
    nothing but is bus bound (a block's input takes 5 ms to copy, its forward 1 ms)."""
    def cost(kept, saves_input, extra_s=0.0):
        return BlockCost(fwd_peak=kept + hidden + MiB, kept=kept, out_alive=hidden, out_bytes=hidden,
                         saves_input=saves_input, bwd_peak=3 * hidden, bwd_end=2 * hidden, fwd_s=1e-3,
                         bwd_s=2e-3 + extra_s, offloadable=hidden if saves_input else 0)
    full = cost(0, True, 1e-3)
    costs = {"keep": cost(8 * MiB, False), "full": full, "full+offload": replace(full, offload_bytes=hidden)}
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=2 * hidden, pre_end=hidden,
                    head_fwd_peak=64 * MiB, head_fwd_end=2 * hidden, head_bwd_peak=64 * MiB, head_bwd_end=2 * hidden,
                    pre_bwd_peak=3 * hidden, pre_bwd_end=0, pre_fwd_s=1e-3, head_fwd_s=1e-3, head_bwd_s=1e-3,
                    pre_bwd_s=1e-3)
    rates = replace(rates_for("h100"), d2h_Bps=hidden / 5e-3, h2d_Bps=hidden / 5e-3)
    return Profile(model="synthetic", block_names=tuple(f"blocks.{i}" for i in range(blocks)),
                   block_class=(0,) * blocks, classes=(costs,), heads=(head,), param_bytes=0, buffer_bytes=0,
                   optimizer="none", optimizer_bytes=0, static_bytes=0, hidden_bytes=hidden, batch=1, seq=1024,
                   dtype="bfloat16", device="fake", rates=rates, engine=EngineModel())


@pytest.mark.parametrize("treatments", [["keep", "full"], ["keep", "full", "full+offload"]])
def test_uniform_plan_that_fits_by_less_than_the_rounding_is_found(treatments):
    prof = stack()
    head = prof.heads[0]
    budget = simulate(prof, "full").bound_bytes
    # what the test is about: the DP alone, rounding up, cannot take ``full`` everywhere
    assert dp(prof, ["keep", "full"], head, MinTime(budget), budget, 4000) is None
    plan = solve(prof, budget, treatments=treatments)
    assert set(plan.blocks.values()) == {"full"}
    assert plan.notes["predicted_bound_bytes"] == budget
    # offloading everything fits too (with the margin) but is slower: the copies are exposed
    assert plan_seconds(prof, ["full+offload"] * 24, head) > plan_seconds(prof, ["full"] * 24, head)
    with pytest.raises(NoPlanFits) as error:
        solve(prof, budget - 1, treatments=["keep", "full"])
    assert error.value.smallest_peak == budget  # the smallest budget accepts the exact uniform plan


def uniform(prof):
    """(score, bound, offloads, head) of every uniform plan."""
    n = len(prof.block_names)
    return [(plan_score(prof, [t] * n, h), simulate(prof, t, head=h.mode, chunk_tokens=h.chunk_tokens).bound_bytes,
             t in OFFLOADING_TREATMENTS, h) for t in prof.treatments(0) for h in prof.heads]


def fits(bound, offloads, budget):
    return bound <= (int(budget * (1 - OFFLOAD_MARGIN)) if offloads else budget)


@settings(SETTINGS, max_examples=100)
@given(prof=profiles(max_blocks=6), data=st.data(), resolution=st.sampled_from([8, 30, 200, 4000]))
def test_no_uniform_plan_that_fits_is_faster(prof, data, resolution):
    """At any resolution (coarse ones make the rounding bite): the plan fits exactly, and no
    uniform plan that fits scores better in what the solver minimises (the time, with the
    recompute margin); when nothing fits, the
    smallest budget named is no more than the least a uniform plan needs, and is accepted."""
    plans = uniform(prof)
    bounds = [b for _, b, _, _ in plans]
    budget = data.draw(st.integers(max(1, min(bounds) * 9 // 10), max(bounds) * 11 // 10))
    try:
        plan = solve(prof, budget, resolution=resolution)
    except NoPlanFits as e:
        assert not any(fits(b, o, budget) for _, b, o, _ in plans)
        assert e.smallest_peak <= min(int(b / (1 - OFFLOAD_MARGIN)) + 1 if o else b for _, b, o, _ in plans)
        assert solve(prof, e.smallest_peak, resolution=resolution) is not None
        return
    chosen = list(plan.blocks.values())
    assert fits(simulate(prof, plan).bound_bytes, any(t in OFFLOADING_TREATMENTS for t in chosen), budget)
    found = plan_score(prof, chosen, prof.head(plan.head, plan.chunk_tokens))
    fastest = min((s for s, b, o, _ in plans if fits(b, o, budget)), default=None)
    assert fastest is None or found <= fastest * (1 + 1e-12)
