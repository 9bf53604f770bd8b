"""The tiled treatments (remat.treat.tiled): token-wise sub-modules run a chunk of tokens at a time.

Checked on models as users load them (config defaults: use_cache on, dropout on, MoE router
logits on), fp32 on the CPU: loss and every gradient within 1e-6 relative of an untouched copy
(the weight gradients are summed over chunks, so not bitwise), the mechanism (no op ever holds a
full sequence of MLP intermediates, the block saves less, the recompute runs), and bad input
refused before the model is touched.
"""
import copy
import json

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import oracle
import remat
import zoo
from remat.treat.tiled import tiled_targets
from remat.treat.treatments import treatment_of

SPECS = ("tiled", "full+tiled", "full+offload+tiled", "every:2:full+tiled", "attn-saved+tiled", "attn-saved+offload+tiled")
MODELS = ("llama", "qwen3", "gpt2", "gemma2", "mixtral")
TILE = 5  # 2 x 12 tokens: chunks of 5, 5, 5, 5, 4


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", MODELS)
def test_tiled_matches_the_untouched_model(name, spec):
    model = zoo.build(name)
    if name == "mixtral":  # the auxiliary loss large enough that a lost router gradient shows
        model.router_aux_loss_coef = 1.0
    reference = copy.deepcopy(model)
    remat.apply(model, spec, tile_tokens=TILE, offload_options=zoo.INLINE_OFFLOAD)
    oracle.check_mechanism(model, zoo.compare(name, model, reference).assert_close(oracle.FP32_REORDERED))


def test_the_router_gradient_of_the_auxiliary_loss_is_kept():
    """Mixtral records its router logits with hooks; tiled, they come from the tiled function
    and carry the gradient. The check can fail: without the auxiliary loss the router's gradient
    moves far more than the tolerance."""
    model = zoo.build("mixtral")
    model.router_aux_loss_coef = 1.0
    without_aux = copy.deepcopy(model)
    without_aux.router_aux_loss_coef = 0.0
    reference = copy.deepcopy(model)
    remat.apply(model, "tiled", tile_tokens=TILE)
    grads = []
    for m in (model, reference, without_aux):
        torch.manual_seed(3)
        zoo.CASES["mixtral"].loss(m, zoo.CASES["mixtral"].batch(m)).backward()
        grads.append(m.model.layers[0].mlp.gate.weight.grad)
    assert _relative(grads[0], grads[1]) < 1e-6
    assert _relative(grads[2], grads[1]) > 1e-3


class _Largest(TorchDispatchMode):
    """The largest element count of any op output, by the output's last dimension; tensors shaped
    like a parameter (weights and their gradients) are not activations and are left out."""

    def __init__(self, model):
        super().__init__()
        self.by_width = {}
        self.weights = {tuple(p.shape) for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) not in self.weights:
                self.by_width[t.shape[-1]] = max(self.by_width.get(t.shape[-1], 0), t.numel())
        return out


def test_the_mlp_intermediates_exist_one_chunk_at_a_time():
    """No op of the step makes an MLP intermediate (width intermediate_size) of more than one
    chunk's tokens; untreated, the forward makes them for all 24 tokens."""
    model = zoo.build("llama")
    width = model.config.intermediate_size
    case = zoo.CASES["llama"]
    batch = case.batch(model)
    tokens = batch["input_ids"].numel()
    untreated = _Largest(model)
    with untreated:
        case.loss(model, oracle.clone(batch)).backward()
    assert untreated.by_width[width] == tokens * width
    for spec in ("tiled", "full+tiled"):
        remat.apply(model, spec, tile_tokens=TILE)
        tiled = _Largest(model)
        with tiled:
            case.loss(model, oracle.clone(batch)).backward()
        assert tiled.by_width[width] == TILE * width, spec


@pytest.mark.parametrize("spec", ["full+tiled", "attn-saved+offload+tiled"])
@pytest.mark.parametrize("name, runs", [("llama", 2), ("gpt2", 2), ("gemma2", 3)])
def test_the_recompute_skips_a_tiled_mlp_whose_output_nothing_saves(name, runs, spec):
    """The MLP's chunks run in the forward and in the MLP's own backward; the block's recompute
    runs them a third time only where something after the MLP saves its output (Gemma-2's
    post-feedforward norm); the gradients are checked equal by the tests above."""
    model = zoo.build(name)
    remat.apply(model, spec, tile_tokens=TILE, offload_options=zoo.INLINE_OFFLOAD)
    block = next(b for b in model.modules() if treatment_of(b) == spec)
    mlp = dict(tiled_targets(block))["mlp"]
    linear = next(m for m in mlp.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    runs_seen = []
    forward = linear.forward
    linear.forward = lambda *args, **kwargs: runs_seen.append(1) or forward(*args, **kwargs)
    case = zoo.CASES[name]
    batch = case.batch(model)
    chunks = -(-batch["input_ids"].numel() // TILE)
    case.loss(model, batch).backward()
    assert len(runs_seen) == runs * chunks


def test_a_tiled_block_saves_less_for_backward():
    """``tiled`` alone keeps attention's saved tensors but none of the MLP's or norms' insides."""
    def saved_bytes(model):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        case = zoo.CASES["llama"]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = case.loss(model, case.batch(model))
        loss.backward()
        return sum(seen.values())
    model = zoo.build("llama")
    untreated = saved_bytes(model)
    remat.apply(model, "tiled", tile_tokens=TILE)
    assert saved_bytes(model) < 0.8 * untreated


def test_plans_and_specs_carry_tiling(tmp_path):
    model = zoo.build("llama")
    remat.apply(model, "every:2:full+tiled", tile_tokens=6)
    assert remat.api.treatments(model) == {"model.layers.0": "full+tiled", "model.layers.1": "keep"}
    plan = remat.current_plan(model)
    assert plan.tile_tokens == 6 and "tiles of 6 tokens" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert remat.Plan.load(str(path)) == plan
    data = json.loads(path.read_text())
    data["tile_tokens"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"plan.json: 'tile_tokens' must be a positive integer"):
        remat.Plan.load(str(path))


def _compile_tiny():
    """The tiny llama at its config's defaults (``use_cache`` on), 2 layers, as the compile tests build it."""
    from remat.presets import build_model, load_config
    config = load_config("llama-tiny")
    config.num_hidden_layers = 2
    config.use_cache = True
    torch.manual_seed(0)
    return build_model(config, device="cpu", dtype=torch.float32).train()


def _checkpoint_regions(graph_module) -> int:
    """Checkpoint regions traced into ``graph_module`` and the sub-graphs it holds (a block's own
    checkpoint holds its tiled sub-modules' chunk checkpoints)."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    found = sum(isinstance(node.target, TagActivationCheckpoint) for node in graph_module.graph.nodes)
    return found + sum(_checkpoint_regions(child) for child in graph_module.children()
                       if isinstance(child, torch.fx.GraphModule))


@pytest.mark.parametrize("spec, block_checkpoints", [
    pytest.param("tiled", 0, marks=pytest.mark.slow(reason="a second compile of the same loop, 8 s of CPU")),
    ("full+tiled", 2)])
def test_tiled_blocks_compile_without_graph_breaks(spec, block_checkpoints):
    """Under ``model.compile()`` a tiled block breaks the graph no more than an untouched one (it
    broke it at each of its 3 tiled sub-modules when the chunk loop was compiler-disabled), every
    chunk of every tiled sub-module is a checkpoint region in the captured graph (a treatment that
    did nothing puts none there), and the compiled step (aot_eager: dynamo, then AOT autograd's
    partition of the checkpoint regions) gives the untouched model's loss and gradients."""
    import torch._dynamo
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    chunks = -(-ids.numel() // TILE)                       # 32 tokens in chunks of 5: 7
    reference = _compile_tiny()
    reference(input_ids=ids, labels=ids).loss.backward()
    try:
        torch._dynamo.reset()
        untouched = torch._dynamo.explain(_compile_tiny())(input_ids=ids, labels=ids).graph_break_count
        model = remat.apply(_compile_tiny(), spec, tile_tokens=TILE)
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        assert explained.graph_break_count == untouched, [str(b.reason)[:200] for b in explained.break_reasons]
        regions = sum(_checkpoint_regions(graph) for graph in explained.graphs)
        assert regions == 2 * 3 * chunks + block_checkpoints   # 2 layers x (2 norms + the MLP) x chunks
        torch._dynamo.reset()
        model.compile(backend="aot_eager")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert _relative(loss.detach(), reference(input_ids=ids, labels=ids).loss.detach()) < 1e-6
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _relative(p.grad, q.grad) < 1e-6, name
    finally:
        torch._dynamo.reset()


def _untouched(model):
    return not any("_remat_patches" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("tokens", [0, -4, 2.5, True, "8"])
def test_a_bad_chunk_size_is_refused_before_the_model_is_touched(tokens):
    model = zoo.build("llama")
    with pytest.raises(ValueError, match="tile_tokens must be a positive integer|'tile_tokens' must be"):
        remat.apply(model, "full+tiled", tile_tokens=tokens)
    assert _untouched(model)


class _TimeMixingMLP(nn.Module):
    """An MLP whose output row depends on earlier rows (a running mean over the sequence)."""

    def __init__(self, width=16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h.cumsum(dim=-2) / torch.arange(1, x.shape[-2] + 1).unsqueeze(-1))


class _Block(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def test_a_sub_module_that_mixes_tokens_is_refused_before_the_model_is_touched():
    model = nn.Sequential(_Block(_TimeMixingMLP()), _Block(_TimeMixingMLP()))
    with pytest.raises(ValueError, match=r"mlp \(_TimeMixingMLP\) is not token-wise"):
        remat.apply(model, "tiled")
    assert _untouched(model)


class _ResidualMLP(nn.Module):
    """BLOOM's shape of MLP: it adds the residual itself, ``forward(hidden_states, residual)``."""

    def __init__(self, width=16):
        super().__init__()
        self.up = nn.Linear(width, width)

    def forward(self, hidden_states, residual):
        return residual + self.up(hidden_states)


class _TokenRoutedMLP(nn.Module):
    """DeepSeek-V4's shape of MoE: routed by the token ids its block passes, ``None`` otherwise."""

    def __init__(self, width=16):
        super().__init__()
        self.up = nn.Linear(width, width)

    def forward(self, hidden_states, input_ids=None):
        return self.up(hidden_states) * input_ids.reshape(*hidden_states.shape[:-1], 1)


class _PassingBlock(_Block):
    def forward(self, x):
        out = self.mlp(self.norm(x), x) if isinstance(self.mlp, _ResidualMLP) else self.mlp(self.norm(x))
        return x + (out[0] if isinstance(out, tuple) else out)


class _RouterLogitsMLP(nn.Module):
    """GPT-OSS's shape of MoE: experts as 3-D parameters, and the router's scores returned beside the output."""

    def __init__(self, width=16):
        super().__init__()
        self.hidden_size = width
        self.experts = nn.Parameter(torch.randn(2, width, width))

    def forward(self, hidden_states):
        return hidden_states @ self.experts[0], hidden_states.sum(-1)


class _ConvMLP(nn.Module):
    """SwiftFormer's shape of MLP: 1x1 convolutions over ``[batch, channels, height, width]``."""

    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Conv2d(width, width, 1)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("mlp, why", [
    (_ConvMLP, r"\(_ConvMLP\) has no linear layer or hidden size to read its width from"),
    (_ResidualMLP, r"\(_ResidualMLP\) needs more than the hidden states \(forward\(hidden_states, residual\)\)"),
    (_TokenRoutedMLP, r"\(_TokenRoutedMLP\) cannot run on the hidden states alone \(forward\(hidden_states, "
                      r"input_ids=...\): 8 random tokens of 16 features raised AttributeError"),
    (_RouterLogitsMLP, r"\(_RouterLogitsMLP\) returns tuple, not one tensor")])
def test_a_sub_module_that_cannot_run_on_chunks_of_rows_is_refused_before_the_model_is_touched(mlp, why):
    model = nn.Sequential(_PassingBlock(mlp()), _PassingBlock(mlp()))
    with pytest.raises(ValueError, match=why):
        remat.apply(model, "full+tiled")
    assert _untouched(model)


class _AddsIntoMLPOutput(_Block):
    """Falcon's shape of block: the attention's output added in place into the MLP's."""

    def forward(self, x):
        out = self.mlp(self.norm(x))
        out += x
        return out


def test_the_tiled_output_takes_in_place_writes():
    """The tiled function's output is a tensor of its own (not a view made inside the function, which
    autograd refuses to write into): a block that adds into it in place trains as untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_AddsIntoMLPOutput(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
                            for _ in range(2)])
    reference = copy.deepcopy(model)
    remat.apply(model, "tiled", tile_tokens=3)
    x = torch.randn(2, 7, 16)
    for net in (model, reference):
        net(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _relative(p.grad, q.grad) < 1e-6, name


def test_a_block_without_token_wise_sub_modules_is_refused():
    model = zoo.build("resnet_bn")
    with pytest.raises(ValueError, match="needs a token-wise sub-module"):
        remat.apply(model, "full+tiled")
    assert _untouched(model)


def test_the_targets_are_the_norms_and_the_mlp():
    model = zoo.build("gemma2")
    names = [name for name, _ in tiled_targets(model.model.layers[0])]
    assert names == ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "mlp"]


def test_remove_gives_the_modules_back():
    model = zoo.build("gpt2")
    reference = copy.deepcopy(model)
    remat.apply(model, "full+tiled", tile_tokens=TILE)
    remat.remove(model)
    assert _untouched(model)
    oracle.check_untouched(zoo.compare("gpt2", model, reference, steps=1).assert_equal())


def test_the_planner_tiles_where_block_insides_set_the_floor():
    """A long sequence of a model with a wide MLP: the smallest plan with tiling is smaller than
    the smallest without it, the planner picks a tiled treatment there, and the plan applies."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (1, 16384), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    untiled = [t for t in remat.planning.plans.TREATMENTS if "tiled" not in t and "offload" not in t]

    def floor(treatments):
        with pytest.raises(remat.NoPlanFits) as found:
            remat.plan(model, batch, budget="1MiB", treatments=treatments, heads=["chunked"])
        return found.value.smallest_peak
    without, with_tiling = floor(untiled), floor(untiled + ["tiled", "full+tiled"])
    assert with_tiling < 0.9 * without
    plan = remat.plan(model, batch, budget=int(with_tiling * 1.01), treatments=untiled + ["tiled", "full+tiled"],
                      heads=["chunked"])
    assert any("tiled" in t for t in plan.blocks.values()), plan.summary()
    remat.apply(model, plan)
    assert all(remat.api.treatments(model)[name] == t for name, t in plan.blocks.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["tiled", "full+tiled", "full+offload+tiled"])
def test_gpu_bf16_error_against_fp64_is_the_untouched_models(spec):
    """bf16 on the GPU, dropout on (the replayed masks must be CUDA's own): every gradient's error
    against an fp64 copy at most 1.05x the untouched bf16 model's, over the model as a whole."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    torch.manual_seed(0)
    exact = LlamaForCausalLM(config).to("cuda", torch.float64).train()
    untouched = copy.deepcopy(exact).to(torch.bfloat16)
    tiled = copy.deepcopy(untouched)
    remat.apply(tiled, spec, tile_tokens=300)   # 2 x 512 tokens: chunks of 300, 300, 300, 124
    ids = torch.randint(0, config.vocab_size, (2, 512), device="cuda")
    grads = {}
    for name, model in (("exact", exact), ("untouched", untouched), ("tiled", tiled)):
        torch.manual_seed(5)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[name] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    error = {name: ((grads[name] - grads["exact"]).norm() / grads["exact"].norm()).item()
             for name in ("untouched", "tiled")}
    assert error["tiled"] <= 1.05 * error["untouched"], error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dropout_masks_are_the_untouched_models():
    """GPT-2's MLP ends in dropout: tiled, on CUDA, it zeroes exactly the elements the untouched
    model zeroes (CUDA's fused dropout draws by element index: the replay draws over the whole
    sequence at once), and the gradients agree to bf16 rounding."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, resid_pdrop=0.1)
    torch.manual_seed(0)
    untouched = GPT2LMHeadModel(config).to("cuda", torch.bfloat16).train()
    tiled = copy.deepcopy(untouched)
    remat.apply(tiled, "full+tiled", tile_tokens=300)
    ids = torch.randint(0, config.vocab_size, (2, 512), device="cuda")
    zeros, grads = [], []
    for model in (untouched, tiled):
        seen = []
        handle = model.transformer.h[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out == 0))
        torch.manual_seed(5)
        model(input_ids=ids, labels=ids).loss.backward()
        handle.remove()
        zeros.append(seen[0])
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert 0.05 < zeros[0].float().mean().item() < 0.15
    assert torch.equal(zeros[0], zeros[1])
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 1e-2
