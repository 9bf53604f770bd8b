"""The planner chooses the tiled treatments' chunk per block (issue 28).

A profile measures the tiled treatments at several chunk sizes (``Profile.tiles``); a smaller
chunk holds less of the MLP's intermediates and pays per-chunk launches and weight-gradient sums.
The solver takes, per block, the chunk its own predictions rank best within the budget (the larger
on a tie) and writes it into the plan's ``tile_tokens``, which ``remat.apply`` installs block by
block. Checked on hand-made profiles against brute force (every treatment x chunk of every block),
on a real model profiled with fake tensors (the chunk changes the transient peaks and the seconds,
not what a block keeps) and by what the applied tiled modules run. A solver that always takes the
default chunk fails ``test_a_tighter_budget_takes_a_smaller_chunk`` and the brute force.
"""
import contextlib
import copy
import itertools
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import SETTINGS

import remat
from remat.planning.costs import TILE_CANDIDATES, BlockCost, HeadCost, Profile, rates_for
from remat.planning.offload_model import EngineModel
from remat.planning.plans import DEFAULT_TILE_TOKENS, OFFLOADING_TREATMENTS, Plan
from remat.planning.simulator import simulate
from remat.planning.solver import OFFLOAD_MARGIN, NoPlanFits, plan_bound, plan_score, solve

MiB = 2**20
MS = 1e-3
CHUNKS = (8192, 4096, 2048)  # the default first: classes hold it, tiles the others


def _cost(*, kept, saves_input, fwd_peak, bwd_peak, fwd_s, bwd_s, hidden=MiB):
    return BlockCost(fwd_peak=fwd_peak, kept=kept, out_alive=hidden, out_bytes=hidden, saves_input=saves_input,
                     bwd_peak=bwd_peak, bwd_end=2 * hidden, fwd_s=fwd_s, bwd_s=bwd_s,
                     offloadable=hidden if saves_input else kept)


def tiled_stack(blocks=4, *, tied=False):
    """Identical blocks: ``keep`` and ``full`` hold a 12 MiB backward (the MLP's intermediates at
    once); ``tiled`` keeps 4 MiB (attention's saved tensors), ``full+tiled`` only its input; each
    holds, in backward, 6 / 4.5 / 3.5 MiB at chunks of 8192 / 4096 / 2048 (a quarter of that in forward,
    above what it keeps) and pays 0.2 ms a halving
    (``tied``: 16384 is profiled too and costs what 8192 does)."""
    peaks = {8192: 6 * MiB, 4096: int(4.5 * MiB), 2048: int(3.5 * MiB), 16384: 6 * MiB}
    extra = {8192: 0.0, 4096: 0.2 * MS, 2048: 0.4 * MS, 16384: 0.0}

    def tiled(chunk, kept, saves_input, recompute):
        return _cost(kept=kept, saves_input=saves_input, fwd_peak=kept + peaks[chunk] // 4, bwd_peak=peaks[chunk],
                     fwd_s=1 * MS + extra[chunk] / 2, bwd_s=2 * MS + recompute + extra[chunk])

    def at(chunk):
        costs = {"tiled": tiled(chunk, 4 * MiB, False, 0.0), "full+tiled": tiled(chunk, 0, True, 1 * MS)}
        costs["full+offload+tiled"] = replace(costs["full+tiled"], offload_bytes=MiB, host_bytes=MiB)
        return costs
    classes = {"keep": _cost(kept=10 * MiB, saves_input=False, fwd_peak=12 * MiB, bwd_peak=12 * MiB, fwd_s=1 * MS,
                             bwd_s=2 * MS),
               "full": _cost(kept=0, saves_input=True, fwd_peak=12 * MiB, bwd_peak=12 * MiB, fwd_s=1 * MS,
                             bwd_s=3 * MS), **at(8192)}
    tiles = {chunk: at(chunk) for chunk in ((16384, 4096, 2048) if tied else (4096, 2048))}
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=2 * MiB, pre_end=MiB, head_fwd_peak=2 * MiB,
                    head_fwd_end=2 * MiB, head_bwd_peak=2 * MiB, head_bwd_end=2 * MiB, pre_bwd_peak=2 * MiB,
                    pre_bwd_end=0, pre_fwd_s=0.1 * MS, head_fwd_s=0.5 * MS, head_bwd_s=0.5 * MS, pre_bwd_s=0.1 * MS)
    return Profile(model="synthetic", block_names=tuple(f"blocks.{i}" for i in range(blocks)),
                   block_class=(0,) * blocks, classes=(classes,), heads=(head,), param_bytes=0, buffer_bytes=0,
                   optimizer="none", optimizer_bytes=0, static_bytes=0, hidden_bytes=MiB, batch=1, seq=32768,
                   dtype="bfloat16", device="fake", rates=rates_for("h100"), engine=EngineModel(), tiles=(tiles,))


def chunks_of(prof, plan):
    return [plan.tile_of(name) for name in prof.block_names]


def options(prof, treatments):
    """Every (treatment, chunk) a block of ``prof`` can take among ``treatments``."""
    return [(t, s) for t in treatments for s in (prof.tile_sizes(0, t) or (None,))]


def brute_force(prof, treatments, budget):
    """(score, bound, offloads, plan) of every plan over ``treatments`` x chunks, the DP's own terms."""
    head = prof.heads[0]
    out = []
    for combo in itertools.product(options(prof, treatments), repeat=len(prof.block_names)):
        chosen, tiles = [t for t, _ in combo], [s for _, s in combo]
        out.append((plan_score(prof, chosen, head, tiles=tiles), plan_bound(prof, chosen, head, tiles=tiles),
                    any(t in OFFLOADING_TREATMENTS for t in chosen), combo))
    return out


def fits(bound, offloads, budget, less=0.0):
    return bound <= (int(budget * (1 - OFFLOAD_MARGIN)) if offloads else budget) - less


def test_the_chosen_chunks_are_candidates_and_the_best_the_solver_predicts():
    """At budgets from the floor up: every tiled block's chunk is one the profile measured, the plan's
    score is the brute force's best over every treatment x chunk (within the DP's rounding), and no
    block's other chunk would fit (by more than that rounding) and score better."""
    prof = tiled_stack(blocks=3)
    treatments = ["keep", "full", "tiled", "full+tiled"]
    scored = brute_force(prof, treatments, None)
    bounds = sorted({b for _, b, _, _ in scored})
    head = prof.heads[0]
    for budget in [int(b) for b in bounds[::max(1, len(bounds) // 12)]] + [int(bounds[-1])]:
        slack = len(prof.block_names) * budget / 4000
        best = min((s for s, b, o, _ in scored if fits(b, o, budget)), default=None)
        best_with_slack = min((s for s, b, o, _ in scored if fits(b, o, budget, slack)), default=None)
        try:
            plan = solve(prof, budget, treatments=treatments)
        except NoPlanFits:
            assert best_with_slack is None
            continue
        chosen, tiles = list(plan.blocks.values()), chunks_of(prof, plan)
        for t, s in zip(chosen, tiles):
            assert (s in prof.tile_sizes(0, t)) if "tiled" in t else s is None
        score = plan_score(prof, chosen, head, tiles=tiles)
        assert fits(plan_bound(prof, chosen, head, tiles=tiles), False, budget)
        assert score >= best * (1 - 1e-12) and (best_with_slack is None or score <= best_with_slack * (1 + 1e-12))
        for i, (t, s) in enumerate(zip(chosen, tiles)):
            for other in set(prof.tile_sizes(i, t)) - {s}:
                swapped = tiles[:i] + [other] + tiles[i + 1:]
                assert (plan_bound(prof, chosen, head, tiles=swapped) > budget - slack  # the DP rounds kept bytes up
                        or plan_score(prof, chosen, head, tiles=swapped) >= score), (i, s, other)


def test_a_tighter_budget_takes_a_smaller_chunk():
    """With only the tiled treatments, the default chunk where it fits; where memory does not hold it,
    2048, as the simulator's peak requires (a solver that always took 8192 finds nothing here)."""
    prof = tiled_stack()
    loose = simulate(prof, "full+tiled", tile_tokens=8192).bound_bytes
    tight = simulate(prof, "full+tiled", tile_tokens=2048).bound_bytes
    assert tight < simulate(prof, "full+tiled", tile_tokens=4096).bound_bytes < loose
    roomy = solve(prof, loose, treatments=["full+tiled"])
    assert chunks_of(prof, roomy) == [8192] * 4 and roomy.tile_tokens == 8192
    small = solve(prof, tight, treatments=["full+tiled"])
    assert chunks_of(prof, small) == [2048] * 4 and small.tile_tokens == 2048
    assert "tiles of 2048 tokens" in small.summary()
    # the notes are the chosen chunk's prediction, not the default's
    assert small.notes["predicted_bound_bytes"] == tight
    assert small.notes["predicted_step_s"] == pytest.approx(simulate(prof, small).step_s, abs=1e-5)
    assert simulate(prof, small).step_s > simulate(prof, roomy).step_s
    with pytest.raises(NoPlanFits) as error:
        solve(prof, tight - 1, treatments=["full+tiled"])
    assert error.value.smallest_peak == tight and error.value.plan.tile_tokens == 2048


def test_only_the_blocks_whose_backward_sets_the_peak_take_a_small_chunk():
    """``tiled`` on every block keeps 4 MiB a block, so the last blocks' backward runs on the most kept
    bytes: at a budget between, those take smaller chunks and the first keep the default; the plan's
    ``tile_tokens`` is then a mapping, and ``remat plan`` names each run's chunk."""
    from remat.cli.plan import describe
    prof = tiled_stack()
    low = simulate(prof, "tiled", tile_tokens=2048).bound_bytes
    high = simulate(prof, "tiled", tile_tokens=8192).bound_bytes
    plan = solve(prof, (low + high) // 2, treatments=["tiled"])
    tiles = chunks_of(prof, plan)
    assert tiles[0] == 8192 and tiles[-1] < 8192 and tiles == sorted(tiles, reverse=True), tiles
    assert isinstance(plan.tile_tokens, type(plan.blocks)) or hasattr(plan.tile_tokens, "items")
    assert dict(plan.tile_tokens) == dict(zip(prof.block_names, tiles))
    assert describe(plan).startswith(f"0-2 tiled({tiles[0]})") and describe(plan).endswith(f"3 tiled({tiles[-1]})")
    assert simulate(prof, plan).bound_bytes <= (low + high) // 2 < simulate(prof, plan, tile_tokens=8192).bound_bytes


def test_a_tie_takes_the_larger_chunk():
    prof = tiled_stack(tied=True)  # 16384 costs what 8192 does
    plan = solve(prof, 10**12, treatments=["full+tiled"])
    assert plan.tile_tokens == 16384


@st.composite
def tiled_profiles(draw):
    """Random profiles of up to 3 blocks with keep, full, full+tiled at three chunks (what a chunk
    changes: the peaks and the seconds) and full+offload+tiled."""
    hidden = draw(st.integers(1, 8)) * 1024
    n = draw(st.integers(1, 3))
    small = st.integers(0, 64).map(lambda k: k * 1024)
    classes, tiles = [], []
    for _ in range(n):
        costs = {}
        for name, saves_input in (("keep", False), ("full", True)):
            kept = draw(small)
            costs[name] = _cost(kept=kept, saves_input=saves_input, fwd_peak=kept + hidden + draw(small),
                                bwd_peak=2 * hidden + draw(small), fwd_s=draw(st.floats(1e-5, 1e-2)),
                                bwd_s=draw(st.floats(1e-5, 1e-2)), hidden=hidden)
        kept, fwd_s, bwd_s = draw(small), draw(st.floats(1e-5, 1e-2)), draw(st.floats(1e-5, 1e-2))
        at = {}
        for chunk in CHUNKS:
            tiled = _cost(kept=kept, saves_input=True, fwd_peak=kept + hidden + draw(small),
                          bwd_peak=2 * hidden + draw(small), fwd_s=fwd_s, bwd_s=bwd_s + draw(st.floats(0, 1e-3)),
                          hidden=hidden)
            at[chunk] = {"full+tiled": tiled, "full+offload+tiled": replace(tiled, offload_bytes=hidden)}
        classes.append({**costs, **at[8192]})
        tiles.append({chunk: at[chunk] for chunk in CHUNKS[1:]})
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=2 * hidden, pre_end=hidden, head_fwd_peak=3 * hidden,
                    head_fwd_end=2 * hidden, head_bwd_peak=3 * hidden, head_bwd_end=2 * hidden,
                    pre_bwd_peak=2 * hidden, pre_bwd_end=0, pre_fwd_s=1e-4, head_fwd_s=1e-4, head_bwd_s=1e-4,
                    pre_bwd_s=1e-4)
    rates = replace(rates_for("h100"), d2h_Bps=draw(st.floats(1e6, 1e9)), h2d_Bps=draw(st.floats(1e6, 1e9)))
    return Profile(model="synthetic", block_names=tuple(f"blocks.{i}" for i in range(n)),
                   block_class=tuple(range(n)), classes=tuple(classes), heads=(head,), param_bytes=0,
                   buffer_bytes=0, optimizer="none", optimizer_bytes=0, static_bytes=0, hidden_bytes=hidden,
                   batch=1, seq=16384, dtype="bfloat16", device="fake", rates=rates, engine=EngineModel(),
                   tiles=tuple(tiles))


@settings(SETTINGS, max_examples=40)
@given(prof=tiled_profiles(), data=st.data())
def test_the_chunk_choice_is_the_brute_forces(prof, data):
    """Any blocks, any chunk costs, offload or not: the solver's plan scores the least among the plans
    over every treatment x chunk that fit (up to the DP's rounding), and fits."""
    treatments = data.draw(st.sampled_from([["keep", "full", "full+tiled"],
                                            ["keep", "full", "full+tiled", "full+offload+tiled"]]))
    scored = brute_force(prof, treatments, None)
    budget = int(data.draw(st.sampled_from(sorted(b for _, b, _, _ in scored))) * data.draw(st.sampled_from([1.0, 1.05])))
    slack = len(prof.block_names) * budget / 4000
    best = min((s for s, b, o, _ in scored if fits(b, o, budget)), default=None)
    best_with_slack = min((s for s, b, o, _ in scored if fits(b, o, budget, slack)), default=None)
    try:
        plan = solve(prof, budget, treatments=treatments)
    except NoPlanFits:
        assert best_with_slack is None
        return
    chosen, tiles, head = list(plan.blocks.values()), chunks_of(prof, plan), prof.heads[0]
    assert simulate(prof, plan).bound_bytes <= budget
    score = plan_score(prof, chosen, head, tiles=tiles)
    assert score >= best * (1 - 1e-12)
    if best_with_slack is not None:
        assert score <= best_with_slack * (1 + 1e-12)


def test_plan_tile_tokens_one_size_or_per_block_and_old_plans_load(tmp_path):
    blocks = {"l.0": "full+tiled", "l.1": "full", "l.2": "attn-saved+offload+tiled"}
    plan = Plan(blocks, tile_tokens={"l.0": 4096, "l.2": 2048})
    assert [plan.tile_of(n) for n in blocks] == [4096, None, 2048]
    assert plan.summary().endswith("; tiles of 4096 tokens (1 block), 2048 (1 block)")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert json.loads(path.read_text())["tile_tokens"] == {"l.0": 4096, "l.2": 2048}
    assert Plan.load(str(path)) == plan
    # a plan of one size, and one written before sizes were chosen, load as they were
    one = Plan(blocks, tile_tokens=512)
    assert [one.tile_of(n) for n in blocks] == [512, None, 512] and one.to_dict()["tile_tokens"] == 512
    old = {"version": 1, "blocks": blocks, "head": "plain", "chunk_tokens": None, "notes": {}}
    assert Plan.from_dict(old).tile_tokens is None and Plan.from_dict(old).tile_of("l.0") is None
    # renamed onto a PEFT wrapper's names, the mapping follows its blocks
    from remat.planning.plans import resolve
    renamed = resolve(plan, ["base.model.l.0", "base.model.l.1", "base.model.l.2"])
    assert dict(renamed.tile_tokens) == {"base.model.l.0": 4096, "base.model.l.2": 2048}


@pytest.mark.parametrize("tiles, message", [
    ({"l.1": 4096}, r"names blocks the plan does not tile: \['l.1'\]"),
    ({"l.9": 4096}, r"names blocks the plan does not tile: \['l.9'\]"),
    ({"l.0": 0}, "must be a positive integer"),
    ({"l.0": 2.5}, "must be a positive integer"),
    ({"l.0": True}, "must be a positive integer"),
    ("4096", "must be a positive integer"),
])
def test_a_wrong_tile_tokens_is_refused_naming_the_field(tiles, message):
    data = {"version": 1, "blocks": {"l.0": "full+tiled", "l.1": "full"}, "head": "plain", "chunk_tokens": None,
            "notes": {}, "tile_tokens": tiles}
    with pytest.raises(ValueError, match=f"plan.json: .*{message}|plan.json: 'tile_tokens'.*{message}"):
        Plan.from_dict(data, source="plan.json")


def test_a_profile_without_tiles_plans_at_the_default_chunk():
    """A profile made before chunks were chosen (no ``tiles``): its tiled costs are the default
    chunk's, the plan names that chunk, and it still serialises."""
    prof = replace(tiled_stack(), tiles=())
    assert prof.tile_sizes(0, "full+tiled") == (DEFAULT_TILE_TOKENS,) and prof.tile_sizes(0, "full") == ()
    assert prof.cost(0, "full+tiled", 2048) is prof.classes[0]["full+tiled"]
    plan = solve(prof, 10**12, treatments=["full+tiled"])
    assert plan.tile_tokens == DEFAULT_TILE_TOKENS
    data = json.loads(json.dumps(prof.to_dict()))
    assert data["tiles"] == [] and json.loads(json.dumps(tiled_stack().to_dict()))["tiles"][0]["2048"]["tiled"]


def test_a_chunk_not_profiled_is_priced_at_the_next_larger_one():
    prof = tiled_stack()
    assert [prof.tile_size(0, "tiled", s) for s in (None, 64, 2048, 3000, 5000, 8192, 50000)] == [
        8192, 2048, 2048, 4096, 8192, 8192, 8192]
    assert prof.tile_size(0, "full", 2048) is None


def test_every_transform_of_block_costs_reaches_every_chunk():
    """Sharding (FSDP2), DDP, context parallelism and the host-memory price change the tiled costs at
    every chunk alike: they all go through ``Profile.with_costs``."""
    from remat.planning.context import AttentionShape, context
    from remat.planning.replication import replicate
    from remat.planning.sharding import shard
    prof = tiled_stack()
    # private: the solver's host-memory price, charged inside solve() and never handed back as a profile
    from remat.planning.solver import _charged

    def change(before, after):
        return [getattr(after, f) - getattr(before, f) for f in ("fwd_peak", "bwd_peak", "bwd_end", "fwd_s", "bwd_s")]
    for changed in (shard(prof, 2, (4 * MiB,)), replicate(prof, 2, class_grad_bytes=(MiB,), gradient_as_bucket_view=True),
                    context(prof, 2, AttentionShape(heads=4, kv_heads=2, head_dim=8)), _charged(prof, 1e-9)):
        treatment = "full+offload+tiled"  # the host price charges offloading treatments only
        default = change(prof.cost(0, treatment), changed.cost(0, treatment))
        assert any(default)
        for chunk in (4096, 2048):
            assert change(prof.cost(0, treatment, chunk), changed.cost(0, treatment, chunk)) == pytest.approx(default)


def test_the_planners_default_chunk_is_the_one_tiling_runs():
    from remat.treat.tiled import DEFAULT_TILE_TOKENS as treated
    assert treated == DEFAULT_TILE_TOKENS and DEFAULT_TILE_TOKENS in TILE_CANDIDATES


# ---- a real model, profiled with fake tensors, planned, applied

TOKENS = 16384  # where tiled treatments are profiled (TILED_FROM_TOKENS)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).train()
    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    prof = remat.profile(model, ids, head_modes=("plain",), tile_candidates=(2048, 4096))
    return model, prof


def test_the_profile_measures_the_tiled_treatments_at_each_chunk(llama):
    """Each tiled treatment (and its offload) at 8192 in ``classes`` and 4096 / 2048 in ``tiles``; a
    smaller chunk holds less at its peaks and takes longer (per-chunk launches and weight-gradient
    sums on the roofline), and keeps exactly as much."""
    _, prof = llama
    assert [sorted(sizes) for sizes in prof.tiles] == [[2048, 4096]]
    tiled = [t for t in prof.treatments(0) if "tiled" in t]
    assert set(tiled) == set(prof.tiles[0][2048]) == {"tiled", "full+tiled", "full+offload+tiled",
                                                      "attn-saved+tiled", "attn-saved+offload+tiled"}
    for t in tiled:
        costs = [prof.cost(0, t, s) for s in (8192, 4096, 2048)]
        assert [c.bwd_peak for c in costs] == sorted((c.bwd_peak for c in costs), reverse=True)
        assert costs[0].bwd_peak > costs[-1].bwd_peak
        assert costs[0].fwd_s + costs[0].bwd_s < costs[-1].fwd_s + costs[-1].bwd_s
        assert len({(c.kept, c.out_alive, c.saves_input, c.offload_bytes, c.bwd_end) for c in costs}) == 1


def test_a_planned_chunk_is_what_the_applied_blocks_run(llama):
    """The plan at the smallest budget tiles at 2048; applied, each tiled block's token-wise modules
    run in chunks of what the plan names for it (the MLP's down projection called once a chunk)."""
    from remat.treat.tiled import tile_tokens_of
    model, prof = llama
    with pytest.raises(NoPlanFits) as error:
        solve(prof, 1, treatments=["keep", "full", "tiled", "full+tiled"])
    plan = solve(prof, error.value.smallest_peak, treatments=["keep", "full", "tiled", "full+tiled"])
    assert set(plan.blocks.values()) <= {"tiled", "full+tiled"} and 2048 in chunks_of(prof, plan)
    model = copy.deepcopy(model)
    remat.apply(model, plan)
    for name, block in zip(prof.block_names, model.model.layers):
        assert tile_tokens_of(block) == plan.tile_of(name)
        mlp, calls = block.mlp, []
        handle = mlp.down_proj.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[-2]))
        try:
            x = torch.randn(1, 2 * plan.tile_of(name) + 3, 32, requires_grad=True)
            mlp(x).sum().backward()
        finally:
            handle.remove()
        chunk = plan.tile_of(name)
        assert calls == [chunk, chunk, 3] * 2  # forward, then backward's recompute


def test_a_fake_profile_runs_three_chunks_and_charges_them_all(llama, monkeypatch):
    """On fake tensors a tiled call runs its first, one middle and its last chunk, the middle one
    counted for every middle chunk: the same costs as running all of them (to float rounding)."""
    from remat.profiling import profiler
    from remat.treat.tile_function import chunk_runs
    model, sampled = llama
    assert [start for start, _ in chunk_runs(TOKENS, 2048, lambda times: contextlib.nullcontext())] == [0, 2048, 14336]
    assert len(chunk_runs(TOKENS, 2048, None)) == 8
    monkeypatch.setattr(profiler, "sampled_chunks", lambda repeated: contextlib.nullcontext())
    every = remat.profile(model, torch.zeros(1, TOKENS, dtype=torch.long), head_modes=("plain",),
                          tile_candidates=(2048, 4096))
    for treatment in every.treatments(0):
        for size in (8192, 4096, 2048) if "tiled" in treatment else (8192,):
            a, b = sampled.cost(0, treatment, size), every.cost(0, treatment, size)
            for field in a.__dataclass_fields__:
                x, y = getattr(a, field), getattr(b, field)
                if isinstance(x, float):
                    assert x == pytest.approx(y, rel=1e-9), (treatment, size, field)
                else:
                    assert x == y, (treatment, size, field)
