"""The ``attn-saved`` treatments: a block recomputed whole except its attention kernel, whose
output is kept (remat.treat.selective's attention policy).

Exactness on models as users load them (config defaults, dropout on), fp32 on the CPU: loss and
every gradient within 1e-6 relative of an untouched copy, offloading on the CPU's inline engine
(:mod:`oracle`). The mechanism, so that a treatment that silently did nothing (or silently ran as
``full``) fails: the oracle's (more ops, fewer bytes saved, bytes moved), and the attention kernel
runs as often as in the untouched model while the rest of the block is recomputed. An attention kernel called with dropout is recomputed instead (its forward draws from
the generator; see :func:`remat.treat.selective._drops_out`). The planner takes it where attention
dominates a recompute: at long context.
"""
import copy

import pytest
import torch

import oracle
import remat
import zoo
# private (_drops_out): on the CPU an attention with dropout takes torch's math path, no kernel to keep;
# only the GPU test below shows the rule through a model
from remat.treat.selective import _drops_out, saves, saves_attention

SPECS = ("attn-saved", "attn-saved+offload", "every:2:attn-saved")
MODELS = ("llama", "qwen3", "gpt2", "gemma2", "mixtral")


def _kernel_calls(count) -> int:
    return sum(n for op, n in count.items() if saves_attention(op))


def _matmuls(count) -> int:
    return sum(n for op, n in count.items() if op.name() == "aten::mm")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", MODELS)
def test_attn_saved_matches_the_untouched_model(name, spec):
    model = zoo.build(name)
    reference = copy.deepcopy(model)
    remat.apply(model, spec, offload_options=zoo.INLINE_OFFLOAD)
    case = zoo.CASES[name]
    result = oracle.check(model, reference, case.batch(reference), case.loss, rtol=oracle.FP32_REORDERED)
    # (zoo models whose attention takes torch's math path run no kernel: the next test has one)
    assert _kernel_calls(result.treated.ops_by_op) == _kernel_calls(result.reference.ops_by_op), \
        "the attention kernel ran again in the recompute"


def test_the_kernel_is_kept_where_full_runs_it_twice():
    """Llama on the CPU runs SDPA's flash kernel: ``full`` runs it in the forward and again in the
    recompute, ``attn-saved`` once; both recompute the projections."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    untouched = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    counts = {}
    for spec in (None, "full", "attn-saved"):
        model = copy.deepcopy(untouched)
        if spec:
            remat.apply(model, spec)
        with oracle.Meter(model) as meter:
            model(input_ids=ids, labels=ids).loss.backward()
        counts[spec] = meter.result.ops_by_op
    blocks = config.num_hidden_layers
    assert _kernel_calls(counts[None]) == blocks
    assert _kernel_calls(counts["full"]) == 2 * blocks
    assert _kernel_calls(counts["attn-saved"]) == blocks
    assert _matmuls(counts["attn-saved"]) == _matmuls(counts["full"]) > _matmuls(counts[None])


def test_an_attention_kernel_with_dropout_is_recomputed():
    """Kept, a kernel that drew dropout in the forward would not draw in the recompute, and every
    later random op of the block would take other masks."""
    aten = torch.ops.aten
    q = torch.zeros(1, 2, 4, 8)
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert saves_attention(flash) and saves(flash)
    assert not saves_attention(aten.mm.default) and saves(aten.mm.default)
    assert _drops_out(flash, (q, q, q, 0.1), {})
    assert _drops_out(flash, (q, q, q), {"dropout_p": 0.1})
    assert not _drops_out(flash, (q, q, q), {})
    assert not _drops_out(flash, (q, q, q, 0.0, True), {})
    assert not _drops_out(aten.mm.default, (q, q), {})


def test_the_planner_keeps_attention_at_long_context():
    """At 65,536 tokens of an 8B-shaped block (fake tensors, H100 rates) attention is most of a
    recompute: the plan keeps it, and predicts a shorter step than the best plan without it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 17)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.zeros(1, 65536, dtype=torch.long)
    profiled = remat.profile(model, ids, device="fake", gpu="h100")
    without = [t for t in remat.planning.plans.TREATMENTS if not t.startswith("attn-saved")]
    plans = {kept: remat.plan(model, ids, budget="24GiB", profiled=profiled, host_memory="64GiB",
                              **({} if kept else {"treatments": without})) for kept in (True, False)}
    assert any(t.startswith("attn-saved") for t in plans[True].blocks.values()), plans[True].summary()
    assert plans[True].notes["predicted_step_s"] < plans[False].notes["predicted_step_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["attn-saved", "attn-saved+offload", "attn-saved+tiled"])
def test_gpu_bf16_error_against_fp64_is_the_untouched_models(spec):
    """bf16 on the GPU (flash attention kept): every gradient's error against an fp64 copy at most
    1.05x the untouched bf16 model's, and the kernel runs once per block."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    exact = LlamaForCausalLM(config).to("cuda", torch.float64).train()
    untouched = copy.deepcopy(exact).to(torch.bfloat16)
    treated = copy.deepcopy(untouched)
    remat.apply(treated, spec, tile_tokens=300)
    ids = torch.randint(0, config.vocab_size, (2, 512), device="cuda")
    grads, kernels = {}, {}
    for name, model in (("exact", exact), ("untouched", untouched), ("treated", treated)):
        torch.manual_seed(5)
        with oracle.Meter(model) as meter:
            model(input_ids=ids, labels=ids).loss.backward()
        grads[name] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        kernels[name] = _kernel_calls(meter.result.ops_by_op)
    error = {name: ((grads[name] - grads["exact"]).norm() / grads["exact"].norm()).item()
             for name in ("untouched", "treated")}
    assert error["treated"] <= 1.05 * error["untouched"], error
    assert kernels["treated"] == kernels["untouched"] == config.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["attn-saved", "selective"])
def test_gpu_attention_dropout_keeps_the_later_masks(spec):
    """GPT-2 with attention and residual dropout on CUDA (flash attention with dropout draws from
    the generator): the treated model's gradients are the untouched model's to bf16 rounding, which
    fails if the recompute's residual dropout took other masks."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, attn_pdrop=0.1, resid_pdrop=0.1)
    torch.manual_seed(0)
    untouched = GPT2LMHeadModel(config).to("cuda", torch.bfloat16).train()
    treated = copy.deepcopy(untouched)
    remat.apply(treated, spec)
    ids = torch.randint(0, config.vocab_size, (2, 512), device="cuda")
    grads = []
    for model in (untouched, treated):
        torch.manual_seed(5)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 1e-2


def test_eager_fsdp2_plans_attn_saved_only_where_ops_are_long():
    """Under FSDP2 the per-op policy's host time holds the GPU back on short steps (as ``selective``'s):
    left out below OP_POLICY_FROM_TOKENS tokens a step, planned from there on."""
    from remat.planning.plans import ATTENTION_SAVED
    from remat.planner import block_param_bytes
    from remat.planning.sharding import OP_POLICY_FROM_TOKENS, shard
    from remat.presets import build_model, load_config
    model = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)
    for tokens, kept in ((256, False), (OP_POLICY_FROM_TOKENS, True)):
        profiled = remat.profile(model, torch.zeros(1, tokens, dtype=torch.long), gpu="h100", head_modes=("plain",),
                                 tile_candidates=())
        profiled_kinds = set(ATTENTION_SAVED) & set(profiled.treatments())
        assert {"attn-saved", "attn-saved+offload"} <= profiled_kinds
        sharded = shard(profiled, 2, block_param_bytes(model, profiled))
        assert set(sharded.treatments()) & profiled_kinds == (profiled_kinds if kept else set()), tokens


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_fake_profile_prices_attn_saved_as_full_only_where_no_attention_kernel_ran(attention, monkeypatch):
    """A block whose ``keep`` run dispatched no attention kernel (eager attention: matmuls and a
    softmax; a mamba layer) has nothing for ``attn-saved`` to keep: the fake profile takes ``full``'s
    cost for it without running it, and that cost is what running it measures. With SDPA the kernel
    is there: ``attn-saved`` is run, and keeps more than ``full``."""
    from remat.presets import build_model, load_config
    from remat.profiling import _blocks, _measure, _meters
    config = load_config("llama-tiny")
    config.num_hidden_layers = 2
    config.use_cache = True  # as from_pretrained gives it (the presets leave it off)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    ran = []
    block_cost = _blocks._block_cost

    def counted(block, treatment, *args, **kwargs):
        ran.append(treatment)
        return block_cost(block, treatment, *args, **kwargs)
    monkeypatch.setattr(_measure, "_block_cost", counted)
    derived = remat.profile(model, ids, device="fake").classes[0]
    assert ("attn-saved" in ran) == (attention == "sdpa"), ran
    monkeypatch.setattr(_meters._TrackerMeter, "ops_run", lambda self: None)   # as on a GPU: every run measured
    measured = remat.profile(model, ids, device="fake").classes[0]
    assert derived == measured
    if attention == "eager":
        assert derived["attn-saved"] == derived["full"]
    else:
        assert derived["attn-saved"].kept > derived["full"].kept
