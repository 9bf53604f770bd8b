"""The fused (compiled) chunked-loss kernel on CUDA against the eager chunk path, and the
chunked head under ``torch.compile`` on CUDA (inductor)."""
import copy

import pytest
import torch

import remat
from remat.treat import chunked_loss, xent_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(fused: bool, hidden, weight, targets, monkeypatch, chunk=1000):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(chunked_loss, "fused_kernel", lambda device: None)
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = chunked_loss.chunked_cross_entropy(h, w, None, targets, chunk_tokens=chunk)
        loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_matches_eager_chunks(dtype, monkeypatch):
    torch.manual_seed(0)
    hidden = torch.randn(4099, 256, device="cuda", dtype=dtype)
    weight = torch.randn(5003, 256, device="cuda", dtype=dtype) * 0.05
    targets = torch.randint(0, 5003, (4099,), device="cuda")
    targets[::7] = -100
    fused = _run(True, hidden, weight, targets, monkeypatch)
    assert xent_kernel.KERNEL.get("fn") is not None, "torch.compile is not available"
    assert not xent_kernel.EAGER_SHAPES, f"the fused kernel did not compile: {xent_kernel.EAGER_SHAPES}"
    eager = _run(False, hidden, weight, targets, monkeypatch)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    for a, b in zip(fused[1:], eager[1:]):
        error = (a.float() - b.float()).norm() / b.float().norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), float(error)


def test_every_sequence_length_reuses_one_compile(monkeypatch):
    """The tail chunk is padded to the chunk size: new lengths never recompile."""
    import torch._dynamo
    torch.manual_seed(0)
    weight = torch.randn(3001, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    first = 2 * 512 + 77
    for n in (first, 512 * 3 + 5, 512 * 2, 513, 1999):
        hidden = torch.randn(n, 128, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, 3001, (n,), device="cuda")
        if n == first:
            fused = _run(True, hidden, weight, targets, monkeypatch, chunk=512)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                fused = _run(True, hidden, weight, targets, monkeypatch, chunk=512)
        eager = _run(False, hidden, weight, targets, monkeypatch, chunk=512)
        torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    assert not xent_kernel.EAGER_SHAPES


def _tiny_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).train()


@pytest.mark.parametrize("how", ["model.compile", "torch.compile", "per-block"])
def test_chunked_head_under_inductor_matches_eager(how):
    torch._dynamo.reset()
    eager = remat.apply(_tiny_llama("cuda"), "keep", head="chunked", chunk_tokens=100)
    model = copy.deepcopy(eager)
    if how == "model.compile":
        model.compile()
    elif how == "torch.compile":
        model = torch.compile(model)
    else:
        for layer in model.model.layers:
            layer.compile()
    ids = torch.randint(0, 1000, (2, 157), device="cuda")
    results = []
    for m in (model, eager):
        for _ in range(2):  # the second step runs the compiled code without compiling
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        named = getattr(m, "_orig_mod", m).named_parameters()
        results.append((loss.detach(), {n: p.grad.detach() for n, p in named}))
    ours, ref = results
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-4, atol=0)
    for name, g in ref[1].items():
        error = (ours[1][name] - g).norm() / g.norm().clamp_min(1e-30)
        assert error < 1e-3, (name, float(error))


def test_weight_gradient_accumulates_unrounded_on_cuda():
    """On CUDA (torch with ``addmm(out_dtype=)``) each chunk's weight-gradient product goes
    straight into the fp32 accumulator: closer to the fp64 product than a bf16 product added."""
    from remat.treat import chunked_loss
    g = torch.Generator().manual_seed(3)
    a = torch.randn(512, 2048, generator=g).bfloat16().cuda()
    b = torch.randn(2048, 256, generator=g).bfloat16().cuda()
    exact = a.double().mm(b.double())
    acc = torch.zeros(512, 256, device="cuda")
    chunked_loss._accumulate(acc, a, b)
    rounded = a.mm(b).float()
    if not chunked_loss._fp32_out(acc.device):
        pytest.skip(f"torch {torch.__version__} has no addmm(out_dtype=float32) on this GPU: the rounded path runs")
    assert (acc.double() - exact).norm() < 0.1 * (rounded.double() - exact).norm()
