"""FSDP2's collectives in the time model: hand-computed exposure, resharding, dtypes, world 1,
and the overheads beside the link (copies, launches, contention).

A three-block profile with round numbers: at world 2 and a bus of 1 GB/s a collective of ``B``
bytes takes ``B / 2 / 1e9`` s, so each block's all-gather and bf16 reduce-scatter (4 MB) takes
2 ms and the root's (2 MB) 1 ms. Compute: embeddings 0.5 ms each way, blocks 3 ms forward and
6 ms backward (``keep``) or 9 ms (``full``: the recompute), head 4 ms forward and 1 ms backward.
The exposure tests charge the link alone (``NO_OVERHEADS``); the overhead tests add each term.
"""
import dataclasses
import json

import pytest

from remat.planning.comm import Collectives
from remat.planning.costs import BlockCost, HeadCost, Profile, rates_for
from remat.planning.sharding import FSDP2_OVERHEADS, NO_OVERHEADS, Overheads, comm_notes
from remat.planning.sharding import shard as _shard
from remat.planning.simulator import simulate

MS = 1e-3
P = 4_000_000         # one block's parameter bytes (bf16)
ROOT = 2_000_000      # embeddings, norm, LM head
BLOCKS = 3


def _profile(bwd_keep=6 * MS) -> Profile:
    def cost(bwd_s, kept):
        return BlockCost(fwd_peak=kept + 100, kept=kept, out_alive=10, out_bytes=10, saves_input=True,
                         bwd_peak=kept + 200, bwd_end=P + 10, fwd_s=3 * MS, bwd_s=bwd_s)
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=10, pre_end=10, head_fwd_peak=500,
                    head_fwd_end=50, head_bwd_peak=600, head_bwd_end=10, pre_bwd_peak=20, pre_bwd_end=10,
                    pre_fwd_s=0.5 * MS, head_fwd_s=4 * MS, head_bwd_s=1 * MS, pre_bwd_s=0.5 * MS)
    params = BLOCKS * P + ROOT
    return Profile(model="m", block_names=tuple(f"layers.{i}" for i in range(BLOCKS)), block_class=(0,) * BLOCKS,
                   classes=({"keep": cost(bwd_keep, 1000), "full": cost(bwd_keep + 3 * MS, 20)},), heads=(head,),
                   param_bytes=params, buffer_bytes=0, optimizer="none", optimizer_bytes=0, static_bytes=params,
                   hidden_bytes=10, batch=1, seq=8, dtype="bfloat16", device="fake",
                   rates=dataclasses.replace(rates_for("h100"), bus_Bps=1e9))


def shard(profile, world, class_param_bytes, **options):
    """The link-only model these hand computations were made for (the overheads have tests of their own)."""
    return _shard(profile, world, class_param_bytes, **dict(dict(overheads=NO_OVERHEADS), **options))


def _compute_s(prof, treatment):
    h, c = prof.heads[0], prof.cost(0, treatment)
    return h.pre_fwd_s + h.head_fwd_s + h.head_bwd_s + h.pre_bwd_s + BLOCKS * (c.fwd_s + c.bwd_s)


def test_world_one_is_the_single_gpu_profile_and_step():
    prof = _profile()
    assert shard(prof, 1, (P,)) is prof and _shard(prof, 1, (P,)) is prof and prof.comm is None
    sim = simulate(prof, "keep")
    assert sim.step_s == pytest.approx(_compute_s(prof, "keep"), abs=1e-12)
    assert sim.exposed_comm_s == 0.0 and sim.comm_s == 0.0
    assert all(p.comm_s == 0.0 for p in sim.timeline)
    assert not [p for p in sim.timeline if "all-gather" in p.name or "reduce-scatter" in p.name]
    assert comm_notes(prof, sim) == {}


def test_exposed_communication_hand_computed_resharded():
    """Exposed: the root's gather (1 ms), the first block's gather less the embeddings' forward
    (2 - 0.5), the last block's backward gather less the head's backward (2 - 1), the first block's
    reduce-scatter less the embeddings' backward (2 - 0.5) and the root's reduce-scatter (1): 6 ms.
    Every other collective hides behind a block (2 ms under 3 ms forward; 2 + 2 ms under 6 ms backward)."""
    prof = shard(_profile(), 2, (P,))
    c = prof.comm
    assert c.gather_bytes == (P,) * 3 and c.reduce_bytes == (P,) * 3
    assert (c.root_gather_bytes, c.root_reduce_bytes) == (ROOT, ROOT) and c.seconds(P) == pytest.approx(2 * MS)
    sim = simulate(prof, "keep")
    assert sim.exposed_comm_s == pytest.approx(6 * MS)
    assert sim.step_s == pytest.approx(_compute_s(prof, "keep") + 6 * MS)
    # 3 gathers forward + 3 backward + 3 reduce-scatters at 2 ms, the root's two at 1 ms
    assert sim.comm_s == pytest.approx(9 * 2 * MS + 2 * MS) == pytest.approx(c.total_s())
    waits = {p.name.split(" (")[0]: round(p.comm_s / MS, 9) for p in sim.timeline if p.comm_s}
    assert waits == {"forward: all-gather of the root": 1.0, "forward of block 0": 1.5,
                     "backward of block 2": 1.0, "backward: reduce-scatters left at the end": 2.5}
    stages = sim.stages()
    assert sum(s["seconds"] for s in stages.values()) == pytest.approx(sim.step_s)
    assert sum(s["comm_s"] for s in stages.values()) == pytest.approx(sim.exposed_comm_s)
    notes = comm_notes(prof, sim)
    assert notes["exposed_comm_s"] == pytest.approx(0.006) and notes["fsdp_world"] == 2


def test_exposed_communication_without_overlap():
    """Backward of 3 ms: block 1's backward must hide block 2's reduce-scatter and block 0's
    gather (2 + 2 ms, one link): 1 ms shows, on top of the 6 ms above."""
    prof = shard(_profile(bwd_keep=3 * MS), 2, (P,))
    sim = simulate(prof, "keep")
    assert sim.exposed_comm_s == pytest.approx(7 * MS)
    assert sim.step_s == pytest.approx(_compute_s(prof, "keep") + 7 * MS)


def test_no_reshard_after_forward_gathers_once():
    """reshard_after_forward=False: no backward all-gathers (the last block's 1 ms goes), and every
    block's parameters stay unsharded from its forward to its backward (memory)."""
    base = _profile()
    resharded, kept = shard(base, 2, (P,)), shard(base, 2, (P,), reshard_after_forward=False)
    sim = simulate(kept, "keep")
    assert sim.exposed_comm_s == pytest.approx(5 * MS)
    assert sim.comm_s == pytest.approx(6 * 2 * MS + 2 * MS)
    assert kept.static_bytes == resharded.static_bytes  # one block in flight either way
    assert kept.cost(0, "keep").kept == resharded.cost(0, "keep").kept + P
    # the head sees every block unsharded: all of them more than resharded
    def head_peak(s):
        return next(p.peak_bytes for p in s.timeline if p.name == "backward: head and loss")
    assert head_peak(sim) - head_peak(simulate(resharded, "keep")) == BLOCKS * P


def test_fp32_reduce_doubles_reduce_scatter_bytes():
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): 8 MB reduce-scatters (4 ms); the
    root's 2 ms and the first block's 4 - 0.5 ms are exposed at the end, and under a 6 ms backward
    a block's reduce-scatter plus the next gather (4 + 2) just hides."""
    prof = shard(_profile(), 2, (P,), reduce_dtype="float32")
    assert prof.comm.reduce_bytes == (2 * P,) * 3 and prof.comm.root_reduce_bytes == 2 * ROOT
    sim = simulate(prof, "keep")
    assert sim.exposed_comm_s == pytest.approx((1 + 1.5 + 1 + 3.5 + 2) * MS)


def test_recompute_adds_no_collective_and_hides_more():
    prof = shard(_profile(bwd_keep=3 * MS), 2, (P,))
    keep, full = simulate(prof, "keep"), simulate(prof, "full")
    assert keep.comm_s == full.comm_s
    assert full.exposed_comm_s == pytest.approx(6 * MS)  # a 6 ms backward hides 2 + 2 ms
    assert keep.exposed_comm_s == pytest.approx(7 * MS)


@pytest.mark.parametrize("overheads", [NO_OVERHEADS, FSDP2_OVERHEADS,
                                       Overheads(hbm_Bps_fraction=1e-4, contention=0.5, latency_s=0.3 * MS)])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("bwd_keep", [1 * MS, 3 * MS, 6 * MS])
def test_additive_exposure_equals_the_simulation(reshard, bwd_keep, overheads):
    """Collectives.block_exposed_s (what a solver adds per block) and fixed_exposed_s sum to the
    simulator's step less its compute (the exposed communication and the overheads) for every mix
    of treatments when blocks are resharded (each backward waits for a gather queued behind the
    reduce-scatter before it); without resharding nothing waits in backward, a reduce-scatter's
    excess can still hide behind the next block, and the sum is an upper bound."""
    prof = shard(_profile(bwd_keep), 2, (P,), reshard_after_forward=reshard, reduce_dtype="float32",
                 overheads=overheads)
    for plan in (["keep"] * 3, ["full"] * 3, ["keep", "full", "keep"], ["full", "keep", "keep"]):
        costs = [prof.cost(i, t) for i, t in enumerate(plan)]
        additive = prof.comm.fixed_exposed_s(prof.heads[0]) + sum(
            prof.comm.block_exposed_s(i, c.fwd_s, c.bwd_s) for i, c in enumerate(costs))
        sim = simulate(prof, plan)
        h = prof.heads[0]
        outside = h.pre_fwd_s + h.head_fwd_s + h.head_bwd_s + h.pre_bwd_s
        simulated = sim.step_s - outside - sum(c.fwd_s + c.bwd_s for c in costs)  # the step less its compute
        if overheads is NO_OVERHEADS:
            assert simulated == pytest.approx(sim.exposed_comm_s)
        if reshard:
            assert simulated == pytest.approx(additive), plan
        else:
            assert simulated <= additive + 1e-12, plan


def test_shard_checks_its_options():
    prof = _profile()
    with pytest.raises(ValueError, match="unknown dtype"):
        shard(prof, 2, (P,), reduce_dtype="float7")
    with pytest.raises(ValueError, match="bus_Bps"):
        shard(prof, 2, (P,), bus_Bps=0)
    measured = shard(prof, 2, (P,), bus_Bps=2e9)
    assert measured.comm.bus_measured and measured.comm.seconds(P) == pytest.approx(1 * MS)
    assert Collectives in {type(measured.comm)}
    json.dumps(measured.to_dict())  # the comm record travels with the profile


def test_remat_plan_fsdp_json_includes_the_communication(capsys):
    from remat.cli import main
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "64MiB", "--fsdp", "8"]
    assert main(argv + ["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes["fsdp_world"] == 8 and notes["reshard_after_forward"] is True
    assert notes["comm_s"] > 0 and 0 < notes["exposed_comm_s"] <= notes["comm_s"]
    overhead = notes["comm_copy_s"] + notes["comm_launch_s"] + notes["comm_contention_s"]
    assert notes["comm_overhead_s"] == pytest.approx(overhead, rel=1e-3) and notes["comm_launch_s"] > 0
    assert notes["predicted_step_s"] == pytest.approx(
        notes["compute_s"] + notes["exposed_comm_s"] + notes["comm_overhead_s"], abs=2e-5)
    assert main(argv) == 0
    stages = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("stages"))
    assert "exposed communication" in stages, stages
    assert f"launches {notes['comm_launch_s']:.3f}" in stages and "collective overheads" in stages, stages


def test_bus_rate_needs_a_process_group():
    """The all-gather timing is a collective on a live NCCL group; without one it measures nothing."""
    # private: no public call measures the bus without a process group, which is the point here
    from remat.profiling._calibrate import bus_rate
    assert bus_rate() is None


def test_every_gpu_has_a_bus_rate():
    from remat.planning.costs import GPUS
    assert all(rates_for(name).bus_Bps == GPUS[name]["bus_GBps"] * 1e9 > 0 for name in GPUS)


def test_the_solver_minimises_the_step_with_exposed_communication():
    """Under FSDP2 the DP's objective is the simulator's step (compute + exposed collectives),
    and a plan's notes carry the collectives."""
    import remat
    from remat.presets import build_model, load_config
    from remat.planning.sharding import shard
    from remat.planning.solver import plan_seconds
    from remat.profiling.profiler import block_param_bytes, profile
    import torch
    model = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)
    prof = profile(model, torch.zeros(2, 256, dtype=torch.long), gpu="h100")
    slow_bus = shard(prof, 8, block_param_bytes(model, prof), bus_Bps=1e8)
    for spec in ("keep", "full"):
        treatments = [spec] * len(slow_bus.block_names)
        assert plan_seconds(slow_bus, treatments, slow_bus.head("plain")) == pytest.approx(
            remat.simulate(slow_bus, spec, head="plain").step_s, rel=1e-6)
    plan = remat.solve(slow_bus, 10 ** 12, heads=["plain"])
    assert plan.notes["exposed_comm_s"] > 0 and plan.notes["fsdp_world"] == 8


def test_eager_selective_is_not_planned_under_fsdp2_and_says_why():
    """Under FSDP2 (world > 1) eager ``selective`` waits for its host (the sharding module's doc):
    the sharded profile leaves it out with the reason in its notes, a plan asked to use it says
    why, and a compiled profile, one GPU and world 1 keep it."""
    from remat.planning.sharding import EAGER_SELECTIVE_UNDER_FSDP2
    from remat.planning.solver import solve
    prof = _profile()
    prof = dataclasses.replace(prof, classes=({**prof.classes[0], "selective": prof.cost(0, "full")},))
    sharded = shard(prof, 2, (P,))
    assert "selective" not in sharded.treatments(0) and sharded.notes["selective"] == EAGER_SELECTIVE_UNDER_FSDP2
    assert set(sharded.treatments(0)) == {"keep", "full"}
    with pytest.raises(ValueError, match="not planned under FSDP2"):
        solve(sharded, 10 ** 12, treatments=["selective", "keep"])
    with pytest.raises(ValueError, match="not planned under FSDP2"):  # a given plan simulated sharded
        simulate(sharded, "selective")
    compiled = shard(dataclasses.replace(prof, notes={"compile": True}), 2, (P,))
    assert "selective" in compiled.treatments(0) and "selective" not in compiled.notes
    assert shard(prof, 1, (P,)) is prof and "selective" in prof.treatments(0)


# ---- the overheads beside the link (copies, launches, contention)

COPY_BPS = 1e9  # copies at 1 GB/s: a 4 MB block's all-gather copies (2 * 4 / 2 + 2 * 4 MB) take 12 ms


def _overheads(copies=False, contention=0.0, latency_s=0.0):
    fraction = COPY_BPS / rates_for("h100").hbm_Bps if copies else 0.0
    return Overheads(hbm_Bps_fraction=fraction, contention=contention, latency_s=latency_s)


def test_copies_are_charged_per_block_in_the_phase_where_they_run():
    """Forward: each all-gather copies the shard in (2 * P / 2) and the whole block out (2 * P). Backward:
    the same for the backward all-gather, and the reduce-scatter's copy-in reads P (bf16 gradients) and
    writes 2 P (fp32). The root's: its all-gather's before the first block, its reduce-scatter's after
    the embeddings' backward. Each block phase is longer by its own bytes at the copy rate."""
    base = _profile()
    prof = _shard(base, 2, (P,), reduce_dtype="float32", overheads=_overheads(copies=True))
    c = prof.comm
    assert c.fwd_copy_bytes == (3 * P,) * 3 and c.bwd_copy_bytes == (3 * P + P + 2 * P,) * 3
    assert c.root_fwd_copy_bytes == 3 * ROOT and c.root_bwd_copy_bytes == ROOT + 2 * ROOT
    assert c.copy_Bps == pytest.approx(COPY_BPS)
    sim = simulate(prof, "keep")
    total = 3 * (3 * P + 6 * P) + 3 * ROOT + 3 * ROOT
    assert sim.comm_copy_s == pytest.approx(total / COPY_BPS)
    assert sim.comm_launch_s == 0.0 and sim.comm_contention_s == 0.0
    by_name = {p.name.split(" (")[0]: p for p in sim.timeline}
    for i in range(BLOCKS):
        f, b = by_name[f"forward of block {i}"], by_name[f"backward of block {i}"]
        assert f.overhead_s == pytest.approx(3 * P / COPY_BPS)
        assert f.end_s - f.start_s == pytest.approx(3 * MS + 12 * MS)
        assert b.overhead_s == pytest.approx(6 * P / COPY_BPS)
    assert by_name["forward: all-gather of the root"].overhead_s == pytest.approx(3 * ROOT / COPY_BPS)
    assert by_name["backward: embeddings"].overhead_s == pytest.approx(3 * ROOT / COPY_BPS)
    # the step grows by the copies (the blocks are longer now, so no collective is exposed but the root's)
    assert sim.step_s == pytest.approx(_compute_s(prof, "keep") + sim.comm_copy_s + sim.exposed_comm_s)


def test_overheads_scale_with_block_bytes():
    """Twice the parameters: twice the copy seconds; the launches stay (one per collective)."""
    def sim_for(scale):
        base = _profile()
        bigger = dataclasses.replace(base, param_bytes=base.param_bytes * scale)
        return simulate(_shard(bigger, 2, (P * scale,), overheads=_overheads(copies=True, latency_s=0.1 * MS)),
                        "keep")
    one, two = sim_for(1), sim_for(2)
    assert two.comm_copy_s == pytest.approx(2 * one.comm_copy_s) and one.comm_copy_s > 0
    assert two.comm_launch_s == pytest.approx(one.comm_launch_s)


def test_latency_per_collective():
    """Resharded: the root's all-gather, 3 forward and 3 backward all-gathers, 3 reduce-scatters and the
    root's: 11 collectives; without resharding the 3 backward all-gathers go."""
    for reshard, count in ((True, 11), (False, 8)):
        prof = _shard(_profile(), 2, (P,), reshard_after_forward=reshard, overheads=_overheads(latency_s=0.1 * MS))
        assert simulate(prof, "keep").comm_launch_s == pytest.approx(count * 0.1 * MS)


def test_contention_hand_computed():
    """contention 0.5, no copies or latency: a phase slows by half the link time beside it. Link
    beside compute: the embeddings' forward 0.5 ms (of block 0's 2 ms gather), blocks 0 and 1 forward
    2 ms each, the head's backward 1 ms, blocks 2, 1, 0 backward 2, 4 and 2 ms, the embeddings' backward
    0.5 ms: 14 ms x 0.5 = 7 ms slower. Exposed: the root's gather 1, block 0's gather 2 - 0.75, the last
    block's 2 - 1.5, block 0's reduce-scatter 2 - 0.75 and the root's 1: 5 ms."""
    prof = _shard(_profile(), 2, (P,), overheads=_overheads(contention=0.5))
    sim = simulate(prof, "keep")
    assert sim.comm_contention_s == pytest.approx(7 * MS)
    assert sim.exposed_comm_s == pytest.approx(5 * MS)
    assert sim.step_s == pytest.approx(_compute_s(prof, "keep") + 12 * MS)
    assert sim.comm_copy_s == sim.comm_launch_s == 0.0
    # nothing beside the compute, nothing slowed: the head's forward runs with the link idle
    head = next(p for p in sim.timeline if p.name == "forward: head and loss")
    assert head.overhead_s == 0.0


def test_overheads_in_the_stages_and_notes():
    prof = _shard(_profile(), 2, (P,), overheads=_overheads(copies=True, contention=0.2, latency_s=0.1 * MS))
    sim = simulate(prof, "keep")
    stages = sim.stages()
    overhead = sim.comm_copy_s + sim.comm_launch_s + sim.comm_contention_s
    assert min(sim.comm_copy_s, sim.comm_launch_s, sim.comm_contention_s) > 0
    assert sum(s["overhead_s"] for s in stages.values()) == pytest.approx(overhead)
    assert stages["forward"]["overhead_s"] > 0 and stages["backward"]["overhead_s"] > 0
    assert sum(s["seconds"] for s in stages.values()) == pytest.approx(sim.step_s)
    notes = comm_notes(prof, sim)
    assert notes["comm_overhead_s"] == pytest.approx(overhead, rel=1e-3)
    assert notes["compute_s"] == pytest.approx(_compute_s(prof, "keep"), rel=1e-3)


def test_world_one_and_one_gpu_are_untouched_by_the_overheads():
    prof = _profile()
    heavy = Overheads(hbm_Bps_fraction=1e-6, contention=0.9, latency_s=1.0)
    assert _shard(prof, 1, (P,), overheads=heavy) is prof
    sim = simulate(prof, "full")
    assert sim.step_s == _compute_s(prof, "full")  # exactly: nothing added on one GPU
    assert sim.comm_copy_s == sim.comm_launch_s == sim.comm_contention_s == 0.0
    assert all(p.overhead_s == 0.0 for p in sim.timeline)
    assert all(s["overhead_s"] == 0.0 for s in sim.stages().values())


def test_default_overheads_are_the_named_constants():
    from remat.planning import sharding
    assert FSDP2_OVERHEADS == Overheads(hbm_Bps_fraction=sharding.HBM_BPS_FRACTION,
                                        contention=sharding.CONTENTION, latency_s=sharding.LATENCY_S)
    prof = _shard(_profile(), 2, (P,))
    assert prof.comm.contention == sharding.CONTENTION and prof.comm.latency_s == sharding.LATENCY_S
    assert prof.comm.copy_Bps == pytest.approx(sharding.HBM_BPS_FRACTION * prof.rates.hbm_Bps)


def test_fit_recovers_the_constants():
    fitted = Overheads.fit(copy_bytes=8e9, copy_s=4e-3, hbm_Bps=2.5e12, overlapped_s=0.1, slowdown_s=0.03,
                           collectives=100, host_s=4e-3)
    assert fitted.hbm_Bps_fraction == pytest.approx(0.8) and fitted.contention == pytest.approx(0.3)
    assert fitted.latency_s == pytest.approx(40e-6)
    with pytest.raises(ValueError, match="positive"):
        Overheads.fit(copy_bytes=0, copy_s=1, hbm_Bps=1, overlapped_s=1, slowdown_s=0, collectives=1, host_s=0)


def test_the_solver_stays_under_budget_with_the_overheads():
    """The overheads change time, not memory: every plan the solver returns simulates within its budget,
    and its time is the simulator's (blocks resharded: the DP's additive time is exact)."""
    import remat
    import torch
    from remat.presets import build_model, load_config
    from remat.planning.solver import NoPlanFits, plan_seconds
    from remat.profiling.profiler import block_param_bytes, profile
    model = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)
    prof = _shard(profile(model, torch.zeros(2, 256, dtype=torch.long), gpu="h100"), 4,
                  block_param_bytes(model, profile(model, torch.zeros(2, 256, dtype=torch.long), gpu="h100")),
                  overheads=Overheads(hbm_Bps_fraction=0.01, contention=0.5, latency_s=1e-3))
    low = remat.simulate(prof, "full", head="plain").peak_bytes
    high = remat.simulate(prof, "keep", head="plain").peak_bytes
    for budget in (low, (low + high) // 2, high):
        try:
            plan = remat.solve(prof, budget, heads=["plain"])
        except NoPlanFits:
            continue
        sim = remat.simulate(prof, plan)
        assert sim.bound_bytes <= budget and sim.comm_copy_s > 0 and sim.comm_launch_s > 0
        assert plan.notes["comm_overhead_s"] > 0
        assert plan_seconds(prof, list(plan.blocks.values()), prof.head("plain")) == pytest.approx(sim.step_s, rel=1e-6)


@pytest.mark.parametrize("reduce_dtype, factor", [(None, 1), ("float32", 2)])
def test_reduce_scatter_buffers_in_flight_raise_every_backward_peak(reduce_dtype, factor):
    """Two blocks' gradients (reduce dtype) in FSDP2's copy-in buffers during each block's and the
    embeddings' backward; nothing before the backward changes."""
    prof = _profile()
    sharded = shard(prof, 2, (P,), reduce_dtype=reduce_dtype)
    for t in ("keep", "full"):
        assert sharded.cost(0, t).bwd_peak == prof.cost(0, t).bwd_peak + 2 * P * factor
        assert sharded.cost(0, t).fwd_peak == prof.cost(0, t).fwd_peak
    assert sharded.heads[0].pre_bwd_peak == prof.heads[0].pre_bwd_peak + 2 * P * factor
    assert sharded.heads[0].head_fwd_peak == prof.heads[0].head_fwd_peak
    phase = next(p for p in simulate(sharded, "full").timeline if p.name.startswith("backward of block 0"))
    unbuffered = dataclasses.replace(sharded, classes=({t: dataclasses.replace(c, bwd_peak=c.bwd_peak - 2 * P * factor)
                                                        for t, c in sharded.classes[0].items()},))
    before = next(p for p in simulate(unbuffered, "full").timeline if p.name.startswith("backward of block 0"))
    assert phase.peak_bytes - before.peak_bytes == 2 * P * factor
