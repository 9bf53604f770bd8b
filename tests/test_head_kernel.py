"""The fused chunk kernel's shape-stable padding and its error handling (issue 11), on CPU.

The kernel is compiled only on CUDA; here its function runs uncompiled, which is what the
padding and the fallback rules are about. tests/test_gpu_head.py checks the compiled one.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

# private names of chunked_loss below (_accumulate, _TargetRows ...): the loss op's parts, checked one at a time
from remat.head import chunked_loss, xent_kernel
from remat.head.chunked_loss import chunked_cross_entropy
from remat.head.xent_kernel import eager_kernel, kernel_rows, run_fused, softmax_xent


def _chunk(rows, vocab=53, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[::5] = -100
    return z, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_add_nothing_to_the_kernels_loss_and_gradient(dtype):
    z, y = _chunk(37, dtype=dtype)
    pre = torch.tensor(1 / 29.0)
    padded_g = torch.cat([z, torch.zeros(91, z.shape[1], dtype=dtype)])
    eager_g = z.clone()
    g = z  # the kernels turn the logits into their gradient in place
    loss = softmax_xent(g, y, -100, pre)
    padded_loss = softmax_xent(padded_g, F.pad(y, (0, 91), value=-100), -100, pre)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    assert torch.equal(padded_g[:37], g)  # rows are independent: the same ops, the same bits
    assert torch.equal(padded_g[37:], torch.zeros_like(padded_g[37:]))
    assert g.sum(1).abs().max() < 1e-2  # a gradient now (each valid row sums to 0), not logits
    eager_loss = eager_kernel(eager_g, y, -100, pre)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(g.float(), eager_g.float(), rtol=1e-5, atol=1e-7 if dtype == torch.float32 else 1e-2)


def _loss_and_grads(monkeypatch, kernel, n, chunk, bias=True):
    g = torch.Generator().manual_seed(n)
    h = torch.randn(n, 16, generator=g, requires_grad=True)
    w = (torch.randn(61, 16, generator=g) / 4).requires_grad_()
    b = torch.randn(61, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, 61, (n,), generator=g)
    targets[::3] = -100
    with monkeypatch.context() as m:
        m.setattr(chunked_loss, "fused_kernel", lambda device: kernel)
        loss = chunked_cross_entropy(h, w, b, targets, chunk_tokens=chunk)
    loss.backward()
    return [loss.detach()] + [t.grad for t in (h, w, b) if t is not None]


@pytest.mark.parametrize("n, chunk", [(135, 37), (20, 37), (74, 37), (300, 256), (1, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_loss_through_the_padded_kernel_path_matches_the_eager_path(monkeypatch, n, chunk, bias):
    shapes = []

    def kernel(z, y, ignore_index, pre, gather=None):  # the fused path's kernel, run uncompiled
        shapes.append(tuple(z.shape))
        assert gather is None  # an fp32 head sums its weight gradient in fp32: no columns to copy
        return softmax_xent(z, y, ignore_index, pre)

    padded = _loss_and_grads(monkeypatch, kernel, n, chunk, bias)
    eager = _loss_and_grads(monkeypatch, None, n, chunk, bias)
    for a, b in zip(padded, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)  # n=1: no valid target
    assert set(shapes) == {(kernel_rows(n, chunk), 61)}  # one shape, the tail padded to it


def test_kernel_rows_are_few_shapes():
    assert {kernel_rows(n, 2048) for n in range(1, 20000, 7)} == {128, 256, 512, 1024, 2048}
    assert {kernel_rows(n, 37) for n in range(1, 500)} == {37}
    assert kernel_rows(5, 1000) == 128 and kernel_rows(129, 1000) == 256 and kernel_rows(999, 1000) == 1000


@pytest.fixture
def kernel_state(fresh_caches):
    """The kernel registry empty, as in a new process; the test supplies the compiled function."""
    return xent_kernel


def _backend_failed(inner):
    """A BackendCompilerFailed around ``inner``, whichever constructor this torch has."""
    from torch._dynamo.exc import BackendCompilerFailed
    try:
        return BackendCompilerFailed(softmax_xent, inner, None)
    except TypeError:  # torch 2.6: (backend_fn, inner_exception)
        return BackendCompilerFailed(softmax_xent, inner)


def _raising(error, calls):
    def compiled(z, y, ignore_index, pre):
        calls.append(tuple(z.shape))
        raise error
    return compiled


def test_out_of_memory_inside_the_kernel_propagates(kernel_state):
    z, y = _chunk(8)
    calls = []
    kernel_state.KERNEL["fn"] = _raising(torch.OutOfMemoryError("CUDA out of memory (test)"), calls)
    with pytest.raises(torch.OutOfMemoryError):
        run_fused(z, y, -100, torch.tensor(1.0))
    # an out-of-memory error that a compile error wraps (autotuning) is not a compile failure
    from torch._dynamo.exc import BackendCompilerFailed
    wrapped = _backend_failed(torch.OutOfMemoryError("CUDA out of memory (test)"))
    kernel_state.KERNEL["fn"] = _raising(wrapped, calls)
    with pytest.raises(BackendCompilerFailed):
        run_fused(z, y, -100, torch.tensor(1.0))
    # errors unrelated to compiling propagate too
    kernel_state.KERNEL["fn"] = _raising(RuntimeError("device-side assert triggered (test)"), calls)
    with pytest.raises(RuntimeError, match="device-side assert"):
        run_fused(z, y, -100, torch.tensor(1.0))
    assert len(calls) == 3 and not kernel_state.EAGER_SHAPES and not kernel_state.OUT_SHAPES  # nothing switched off


def _compile_errors():
    from torch._dynamo import exc
    return {
        "backend": _backend_failed(RuntimeError("Cannot find a working triton")),
        "recompile_limit": exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True"),
        "no_triton": ImportError("No module named 'triton'"),
    }


@pytest.mark.parametrize("out_of_place_compiles", [True, False])
@pytest.mark.parametrize("kind", ["backend", "recompile_limit", "no_triton"])
def test_a_compile_error_falls_back_for_that_shape_only_with_one_warning(kernel_state, kind, out_of_place_compiles):
    """A shape whose in-place kernel does not compile uses the out-of-place one (one warning);
    where that does not compile either, the eager ops (a second warning). Other shapes keep
    the in-place kernel, and a shape is never tried again."""
    error = _compile_errors()[kind]
    calls = []

    def in_place(z, y, ignore_index, pre):
        calls.append(("in place", tuple(z.shape)))
        if z.shape[0] == 8:
            raise error
        return softmax_xent(z, y, ignore_index, pre)

    def out_of_place(z, y, ignore_index, pre):
        calls.append(("out of place", tuple(z.shape)))
        if not out_of_place_compiles:
            raise error
        return xent_kernel.softmax_xent_out(z, y, ignore_index, pre)

    kernel_state.KERNEL.update(fn=in_place, out=out_of_place)
    z, y = _chunk(8)
    pre = torch.tensor(0.25)
    expected_g = z.clone()
    expected_loss = eager_kernel(expected_g, y, -100, pre)
    g = z.clone()
    with pytest.warns(UserWarning, match=type(error).__name__) as caught:
        loss = run_fused(g, y, -100, pre)
    assert len(caught) == (1 if out_of_place_compiles else 2) and "[8, 53]" in str(caught[0].message)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(g, expected_g, rtol=1e-6, atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_fused(z.clone(), y, -100, pre)  # the same shape: not tried again, no warning
        z16, y16 = _chunk(16)
        run_fused(z16, y16, -100, pre)      # another shape still uses the in-place kernel
    tried_twice = [("out of place", (8, 53))] if out_of_place_compiles else []
    assert calls == [("in place", (8, 53)), ("out of place", (8, 53))] + tried_twice + [("in place", (16, 53))]
    assert list(kernel_state.OUT_SHAPES) == [((8, 53), torch.float32, "cpu")]
    assert bool(kernel_state.EAGER_SHAPES) is not out_of_place_compiles


def test_the_kernels_copied_columns_feed_the_target_rows(kernel_state, monkeypatch):
    """Through the fused path (run uncompiled here, as on CUDA where Triton does not build) a
    bf16 head with target rows gets the columns of its targets copied out by the kernel's
    caller, not by the accumulator: the gradients equal the eager path's, where it gathers."""
    kernel_state.KERNEL.update(fn=softmax_xent, triton=None)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(700, 32, generator=g).bfloat16()
    w = (torch.randn(20000, 32, generator=g) / 4).bfloat16()
    targets = torch.randint(0, 20000, (700,), generator=g)
    targets[::3] = -100
    gathers, grads = [], []
    for kernel in (run_fused, None):
        with monkeypatch.context() as m:
            m.setattr(chunked_loss, "fused_kernel", lambda device: kernel)
            m.setattr(chunked_loss._TargetRows, "add", lambda self, g, hc, gathered=False, f=chunked_loss._TargetRows.add:
                      gathers.append(gathered) or f(self, g, hc, gathered))
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            chunked_cross_entropy(hh, ww, None, targets, chunk_tokens=128).backward()
        grads.append((hh.grad, ww.grad))
    assert gathers == [True] * 6 + [False] * 6
    for fused, eager in zip(*grads):
        torch.testing.assert_close(fused.float(), eager.float(), rtol=2 ** -7, atol=1e-6)


def test_the_fused_kernel_is_for_cuda_only():
    assert xent_kernel.fused_kernel(torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_accumulates_in_fp32_to_the_product(dtype):
    """``_accumulate`` adds ``a @ b`` to the fp32 accumulator: exact in fp32, and in bf16 the
    per-chunk product rounds at most once (the CPU path: no ``out_dtype`` kernel there)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 32, generator=g).to(dtype), torch.randn(32, 48, generator=g).to(dtype)
    acc = torch.randn(64, 48, generator=g)
    expected = acc + a.double().mm(b.double()).float()
    chunked_loss._accumulate(acc, a, b)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(acc, expected, rtol=tol, atol=tol * 8)
    assert chunked_loss._fp32_out(torch.device("cpu")) is False  # the probe's answer off CUDA


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_accumulator_in_blocks_equals_one_product(monkeypatch, weight_dtype):
    """Row blocks of the fp32 accumulator (forced small here: 7 rows of 61) add up to one
    whole ``g^T @ h``; ``finish`` gives them in the weight's dtype and frees each fp32 block."""
    monkeypatch.setattr(chunked_loss, "_PIECE_BYTES", 7 * 4 * 16)
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(rows, 61, generator=g) for rows in (37, 37, 20)]
    hidden = [torch.randn(rows, 16, generator=g) for rows in (37, 37, 20)]
    acc = chunked_loss._Accumulator((61, 16), torch.device("cpu"))
    assert [p.shape[0] for p in acc.pieces] == [7] * 8 + [5]
    for gc, hc in zip(grads, hidden):
        acc.add(gc, hc)
    expected = sum(gc.double().t() @ hc.double() for gc, hc in zip(grads, hidden))
    blocks = acc.finish(weight_dtype)
    assert acc.pieces == [] and {b.dtype for b in blocks} == {weight_dtype}
    whole = chunked_loss._scaled(blocks, torch.tensor(0.5), weight_dtype)
    tol = 1e-5 if weight_dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(whole.double(), expected * 0.5, rtol=tol, atol=tol)


def test_chunked_loss_gradients_hold_under_retain_graph_and_a_second_backward():
    """The weight gradient's blocks are saved tensors: a second backward through the same
    graph (``retain_graph=True``) gives the same gradients again."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = (torch.randn(61, 16, generator=g) / 4).requires_grad_()
    targets = torch.randint(0, 61, (50,), generator=g)
    loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=16)
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss * 2, (h, w))
    for a, b in zip(first, second):
        torch.testing.assert_close(b, 2 * a)


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.slow
@pytest.mark.parametrize("device", _DEVICES)
def test_inductor_compiled_kernel_writes_the_same_gradient_in_place(device):
    """The kernel as it runs on CUDA, compiled by inductor: it mutates its logits argument into
    the gradient, and that must survive functionalization unchanged, with no chunk-sized buffer.

    On CUDA (what the head runs) it must compile. On the CPU, inductor's scheduler of torch 2.6
    and of torch 2.11 fails on the in-place store (``KeyError: 'buf3'``; torch 2.13's compiles
    it): there the out-of-place kernel, what the runtime falls back to, must compile and agree."""
    import math
    import re
    from torch._inductor.utils import run_and_get_code
    compiled = torch.compile(softmax_xent, dynamic=False, fullgraph=True)
    z, y = _chunk(64, vocab=300, dtype=torch.bfloat16, seed=6)
    z, y = z.to(device), y.to(device)
    pre = torch.tensor(1 / 50.0, device=device)
    ours, eager = z.clone(), z.clone()
    try:
        loss, code = run_and_get_code(compiled, ours, y, -100, pre)
    except Exception as error:  # noqa: BLE001 - only inductor's known scheduler KeyError is let through
        if device != "cpu" or "KeyError" not in str(error):
            raise
        loss, g = torch.compile(xent_kernel.softmax_xent_out, dynamic=False, fullgraph=True)(ours, y, -100, pre)
        ours.copy_(g)
        code = None
    if code is not None:
        # no chunk-sized buffer: the gradient is stored straight into the logits (a scatter
        # after the pointwise pass made inductor allocate a (64, 300) temporary)
        shapes = re.findall(r"empty_strided\w*\(\(([\d, ]*)\)", "\n".join(code))
        sizes = [math.prod(int(v) for v in shape.split(",") if v.strip()) for shape in shapes]
        assert sizes and max(sizes) < 64 * 300, shapes
    expected = eager_kernel(eager, y, -100, pre)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.float(), eager.float(), rtol=0, atol=2 ** -9)


def test_eager_path_works_on_blocks_of_rows_in_place(monkeypatch):
    """The eager kernel turns the logits into their gradient a block of rows at a time (here
    blocks of 3 rows): the same loss and gradient as one block of all rows."""
    z, y = _chunk(37, dtype=torch.bfloat16, seed=7)
    pre = torch.tensor(1 / 29.0)
    whole = z.clone()
    expected = eager_kernel(whole, y, -100, pre)
    monkeypatch.setattr(xent_kernel, "EAGER_BLOCK_BYTES", 3 * 4 * z.shape[1])
    blocks = z.clone()
    loss = eager_kernel(blocks, y, -100, pre)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert torch.equal(blocks, whole) and not torch.equal(blocks, z)
