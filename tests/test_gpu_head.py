"""The fused chunked-loss kernels on CUDA (Triton's, and inductor's where Triton does not build)
against the eager chunk path, and the chunked head under ``torch.compile`` on CUDA (inductor)."""
import copy

import pytest
import torch

import remat
# private names of chunked_loss below: the loss op's parts, checked one at a time on the GPU
from remat.head import chunked_loss, xent_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(path, hidden, weight, targets, monkeypatch, chunk=1000):
    """The chunked loss and its gradients by the chunk kernel ``path``: "triton" (the fused path
    as it runs), "inductor" (its fallback where Triton does not build) or "eager"."""
    with monkeypatch.context() as m:
        if path == "eager":
            m.setattr(chunked_loss, "fused_kernel", lambda device: None)
        else:
            xent_kernel.fused_kernel(hidden.device)
            if path == "inductor":
                m.setitem(xent_kernel.KERNEL, "triton", None)
            assert xent_kernel.KERNEL.get("triton" if path == "triton" else "fn") is not None, f"no {path} kernel"
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = chunked_loss.chunked_cross_entropy(h, w, None, targets, chunk_tokens=chunk)
        loss.backward()
    return loss.detach(), h.grad, w.grad


def _assert_near(fused, eager, dtype):
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    for a, b in zip(fused[1:], eager[1:]):
        error = (a.float() - b.float()).norm() / b.float().norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), float(error)


@pytest.mark.parametrize("path", ["triton", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_matches_eager_chunks(dtype, path, monkeypatch):
    torch.manual_seed(0)
    hidden = torch.randn(4099, 256, device="cuda", dtype=dtype)
    weight = torch.randn(5003, 256, device="cuda", dtype=dtype) * 0.05
    targets = torch.randint(0, 5003, (4099,), device="cuda")
    targets[::7] = -100
    fused = _run(path, hidden, weight, targets, monkeypatch)
    assert not xent_kernel.EAGER_SHAPES, f"the fused kernel did not compile: {xent_kernel.EAGER_SHAPES}"
    _assert_near(fused, _run("eager", hidden, weight, targets, monkeypatch), dtype)


@pytest.mark.parametrize("path", ["triton", "inductor"])
def test_target_rows_take_the_kernels_copied_columns(path, monkeypatch):
    """A bf16 head whose vocabulary is large beside the tokens sums its weight gradient with
    target rows: the chunk kernel copies their columns out (Triton) or ``index_select`` does
    (inductor), and the gradients are the eager path's, where the accumulator gathers them."""
    torch.manual_seed(1)
    hidden = torch.randn(1500, 128, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(50000, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    targets = torch.randint(0, 50000, (1500,), device="cuda")
    targets[::7] = -100
    used = []
    monkeypatch.setattr(chunked_loss._TargetRows, "finish",
                        lambda self, dtype, f=chunked_loss._TargetRows.finish: used.append(1) or f(self, dtype))
    fused = _run(path, hidden, weight, targets, monkeypatch, chunk=512)
    assert used, "the head did not sum its weight gradient with target rows"
    _assert_near(fused, _run("eager", hidden, weight, targets, monkeypatch, chunk=512), torch.bfloat16)


def test_target_rows_run_under_deterministic_algorithms(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` raises at any CUDA op without a deterministic
    kernel (``scatter_reduce`` is one, whatever its reduction): the head with target rows uses
    none of them, and gives the same gradients twice, bit for bit."""
    torch.manual_seed(3)
    hidden = torch.randn(1500, 128, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(50000, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    targets = torch.randint(0, 50000, (1500,), device="cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS asks for
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (_run("triton", hidden, weight, targets, monkeypatch, chunk=512) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_kernel_against_the_eager_ops(dtype):
    """The Triton kernel alone: a vocabulary of two column blocks and a tail, ignored rows, padded
    rows, a valid target outside the vocabulary (NaN loss), and the gather of sorted columns
    (padded with column 0) for the unpadded rows only."""
    from remat.head import xent_triton
    torch.manual_seed(2)
    vocab, rows, real = 50000, 300, 290
    z = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    y = torch.randint(0, vocab, (rows,), device="cuda")
    y[::5] = -100
    y[real:] = -100
    pre = torch.tensor(1 / 200.0, device="cuda")
    eager = z.clone()
    expected = xent_kernel.eager_kernel(eager, y, -100, pre)
    columns = torch.nn.functional.pad(torch.unique(y[y >= 0]), (0, 3))
    out = torch.full((real, columns.numel()), 7.0, device="cuda", dtype=dtype)
    ours = z.clone()
    loss = xent_triton.xent_rows(ours, y, -100, pre, (columns, out))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    atol = 1e-6 if dtype == torch.float32 else 2 ** -8 * pre.item()  # one rounding of the largest element
    torch.testing.assert_close(ours.float(), eager.float(), rtol=0, atol=atol)
    assert torch.equal(out, ours[:real].index_select(1, columns))
    y[1] = vocab + 3
    assert xent_triton.xent_rows(z.clone(), y, -100, pre).isnan()


def test_every_sequence_length_reuses_one_compile(monkeypatch):
    """The tail chunk is padded to the chunk size: new lengths never recompile the inductor
    kernel (the Triton kernel's grid is the rows: it has no shapes to recompile for)."""
    import torch._dynamo
    torch.manual_seed(0)
    weight = torch.randn(3001, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    first = 2 * 512 + 77
    for n in (first, 512 * 3 + 5, 512 * 2, 513, 1999):
        hidden = torch.randn(n, 128, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, 3001, (n,), device="cuda")
        if n == first:
            fused = _run("inductor", hidden, weight, targets, monkeypatch, chunk=512)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                fused = _run("inductor", hidden, weight, targets, monkeypatch, chunk=512)
        eager = _run("eager", hidden, weight, targets, monkeypatch, chunk=512)
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
    from remat.head import chunked_loss
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
