"""DDP in the plan: the reducer's buckets in memory, bucketed all-reduces in the time model,
``remat.plan(..., ddp_world=N)`` and ``remat plan --ddp N``.

The hand-made profile: three blocks whose gradients are ``G_BLOCK`` = 4 MiB each, root gradients
(embeddings, norm, LM head) ``ROOT`` = 2 MiB, bf16; a bus of 1 GB/s. Compute: embeddings 0.5 ms
each way, blocks 3 ms forward and 6 ms backward, head 4 ms forward and 1 ms backward.
"""
import dataclasses
import json
import math

import pytest

from remat.planning.costs import BlockCost, HeadCost, Profile, rates_for
from remat.planning.replication import FIRST_BUCKET_BYTES, replicate
from remat.planning.sharding import NO_OVERHEADS, Overheads, comm_notes
from remat.planning.simulator import simulate

MS = 1e-3
MIB = 1024 * 1024
G_BLOCK = 4 * MIB
ROOT = 2 * MIB
BLOCKS = 3
HIDDEN = 1024
GRADS = BLOCKS * G_BLOCK + ROOT


def _profile() -> Profile:
    cost = BlockCost(fwd_peak=1100, kept=1000, out_alive=10, out_bytes=HIDDEN, saves_input=True,
                     bwd_peak=G_BLOCK + 2000, bwd_end=G_BLOCK + HIDDEN, fwd_s=3 * MS, bwd_s=6 * MS)
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=10, pre_end=10, head_fwd_peak=500,
                    head_fwd_end=50, head_bwd_peak=600, head_bwd_end=10, pre_bwd_peak=20, pre_bwd_end=10,
                    pre_fwd_s=0.5 * MS, head_fwd_s=4 * MS, head_bwd_s=1 * MS, pre_bwd_s=0.5 * MS)
    return Profile(model="m", block_names=tuple(f"layers.{i}" for i in range(BLOCKS)), block_class=(0,) * BLOCKS,
                   classes=({"keep": cost, "full": dataclasses.replace(cost, kept=20, bwd_s=9 * MS)},), heads=(head,),
                   param_bytes=GRADS, buffer_bytes=0, optimizer="none", optimizer_bytes=0, static_bytes=GRADS,
                   hidden_bytes=HIDDEN, batch=1, seq=8, dtype="bfloat16", device="fake",
                   rates=dataclasses.replace(rates_for("h100"), bus_Bps=1e9))


def _compute_s(prof, treatment="keep"):
    h, c = prof.heads[0], prof.cost(0, treatment)
    return h.pre_fwd_s + h.head_fwd_s + h.head_bwd_s + h.pre_bwd_s + BLOCKS * (c.fwd_s + c.bwd_s)


def test_world_one_is_the_single_gpu_profile():
    prof = _profile()
    assert replicate(prof, 1) is prof
    with pytest.raises(ValueError, match="positive integer"):
        replicate(prof, 0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        replicate(prof, 2, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="class_grad_bytes"):
        replicate(prof, 2, class_grad_bytes=(1, 2))


def test_buckets_add_the_gradient_bytes_unless_the_gradients_are_their_views():
    """DDP's reducer allocates its buckets (every trainable gradient's bytes) when it is built, whatever
    gradient_as_bucket_view says. Without views, autograd's gradients exist beside them: every phase
    is G higher than one GPU. With views, a block's gradients live in the buckets only: after the
    blocks' backward the step holds 3 blocks' gradients less (the root's stay counted twice, in the
    buckets and in the head's measured bytes: conservative)."""
    base = _profile()
    copy, view = replicate(base, 2), replicate(base, 2, gradient_as_bucket_view=True)
    assert copy.static_bytes == base.static_bytes + GRADS == view.static_bytes
    assert copy.cost(0, "keep") == base.cost(0, "keep")
    assert view.cost(0, "keep").bwd_end == base.cost(0, "keep").bwd_end - G_BLOCK
    one, c, v = (simulate(p, "keep") for p in (base, copy, view))
    assert [p.peak_bytes - q.peak_bytes for p, q in zip(c.timeline, one.timeline)
            if not p.name.startswith("backward: all-reduces") and "copied out" not in p.name] == \
        [GRADS] * len(one.timeline)
    end = {s: next(p.end_bytes for p in s.timeline if p.name == "backward: embeddings") for s in (one, c, v)}
    assert end[c] - end[v] == BLOCKS * G_BLOCK
    assert end[v] - end[one] == ROOT          # the view run adds only the root's gradients, counted twice
    assert c.peak_bytes == one.peak_bytes + GRADS and v.peak_bytes <= c.peak_bytes


def test_default_gradient_bytes_come_from_the_profile():
    """Without the model: a block's gradients are what a keep block leaves less its input's gradient,
    the model's every parameter's bytes (all trainable)."""
    prof = replicate(_profile(), 2, overheads=NO_OVERHEADS)
    assert sum(prof.comm.reduce_bytes) + prof.comm.root_reduce_bytes == GRADS
    frozen = replicate(_profile(), 2, class_grad_bytes=(0,), grad_bytes=ROOT, overheads=NO_OVERHEADS)
    assert frozen.static_bytes == _profile().static_bytes + ROOT and sum(frozen.comm.reduce_bytes) == 0


def test_bucket_cuts_follow_ddp():
    """bucket_cap_mb=None (DDP's default): a first bucket of 1 MiB, then 25 MiB ones; a cap given
    explicitly is the first bucket's too (torch 2.13's _BucketCapacityConfig). Gradients stream in
    backward order (block 2 first), so the first 1 MiB bucket fills a quarter into block 2's backward."""
    prof = replicate(_profile(), 2, overheads=NO_OVERHEADS)
    c = prof.comm
    assert c.buckets[2][0] == (pytest.approx(FIRST_BUCKET_BYTES / G_BLOCK), FIRST_BUCKET_BYTES)
    assert sum(len(b) for b in c.buckets) + c.root_bwd_launches == 2   # 1 MiB, then the 13 MiB rest
    explicit = replicate(_profile(), 2, bucket_cap_mb=1, overheads=NO_OVERHEADS).comm
    assert sum(len(b) for b in explicit.buckets) + explicit.root_bwd_launches == GRADS // MIB
    assert all(nbytes == MIB for block in explicit.buckets for _, nbytes in block)
    assert [len(b) for b in explicit.buckets] == [4, 4, 4] and explicit.root_bwd_launches == 2
    big = replicate(dataclasses.replace(_profile(), param_bytes=200 * MIB), 2, grad_bytes=200 * MIB).comm
    count = sum(len(b) for b in big.buckets) + big.root_bwd_launches
    assert count == 1 + math.ceil((200 * MIB - FIRST_BUCKET_BYTES) / (25 * MIB))
    assert sum(big.reduce_bytes) + big.root_reduce_bytes == 200 * MIB


@pytest.mark.parametrize("world", [2, 4, 8])
def test_allreduce_seconds_scale_as_two_n_minus_one_over_n(world):
    """A ring all-reduce moves 2 (n - 1) / n of the bytes over each link: twice a reduce-scatter's."""
    prof = replicate(_profile(), world, overheads=NO_OVERHEADS)
    expected = 2 * (world - 1) / world * GRADS / 1e9
    assert prof.comm.total_s() == pytest.approx(expected)
    assert simulate(prof, "keep").comm_s == pytest.approx(expected)
    assert prof.comm.reduce_s(GRADS) == pytest.approx(2 * prof.comm.seconds(GRADS))


def test_last_buckets_are_exposed_hand_computed():
    """World 2 at 1 GB/s: an all-reduce of B bytes takes B / 1e9 s. Default buckets: the first 1 MiB
    fills 1.5 ms into block 2's backward and hides; the 13 MiB rest fills after the embeddings'
    backward (the root's gradients come last) and is exposed in full: 13.63 ms."""
    prof = replicate(_profile(), 2, overheads=NO_OVERHEADS)
    sim = simulate(prof, "keep")
    rest = GRADS - FIRST_BUCKET_BYTES
    assert sim.exposed_comm_s == pytest.approx(rest / 1e9)
    assert sim.step_s == pytest.approx(_compute_s(prof) + rest / 1e9)
    last = sim.timeline[-1]
    assert last.name == "backward: all-reduces left at the end" and last.comm_s == pytest.approx(rest / 1e9)
    # 1 MiB buckets: four fill in each block's backward, at a quarter, half, three quarters and its end;
    # block 0's last (1.05 ms) runs beside the embeddings' backward (0.5 ms), then the root's 2 MiB
    small = simulate(replicate(_profile(), 2, bucket_cap_mb=1, overheads=NO_OVERHEADS), "keep")
    assert small.exposed_comm_s == pytest.approx(MIB / 1e9 - 0.5 * MS + ROOT / 1e9)
    notes = comm_notes(prof, sim)
    assert notes["ddp_world"] == 2 and notes["allreduce_buckets"] == 2 and "fsdp_world" not in notes


def test_ddp_overheads_copies_launches_and_the_copy_back():
    """Copies at 1 GB/s: each gradient into its bucket (read + write, 2 x 14 MiB), and without views
    every reduced bucket back into the gradients once the last all-reduce ends (2 x 14 MiB more);
    one launch per bucket."""
    fraction = 1e9 / rates_for("h100").hbm_Bps
    overheads = Overheads(hbm_Bps_fraction=fraction, contention=0.0, latency_s=0.1 * MS)
    copy = simulate(replicate(_profile(), 2, overheads=overheads), "keep")
    view = simulate(replicate(_profile(), 2, overheads=overheads, gradient_as_bucket_view=True), "keep")
    assert copy.comm_copy_s == pytest.approx(4 * GRADS / 1e9) and view.comm_copy_s == pytest.approx(2 * GRADS / 1e9)
    assert copy.comm_launch_s == pytest.approx(2 * 0.1 * MS)
    assert copy.timeline[-1].name == "backward: gradients copied out of the buckets"
    assert copy.timeline[-1].overhead_s == pytest.approx(2 * GRADS / 1e9)
    stages = copy.stages()
    assert sum(s["overhead_s"] for s in stages.values()) == pytest.approx(copy.comm_copy_s + copy.comm_launch_s)


@pytest.mark.parametrize("bus", [1e11, 1e9, 3e8, 1e8])
def test_the_solvers_additive_time_bounds_the_simulation(bus):
    """The DP charges each block the all-reduces of the buckets that fill in it, beside it from when
    the first fills, as if the others followed at once, and nothing waits for them before the end:
    an estimate, within 2% of the simulation with 8 buckets a block (the link idles between buckets
    that fill slower than it drains them; when it falls behind, its backlog slows later blocks too)."""
    from remat.planning.solver import plan_seconds
    prof = replicate(_profile(), 4, bucket_cap_mb=0.5, bus_Bps=bus,
                     overheads=Overheads(hbm_Bps_fraction=1e-3, contention=0.3, latency_s=0.05 * MS))
    for plan in (["keep"] * 3, ["full"] * 3, ["keep", "full", "keep"]):
        simulated = simulate(prof, plan).step_s
        additive = plan_seconds(prof, plan, prof.heads[0])
        assert additive == pytest.approx(simulated, rel=0.02), plan


def _tiny():
    import torch
    from remat.presets import build_model, load_config
    torch.manual_seed(0)
    model = build_model(load_config("llama-tiny"), device="cpu", dtype=torch.float32)
    return model, torch.randint(0, model.config.vocab_size, (2, 64))


def test_plan_ddp_world_on_a_tiny_llama_is_under_budget():
    import remat
    from remat.planner import trainable_grad_bytes
    from remat.profiling.profiler import profile
    model, ids = _tiny()
    prof = profile(model, ids, gpu="h100")
    _, grads = trainable_grad_bytes(model, prof)
    assert grads == sum(p.numel() * p.element_size() for p in model.parameters())
    single = remat.plan(model, ids, 10 ** 12, profiled=prof)
    ddp_top = remat.plan(model, ids, 10 ** 12, profiled=prof, ddp_world=2)
    assert ddp_top.notes["predicted_peak_bytes"] >= single.notes["predicted_peak_bytes"] + grads
    try:
        remat.plan(model, ids, 1, profiled=prof, ddp_world=2)
        raise AssertionError("a 1-byte budget fits nothing")
    except remat.NoPlanFits as e:
        low = e.smallest_peak
    budget = (low + ddp_top.notes["predicted_peak_bytes"]) // 2
    plan = remat.plan(model, ids, budget, profiled=prof, ddp_world=2)
    notes = plan.notes
    assert notes["predicted_peak_bytes"] <= budget and notes["ddp_world"] == 2
    assert notes["comm_s"] > 0 and 0 < notes["exposed_comm_s"] <= notes["comm_s"] and notes["comm_overhead_s"] > 0
    assert notes["predicted_step_s"] == pytest.approx(
        notes["compute_s"] + notes["exposed_comm_s"] + notes["comm_overhead_s"], abs=2e-5)
    remat.apply(model, plan)   # a plan for DDP is applied like any other (before wrapping in DDP)
    remat.remove(model)


def test_frozen_parameters_are_not_bucketed():
    """LoRA-style: only trainable parameters have gradients, so DDP buckets only those."""
    from remat.planner import trainable_grad_bytes
    from remat.profiling.profiler import profile
    model, ids = _tiny()
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    prof = profile(model, ids, gpu="h100")
    per_class, total = trainable_grad_bytes(model, prof)
    mlp = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "mlp" in n)
    assert total == mlp and per_class[0] * len(prof.block_names) == mlp
    assert replicate(prof, 2, class_grad_bytes=per_class, grad_bytes=total).static_bytes == prof.static_bytes + mlp


def test_fsdp_and_ddp_are_mutually_exclusive():
    import remat
    model, ids = _tiny()
    with pytest.raises(ValueError, match="not both"):
        remat.plan(model, ids, "1GiB", fsdp_world=2, ddp_world=2)
    from remat.cli import main
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "64MiB"]
    assert main(argv + ["--fsdp", "2", "--ddp", "2"]) != 0
    assert main(argv + ["--ddp", "0"]) != 0


def test_remat_plan_ddp_cli(capsys):
    from remat.cli import main
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "64MiB", "--ddp", "4"]
    assert main(argv + ["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes["ddp_world"] == 4 and notes["allreduce_buckets"] >= 1 and notes["exposed_comm_s"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exposed communication" in out


def test_buckets_close_at_parameter_ends_in_backward_order():
    """With the parameters' stream, a bucket takes whole parameters until it reaches its cap (the
    first 1 MiB) and is all-reduced when its last parameter's gradient exists: a block's at the end
    of its backward, the head's at the start of the last block's, the embeddings' after them all."""
    stream = (("head", 3 * MIB),                                        # bucket 1 (1 MiB cap): ready before block 2
              (2, MIB), (2, 3 * MIB),                                   # 1 + 3 < 25 MiB: still open
              (1, 30 * MIB),                                            # 34 MiB: closes in block 1
              (0, 2 * MIB), ("embeddings", 24 * MIB))                   # 26 MiB: closes after the embeddings
    prof = _profile()
    r = replicate(prof, 2, class_grad_bytes=(G_BLOCK,), grad_bytes=GRADS, stream=stream)
    assert r.comm.buckets == ((), ((1.0, 34 * MIB),), ((0.0, 3 * MIB),))
    assert r.comm.root_reduce_bytes == 26 * MIB and r.comm.root_bwd_launches == 1
    assert comm_notes(r, simulate(r, "keep"))["allreduce_buckets"] == 3
    last = replicate(prof, 2, stream=((1, 2 * MIB), (0, MIB), (0, MIB)), class_grad_bytes=(G_BLOCK,),
                     grad_bytes=GRADS)  # the last bucket, 2 MiB of its 25, closes with the last parameter
    assert last.comm.buckets == (((1.0, 2 * MIB),), ((1.0, 2 * MIB),), ()) and last.comm.root_reduce_bytes == 0


def test_plan_cuts_ddp_buckets_at_the_models_parameters():
    """remat.plan(..., ddp_world=2) on a tiny llama: the bucket count is what DDP's rebuilt buckets
    give for its parameters (computed here from the parameters themselves, in backward order)."""
    import torch
    import remat
    from remat.presets import build_model, load_config
    from remat.planner import gradient_stream
    config = load_config("llama-tiny")
    model = build_model(config, device=torch.device("cpu"), dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    prof = remat.profile(model, ids, device="fake")
    stream = gradient_stream(model, prof)
    assert sum(b for _, b in stream) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert stream[-1][0] == "embeddings" and {o for o, _ in stream} - {"head", "embeddings"} == set(range(len(prof.block_names)))
    expected, size, limit = 0, 0, FIRST_BUCKET_BYTES
    for index, (_, nbytes) in enumerate(stream):
        size += nbytes
        if size >= limit or index + 1 == len(stream):
            expected, size, limit = expected + 1, 0, 25 * MIB
    plan = remat.plan(model, ids, "4GiB", ddp_world=2, profiled=prof)
    assert plan.notes["allreduce_buckets"] == expected
