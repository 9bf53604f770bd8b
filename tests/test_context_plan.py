"""Planning one rank of a cp x fsdp mesh (issue 32), and the optimizer's step in the step time.

Fake-tensor profiles of llama-tiny at H100 rates: no process group, no GPU. What the time and
memory model charges for context parallelism is :mod:`remat.planning.context`'s; these tests check
that it is charged where it should be (the piece profiled, the attention over the rest added,
the exchange repeated by treatments that recompute attention), not its constants, which the GPU
bench (benchmarks/cp_bench.py) measures.
"""
from dataclasses import replace

import pytest
import torch

import remat
from remat.cli import main
from remat.presets import build_model, load_config
from remat.planning.context import RECOMPUTES_ATTENTION, AttentionShape, charges, context
from remat.planning.costs import OPTIMIZER_HBM_FRACTION, OPTIMIZER_LAUNCH_S, OPTIMIZER_LAUNCHES
from remat.planning.simulator import simulate

SEQ = 256


@pytest.fixture(scope="module")
def model():
    return build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def piece(model):
    """The profile of one of two CP ranks' pieces: 128 of 256 tokens."""
    return remat.profile(model, torch.zeros(2, SEQ // 2, dtype=torch.long), gpu="h100", optimizer="adamw")


@pytest.fixture(scope="module")
def long_piece(model):
    """A share long enough for attention to outweigh the exchange it hides (8,192 tokens)."""
    return remat.profile(model, torch.zeros(1, 8192, dtype=torch.long), gpu="h100", optimizer="adamw")


def _shape(model):
    from remat.planner import attention_shape
    return attention_shape(model)


def test_attention_shape_is_read_from_the_config(model):
    assert _shape(model) == AttentionShape(heads=4, kv_heads=2, head_dim=16)


def test_context_charges_each_block_and_the_recompute_again(model, piece):
    shape = _shape(model)
    cp = context(piece, 2, shape)
    charge = charges(piece, 2, shape)
    assert charge["fwd_s"] > 0 and charge["bwd_s"] > charge["fwd_s"] and charge["bwd_bytes"] > 0 and charge["fwd_bytes"] > 0
    for treatment, before in piece.classes[0].items():
        after = cp.classes[0][treatment]
        again = charge["fwd_s"] if treatment in RECOMPUTES_ATTENTION else 0.0
        assert after.fwd_s == pytest.approx(before.fwd_s + charge["fwd_s"]), treatment
        assert after.bwd_s == pytest.approx(before.bwd_s + charge["bwd_s"] + again), treatment
        assert after.fwd_peak == before.fwd_peak + charge["fwd_bytes"]
        # a recompute runs the ring's forward (its merge) inside the backward phase
        transient = max(charge["fwd_bytes"], charge["bwd_bytes"]) if again else charge["bwd_bytes"]
        assert after.bwd_peak == before.bwd_peak + transient, treatment
        assert after.kept == before.kept and after.bwd_end == before.bwd_end  # transient: nothing more is kept
    assert {"full", "attention", "full+tiled"} <= RECOMPUTES_ATTENTION
    assert not {"keep", "mlp", "selective", "offload", "tiled"} & RECOMPUTES_ATTENTION
    assert context(piece, 1, shape) is piece
    assert cp.notes["cp_world"] == 2 and cp.notes["cp_seq"] == SEQ


def test_the_ring_merge_of_a_recompute_is_in_the_backward_phase(piece):
    """Under GQA (8B: 32 query heads, 8 key/value) torch's forward merge holds more than its
    backward: a block that recomputes attention peaks at the merge in its backward phase (2 x H100,
    262,144 tokens: 3.7 GiB over a plan that charged only the backward's)."""
    shape = AttentionShape(heads=32, kv_heads=8, head_dim=128)
    charge = charges(piece, 2, shape)
    q = piece.batch * piece.seq * 32 * 128 * 2
    # K/V gathered (2 x q/2), their concatenation (q/2), the merge (8q); the backward's 8q: 2 x q/2
    # gathered, fp32 gradients of q (2q) and of K/V three times (3q), the step before's outputs (1.5q), the
    # concatenation (q/2)
    assert charge["fwd_bytes"] == 2 * q // 2 + q // 2 + 8 * q > charge["bwd_bytes"] == 8 * q
    cp = context(piece, 2, shape)
    for treatment in ("full", "full+offload"):
        assert cp.classes[0][treatment].bwd_peak == piece.classes[0][treatment].bwd_peak + charge["fwd_bytes"]
    assert cp.classes[0]["keep"].bwd_peak == piece.classes[0]["keep"].bwd_peak + charge["bwd_bytes"]


def test_the_last_rank_works_more_as_the_group_grows(model, piece):
    """Contiguous pieces: the last of W ranks attends to W - 1 pieces beyond its own, and the
    gathered keys and values grow with W."""
    shape = _shape(model)
    two, four = charges(piece, 2, shape, balance=False), charges(piece, 4, shape, balance=False)
    assert (two["blocks"], four["blocks"]) == (1, 3)
    assert four["compute_s"] == pytest.approx(3 * two["compute_s"])
    assert four["fwd_bytes"] > two["fwd_bytes"] and four["exchange_bytes"] > two["exchange_bytes"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_balanced_rank_attends_to_an_equal_share(model, piece, long_piece, world):
    """Head-tail chunks (the default): every rank attends to W / 2 of the sequence's W^2 / 2 causal
    s x s blocks, (W - 1) / 2 beyond the half block of its own the profile holds; the contiguous
    last rank to W - 1/2 of them (1.75x at CP 4). The same bytes move either way; only the compute
    and what it hides differ."""
    shape = _shape(model)
    balanced, last = charges(piece, world, shape), charges(piece, world, shape, balance=False)
    assert balanced["blocks"] == pytest.approx((world - 1) / 2) and last["blocks"] == world - 1
    assert (last["blocks"] + 0.5) / (balanced["blocks"] + 0.5) == pytest.approx(2 - 1 / world)  # 1.75 at CP 4
    assert balanced["compute_s"] == pytest.approx(last["compute_s"] / 2)
    for key in ("fwd_bytes", "bwd_bytes", "exchange_bytes"):
        assert balanced[key] == last[key], key
    assert balanced["fwd_s"] <= last["fwd_s"] and balanced["bwd_s"] <= last["bwd_s"] * (1 + 1e-12)   # at 128 tokens the
    # exchange, not attention, sets the backward: what compute no longer hides is waited for instead
    balanced, last = charges(long_piece, world, shape), charges(long_piece, world, shape, balance=False)
    assert balanced["fwd_s"] < last["fwd_s"] and balanced["bwd_s"] < last["bwd_s"]
    cp, contiguous = context(long_piece, world, shape), context(long_piece, world, shape, balance=False)
    assert cp.notes["cp_balance"] is True and contiguous.notes["cp_balance"] is False
    assert cp.notes["cp_attention_s"] < contiguous.notes["cp_attention_s"]
    keep, keep_last = cp.classes[0]["keep"], contiguous.classes[0]["keep"]
    assert keep.fwd_s < keep_last.fwd_s and keep.fwd_peak == keep_last.fwd_peak


def test_plan_profiles_the_piece_and_notes_the_mesh(model):
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    plan = remat.plan(model, ids, "1GiB", cp_world=2, fsdp_world=2, optimizer="adamw", gpu="h100")
    n = plan.notes
    assert n["seq"] == SEQ // 2 and n["batch"] == 2 and n["cp_world"] == 2 and n["cp_seq"] == SEQ, n
    assert n["fsdp_world"] == 2 and n["cp_exchange_bytes"] > 0 and n["cp_exposed_s"] > 0, n
    assert n["cp_balance"] is True, n
    # the smallest peak: a rank of a 2-way split holds about half the activations of one process
    whole = remat.plan(model, ids, "1GiB", fsdp_world=2, optimizer="adamw", gpu="h100").notes
    assert n["predicted_peak_bytes"] < whole["predicted_peak_bytes"]


def test_plan_charges_the_layout_it_is_told(model, long_piece):
    """``cp_balance=False`` (contiguous pieces) plans for the last rank, whose step is longer (one
    profile of a rank's 8,192 tokens serves both); a sequence that divides into CP pieces but not
    into head-tail chunks is planned only contiguous."""
    ids = torch.zeros(1, 4 * 8192, dtype=torch.long)
    kwargs = dict(cp_world=4, optimizer="adamw", gpu="h100", profiled=long_piece)
    balanced = remat.plan(model, ids, "4GiB", **kwargs).notes
    contiguous = remat.plan(model, ids, "4GiB", cp_balance=False, **kwargs).notes
    assert balanced["cp_balance"] is True and contiguous["cp_balance"] is False
    assert contiguous["predicted_step_s"] > balanced["predicted_step_s"]
    odd = torch.zeros(2, 36, dtype=torch.long)   # 4 pieces of 9, not 8 chunks
    kwargs = dict(cp_world=4, gpu="h100", treatments=["keep"], heads=["plain"])
    with pytest.raises(ValueError, match="36 tokens cannot be split evenly over 4 .* balanced .*multiple of 8"):
        remat.plan(model, odd, "1GiB", **kwargs)
    assert remat.plan(model, odd, "1GiB", cp_balance=False, **kwargs).notes["seq"] == 9


@pytest.mark.parametrize("kwargs, words", [
    (dict(cp_world=0), "cp_world must be a whole number >= 1"),
    (dict(cp_world=True), "cp_world must be a whole number >= 1"),
    (dict(cp_world=3), "256 tokens cannot be split evenly over 3"),
    (dict(cp_world=2, ddp_world=2), "not modelled"),
])
def test_bad_cp_arguments_are_refused_before_profiling(model, kwargs, words):
    with pytest.raises(ValueError, match=words):
        remat.plan(model, torch.zeros(2, SEQ, dtype=torch.long), "1GiB", **kwargs)


def test_a_model_cp_cannot_run_is_refused_before_profiling():
    eager = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        remat.plan(eager, torch.zeros(2, SEQ, dtype=torch.long), "1GiB", cp_world=2)


def test_the_optimizer_step_is_in_the_step(model, piece):
    """AdamW (foreach): 20 element sizes read or written per trainable parameter, over HBM bandwidth;
    1/world of them under FSDP2; nothing without an optimizer."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = 20 * trainable / (piece.rates.hbm_Bps * OPTIMIZER_HBM_FRACTION) + OPTIMIZER_LAUNCHES["adamw"] * \
        OPTIMIZER_LAUNCH_S
    assert piece.optimizer_s == pytest.approx(expected)
    plan = remat.solve(piece, "1GiB")
    with_step, without = simulate(piece, plan), simulate(replace(piece, optimizer_s=0.0), plan)
    assert with_step.step_s - without.step_s == pytest.approx(piece.optimizer_s)
    assert plan.notes["predicted_optimizer_s"] == pytest.approx(piece.optimizer_s, abs=1e-5)
    from remat.planning.sharding import shard
    from remat.profiling.profiler import block_param_bytes
    assert shard(piece, 4, block_param_bytes(model, piece)).optimizer_s == pytest.approx(piece.optimizer_s / 4)
    none = remat.profile(model, torch.zeros(2, 64, dtype=torch.long), gpu="h100")
    assert none.optimizer_s == 0 and "predicted_optimizer_s" not in remat.solve(none, "1GiB").notes


def test_cli_plans_a_cp_rank(capsys):
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", str(SEQ), "--budget", "1GiB",
                 "--optimizer", "adamw", "--cp", "2", "--fsdp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"context    2 ranks split each {SEQ}-token sequence: {SEQ // 2} tokens of activations a rank; each rank " \
        "(head-tail chunks) attends" in out
    assert "tokens/s per GPU" in out and "the optimizer's step" in out
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", str(SEQ + 2), "--budget", "1GiB",
                 "--cp", "2", "--cp-contiguous"]) == 0
    assert "the last rank (contiguous pieces) attends" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--cp", "3"], f"--seq {SEQ} cannot be split evenly over --cp 3 ranks"),
    (["--cp", "3", "--cp-contiguous"], f"--seq {SEQ} cannot be split evenly over --cp 3 ranks: pass a multiple of 3"),
    (["--cp", "4"] if SEQ % 8 else ["--cp", "5"], "as a head and a tail chunk each"),
    (["--cp", "0"], "--cp must be a whole number >= 1"),
    (["--cp", "2", "--ddp", "2"], "not modelled"),
])
def test_cli_refuses_bad_cp_in_one_line(capsys, argv, words):
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", str(SEQ), "--budget", "1GiB", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("remat plan: error: ")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
