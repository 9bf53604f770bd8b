"""Planning models the way users train them (issues 9 and 10): any batch with a ``loss_fn``,
blocks that change shape, MoE with router logits, sliding-window layers, ``use_cache=True``.

Each model is planned on CPU (the fake-tensor path), the plan applied and a real step run.
"""
import warnings

import pytest
import torch
import torch.nn as nn

import remat
from remat.profiling.profiler import profile

from test_profiling_side_effects import TinyCNN, cnn_loss, tiny_llama
from versions import TRANSFORMERS_4


def step(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None for p in model.parameters())
    return loss.detach()


def plan_apply_step(model, batch, budget, loss_fn=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no head mode may fail quietly or loudly here
        plan = remat.plan(model, batch, budget, loss_fn=loss_fn, gpu="h100", **kwargs)
    remat.apply(model, plan, blocks=kwargs.get("blocks"))
    default = (lambda m, b: m(**b).loss) if isinstance(batch, dict) else (lambda m, b: m(input_ids=b, labels=b).loss)
    step(model, batch, loss_fn or default)
    return plan


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualMLP(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_plain_module_with_loss_fn():
    torch.manual_seed(0)
    model = ResidualMLP()
    batch = torch.randn(4, 8, 16)
    loss_fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    prof = profile(model, batch, loss_fn=loss_fn, gpu="h100")
    assert [h.mode for h in prof.heads] == ["plain"]          # no LM head: plain only, no error
    assert "chunked head not available" in prof.notes["chunked"]
    assert prof.block_class == (0, 0, 0, 0)
    plan = plan_apply_step(model, batch, "1GiB", loss_fn=loss_fn)
    assert plan.head == "plain" and len(plan.blocks) == 4


def test_a_batch_remat_cannot_read_asks_for_loss_fn():
    model = ResidualMLP()
    with pytest.raises(TypeError, match="loss_fn"):
        remat.plan(model, torch.randn(4, 8, 16), "1GiB")
    with pytest.raises(TypeError, match="loss_fn"):
        remat.plan(model, (torch.randn(4, 8, 16),), "1GiB")


def test_a_forward_that_reads_tensor_values_gets_a_clear_error_on_fake_tensors():
    """A block that branches on a value (as transformers 4.x MoE routing and BART's layer drop
    do) cannot run on fake tensors: a ValueError that says so and what to do, the model intact."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 16)

        def forward(self, x):
            return self.inner(x) if bool(x.sum() > 0) else x

    model = nn.Sequential(*(Gated() for _ in range(3)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="depends on tensor values.*Profile on a GPU"):
        profile(model, torch.randn(4, 16), loss_fn=lambda m, b: m(b).pow(2).mean(), device="fake")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(type(p) is nn.Parameter for p in model.parameters())  # no fake tensor left behind


def test_tokens_per_expert_counted_with_bincount_profile_on_fake_tensors():
    """Transformers 5.x experts before ``histc`` counted tokens per expert with
    ``bincount(ids, minlength=experts)``, whose length depends on the ids' values: on fake tensors
    it is shaped ``minlength`` (what expert ids give), so the profile runs, as on a GPU."""
    class Routed(nn.Module):
        def __init__(self, experts=4):
            super().__init__()
            self.experts, self.gate, self.inner = experts, nn.Linear(16, experts), nn.Linear(16, 16)

        def forward(self, x):
            ids = self.gate(x).argmax(-1).flatten()
            per_expert = torch.bincount(ids, minlength=self.experts)   # shape (experts,)
            scale = per_expert.to(x.dtype).mean() / ids.numel() * self.experts
            return x + self.inner(x) * scale

    model = nn.Sequential(*(Routed() for _ in range(2)))
    prof = profile(model, torch.randn(4, 16), loss_fn=lambda m, b: m(b).pow(2).mean(), device="fake")
    assert len(prof.block_class) == 2 and prof.cost(0, "keep").kept > 0


class _Cache:
    """A KV cache as a transformers 4.x model holds it: each layer hands it back, the model reads it."""

    def to_legacy_cache(self):
        return ()


class _CacheLayer(Residual):
    def forward(self, x, layer_past=None):
        return x + self.mlp(self.norm(x)), layer_past     # Falcon's, StableLM's (hidden, cache, ...)


class _CacheModel(ResidualMLP):
    def __init__(self, width=16, depth=3):
        super().__init__(width, depth)
        self.blocks = nn.ModuleList(_CacheLayer(width) for _ in range(depth))

    def forward(self, x):
        cache = _Cache()
        for block in self.blocks:
            x, cache = block(x, layer_past=cache)          # next_decoder_cache = outputs[1]
        cache.to_legacy_cache()                            # what failed on None in the head profile
        return x


def test_a_layer_that_hands_back_its_kv_cache_gets_it_back_from_the_head_profile_stub():
    """Transformers 4.x Falcon and StableLM read the cache from each layer's output and call a
    method on it after the last layer: the stubbed head step hands back the cache it is given
    (before, None: no head mode could be profiled)."""
    torch.manual_seed(0)
    model = _CacheModel()
    batch = torch.randn(2, 8, 16)
    loss_fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    prof = profile(model, batch, loss_fn=loss_fn, gpu="h100")
    assert [h.mode for h in prof.heads] == ["plain"], prof.notes
    plan_apply_step(model, batch, "1GiB", loss_fn=loss_fn)


def test_dict_batch_without_a_loss_asks_for_loss_fn():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    with pytest.raises(TypeError, match="loss_fn"):
        remat.plan(model, {"src": torch.randn(2, 8, 16)}, "1GiB")


def test_transformer_encoder_with_a_dict_batch():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3,
                                  enable_nested_tensor=False)
    batch = {"src": torch.randn(2, 8, 16)}
    loss_fn = lambda m, b: m(**b).pow(2).mean()  # noqa: E731
    plan = plan_apply_step(model, batch, "1GiB", loss_fn=loss_fn)
    assert set(plan.blocks) == {"layers.0", "layers.1", "layers.2"}


def test_cnn_whose_stages_change_shape():
    torch.manual_seed(0)
    model = TinyCNN()
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,)))
    prof = profile(model, batch, loss_fn=cnn_loss, gpu="h100")
    # four stages, four configurations (their parameters differ)
    assert len(prof.classes) == 4
    # each stage measured on the input it really gets: its output is its own, not the first's
    expected = [2 * 8 * 16 * 16, 2 * 16 * 8 * 8, 2 * 16 * 8 * 8, 2 * 32 * 4 * 4]
    assert [prof.classes[c]["keep"].out_bytes // 4 for c in prof.block_class] == expected
    assert prof.hidden_bytes == 2 * 3 * 16 * 16 * 4
    plan = plan_apply_step(model, batch, "1GiB", loss_fn=cnn_loss)
    assert plan.head == "plain"


def test_from_config_defaults_use_cache():
    model = tiny_llama()
    assert model.config.use_cache is True
    ids = torch.randint(0, 128, (2, 16))
    plan = plan_apply_step(model, ids, "1GiB")
    prof = profile(model, ids, gpu="h100")
    assert {h.mode for h in prof.heads} == {"plain", "chunked"}


def test_moe_with_router_logits():
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True)
    model = MixtralForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    if TRANSFORMERS_4:   # 4.x routes tokens with nonzero(): no fake-tensor profile, a clear error instead
        with pytest.raises(ValueError, match="depends on tensor values.*transformers 4.x MoE.*Profile on a GPU"):
            profile(model, ids, gpu="h100")
        return
    prof = profile(model, ids, gpu="h100")      # fp32 experts on fake tensors: grouped matmul included
    assert "plain" in {h.mode for h in prof.heads}, prof.notes
    plan = plan_apply_step(model, ids, "1GiB")
    assert len(plan.blocks) == 2


def test_gemma2_sliding_and_global_layers_are_profiled_apart():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4)
    model = Gemma2ForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    prof = profile(model, ids, gpu="h100")
    assert len(prof.classes) == 2
    assert prof.block_class == (0, 1, 0, 1)
