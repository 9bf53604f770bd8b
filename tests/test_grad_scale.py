"""The chunked head's backward scaling (``remat.head.grad_scale.times``): the product in fp32,
rounded once, on every path it can take: the CPU's eager op and the eager blocks CUDA falls back
to here, CUDA's Triton kernel on a GPU."""
from __future__ import annotations

import pytest
import torch

from remat.head import grad_scale

FACTOR = torch.tensor(1 / 3)  # not a power of two: rounding it to bf16 changes it
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="the Triton kernel and the factor's rounding are CUDA's")


def _tensor(dtype, rows=37, cols=29, device="cpu"):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)


@pytest.mark.parametrize("path", [grad_scale.times, grad_scale.in_blocks], ids=["eager", "blocks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [True, False])
def test_every_path_multiplies_in_fp32_and_rounds_once(monkeypatch, path, dtype, in_place):
    monkeypatch.setattr(grad_scale, "BLOCK_BYTES", 4 * 29 * 5)  # blocks of 5 rows: 8 blocks
    t = _tensor(dtype)
    expected = (t.float() * FACTOR).to(dtype)
    # what the eager CUDA op computed: the factor rounded to the tensor's dtype first
    assert not torch.equal(expected, (t.float() * FACTOR.to(dtype).float()).to(dtype))
    out = t if in_place else torch.empty_like(t)
    assert path(t, FACTOR, out) is out
    assert torch.equal(out, expected)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("factor", [1 / 3, 1.0, 0.0])
def test_the_triton_kernel_multiplies_in_fp32_and_rounds_once(dtype, in_place, factor):
    """On CUDA (a tensor of several programs and a tail): in place with a factor of 1 it writes
    nothing, which leaves the tensor as it was, the product's value."""
    assert grad_scale._kernel() is not None, "Triton does not import"
    t = _tensor(dtype, rows=1000, cols=77, device="cuda")
    f = torch.tensor(factor, device="cuda")
    expected = (t.float() * f).to(dtype)
    out = t if in_place else torch.empty_like(t)
    assert grad_scale.times(t, f, out) is out
    assert torch.equal(out, expected)


def test_a_failed_compile_falls_back_to_the_blocks_for_good_and_says_why_once(monkeypatch):
    calls = []

    def broken(out, t, factor):
        calls.append(1)
        raise ImportError("no kernel today")
    monkeypatch.setattr(grad_scale, "_eager_is_exact", lambda t: False)  # as on CUDA
    # private (_KERNEL): the kernel made on first use, replaced by one that fails as a real one can
    monkeypatch.setattr(grad_scale, "_KERNEL", {"fn": broken})
    t = _tensor(torch.bfloat16)
    expected = (t.float() * FACTOR).to(t.dtype)
    with pytest.warns(UserWarning, match="gradient scaling could not be compiled.*no kernel today"):
        assert torch.equal(grad_scale.times(t, FACTOR, torch.empty_like(t)), expected)
    assert torch.equal(grad_scale.times(t, FACTOR, t), expected) and calls == [1]


def test_an_out_of_memory_error_is_not_a_compile_failure(monkeypatch):
    def short_of_memory(out, t, factor):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(grad_scale, "_eager_is_exact", lambda t: False)
    monkeypatch.setattr(grad_scale, "_KERNEL", {"fn": short_of_memory})
    t = _tensor(torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        grad_scale.times(t, FACTOR, t)
    assert grad_scale._KERNEL["fn"] is short_of_memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the eager op's factor rounding is CUDA's")
@pytest.mark.parametrize("vocab", [1000, 16384], ids=["fp32-sum", "target-rows"])
def test_the_chunked_heads_gradients_are_scaled_by_the_fp32_factor_on_cuda(vocab):
    """A loss times 1/3 (three accumulation steps) on CUDA: each gradient is the unscaled one
    times the fp32 factor, rounded once, as the plain head's are (with either weight-gradient
    sum: the vocabularies choose them)."""
    from remat.head.chunked_loss import chunked_cross_entropy
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 64, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(vocab, 64, generator=g) / 8).bfloat16().cuda().requires_grad_()
    targets = torch.randint(0, vocab, (300,), generator=g).cuda()
    unscaled = torch.autograd.grad(chunked_cross_entropy(h, w, None, targets, chunk_tokens=128), (h, w))
    scaled = torch.autograd.grad(chunked_cross_entropy(h, w, None, targets, chunk_tokens=128) / 3, (h, w))
    for one, third in zip(unscaled, scaled):
        assert torch.equal(third, (one.float() * FACTOR.cuda()).bfloat16())
