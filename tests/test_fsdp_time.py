"""FSDP2's collectives in the time model: hand-computed exposure, resharding, dtypes, world 1.

A three-block profile with round numbers: at world 2 and a bus of 1 GB/s a collective of ``B``
bytes takes ``B / 2 / 1e9`` s, so each block's all-gather and bf16 reduce-scatter (4 MB) takes
2 ms and the root's (2 MB) 1 ms. Compute: embeddings 0.5 ms each way, blocks 3 ms forward and
6 ms backward (``keep``) or 9 ms (``full``: the recompute), head 4 ms forward and 1 ms backward.
"""
import dataclasses
import json

import pytest

from remat.planning.costs import BlockCost, Collectives, HeadCost, Profile, rates_for
from remat.planning.sharding import comm_notes, shard
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


def _compute_s(prof, treatment):
    h, c = prof.heads[0], prof.cost(0, treatment)
    return h.pre_fwd_s + h.head_fwd_s + h.head_bwd_s + h.pre_bwd_s + BLOCKS * (c.fwd_s + c.bwd_s)


def test_world_one_is_the_single_gpu_profile_and_step():
    prof = _profile()
    assert shard(prof, 1, (P,)) is prof and prof.comm is None
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
    assert kept.static_bytes == resharded.static_bytes - P  # one block in flight, not two
    assert kept.cost(0, "keep").kept == resharded.cost(0, "keep").kept + P
    # the head sees every block unsharded: two more blocks than resharded (one less in flight)
    def head_peak(s):
        return next(p.peak_bytes for p in s.timeline if p.name == "backward: head and loss")
    assert head_peak(sim) - head_peak(simulate(resharded, "keep")) == (BLOCKS - 1) * P


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


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("bwd_keep", [1 * MS, 3 * MS, 6 * MS])
def test_additive_exposure_equals_the_simulation(reshard, bwd_keep):
    """Collectives.block_exposed_s (what a solver adds per block) and fixed_exposed_s sum to the
    simulator's exposed communication for every mix of treatments when blocks are resharded (each
    backward waits for a gather queued behind the reduce-scatter before it); without resharding
    nothing waits in backward, a reduce-scatter's excess can still hide behind the next block, and
    the sum is an upper bound."""
    prof = shard(_profile(bwd_keep), 2, (P,), reshard_after_forward=reshard, reduce_dtype="float32")
    for plan in (["keep"] * 3, ["full"] * 3, ["keep", "full", "keep"], ["full", "keep", "keep"]):
        costs = [prof.cost(i, t) for i, t in enumerate(plan)]
        additive = prof.comm.fixed_exposed_s(prof.heads[0]) + sum(
            prof.comm.block_exposed_s(i, c.fwd_s, c.bwd_s) for i, c in enumerate(costs))
        simulated = simulate(prof, plan).exposed_comm_s
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
    assert notes["predicted_step_s"] == pytest.approx(notes["compute_s"] + notes["exposed_comm_s"], abs=2e-5)
    assert main(argv) == 0
    stages = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("stages"))
    assert "exposed communication" in stages, stages


def test_bus_rate_needs_a_process_group():
    """The all-gather timing is a collective on a live NCCL group; without one it measures nothing."""
    from remat.profiling._calibrate import bus_rate
    assert bus_rate() is None


def test_every_gpu_has_a_bus_rate():
    from remat.planning.costs import GPUS
    assert all(rates_for(name).bus_Bps == GPUS[name]["bus_GBps"] * 1e9 > 0 for name in GPUS)


def test_the_solver_minimises_the_step_with_exposed_communication():
    """Under FSDP2 the DP's objective is the simulator's step (compute + exposed collectives),
    and a plan's notes carry the collectives."""
    import remat
    from remat.integrations.presets import build_model, load_config
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
