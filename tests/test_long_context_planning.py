"""Long-context planning: attention priced by its FLOPs at measured rates, the fake chunked head's
footprint, and a GPU model at long context profiled with fake tensors at its GPU's rates."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.planning.costs import rates_for
# private: the fake-tensor meter and the config's attention shapes, checked alone at shapes no CPU profile reaches
from remat.profiling._meters import _Tracker
from remat.profiling.profiler import _attention_shapes


def attention_seconds(seq, causal=True, head_dim=128, heads=32, kv_heads=8, gpu="h100", backward=False):
    rates = rates_for(gpu)
    with FakeTensorMode():
        q = torch.empty(1, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(1, kv_heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        tracker = _Tracker(rates)
        with tracker:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[0]
            forward = tracker.seconds
            if backward:
                out.sum().backward()
        return tracker.seconds - forward if backward else forward


def test_attention_is_priced_by_its_quadratic_flops_at_the_measured_rate():
    short, long = attention_seconds(65536), attention_seconds(131072)
    assert long / short == pytest.approx(4.0, rel=0.01)
    assert attention_seconds(65536, causal=False) / short == pytest.approx(2.0, rel=0.01)
    flops = 2.0 * 32 * 131072 * 131072 * 256 * 0.5
    assert long == pytest.approx(flops / rates_for("h100").attention_flops(128, False), rel=0.01)
    # the backward, at its own rate, runs 2.5 times the forward's FLOPs
    backward = attention_seconds(131072, backward=True)
    assert backward == pytest.approx(2.5 * flops / rates_for("h100").attention_flops(128, True), rel=0.02)


def test_attention_rates_per_head_dimension():
    rates = rates_for("h100")
    low, high = rates.attention_flops(64, False), rates.attention_flops(128, False)
    assert low < rates.attention_flops(96, False) < high
    assert rates.attention_flops(32, True) == rates.attention_flops(64, True)
    assert rates.attention_flops(256, True) == rates.attention_flops(128, True)
    assert rates_for("a100").attention_flops(128, False) is None  # not measured: a fraction of the matmul rate
    assert attention_seconds(65536, gpu="a100") > 0


def test_fake_chunked_head_runs_the_kernels_footprint_not_the_eager_blocks(monkeypatch):
    from remat.head import chunked_loss

    def eager(*args, **kwargs):
        raise AssertionError("a fake-tensor profile ran the eager chunk kernel")
    monkeypatch.setattr(chunked_loss, "eager_kernel", eager)
    import remat
    from remat.presets import build_model, load_config
    config = load_config("llama-tiny")
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(1, 4096, dtype=torch.long)
    prof = remat.profile(model, {"input_ids": ids, "labels": ids}, head_modes=("chunked",), chunk_candidates=(1024,))
    head = prof.head("chunked")
    # the chunk's logits (1024 x vocab, bf16) are in the head's peak; an fp32 block copy of the eager path is not
    logits = 1024 * config.vocab_size * 2
    assert head.head_fwd_s > 0 and head.head_fwd_peak >= logits


def test_attention_shapes_come_from_the_config():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert _attention_shapes(model) == ((8, 2, 32),)
    assert _attention_shapes(torch.nn.Linear(2, 2)) == ((32, 32, 128),)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_model_at_long_context_is_profiled_with_fake_tensors_at_measured_rates():
    import remat
    from remat.presets import build_model, load_config
    from remat.profiling import profiler
    model = build_model(load_config("llama-tiny"), device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(1, profiler.LONG_CONTEXT_TOKENS, dtype=torch.long, device="cuda")
    before = torch.cuda.memory_allocated()
    prof = remat.profile(model, {"input_ids": ids, "labels": ids})
    assert prof.device == "cuda" and "fake tensors" in prof.notes["profiled"]
    assert prof.rates.attention and prof.rates.measured
    assert torch.cuda.memory_allocated() == before
