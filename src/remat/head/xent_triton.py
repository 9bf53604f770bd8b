"""The chunk kernel on CUDA as one Triton program a row: the logits read from memory once, the gradient written once.

It computes what :func:`remat.head.xent_kernel.softmax_xent` computes (the chunk's loss summed over
its valid rows; the logits turned into ``(softmax - onehot) * pre`` in place) and, where asked,
copies the gradient's columns at the batch's target rows out for the target-rows weight-gradient
sum (:class:`remat.head.chunked_loss._TargetRows`).

Why by hand: inductor compiles ``softmax_xent`` into a reduction kernel and a pointwise one, which
read each chunk's logits from memory twice, and the target columns were then gathered by
``index_select``, a third read. One read makes this kernel faster than inductor's pair, and the
gather inside it costs almost nothing more (measured: ``docs/history.md``).

How: one program per row (the grid is the rows, so no shape recompiles and rows need no padding):

1. a loop over the row, ``BLOCK`` columns at a time, keeps the running maximum and the sum of
   exponentials below it (the online softmax): one read from memory;
2. the loss is the log-sum-exp minus the target's logit;
3. a second loop reads the row again, from L2, and writes ``exp(x - max) * (weight / sum)``, minus
   ``weight`` at the target, over it, in fp32 rounded once; the sum's order differs from the
   compiled kernel's, so a few elements differ by one rounding;
4. with a gather, after a barrier, it reads the row's gradient back at the target rows' columns
   and stores them contiguously (storing them scattered from the column loop was slower).

A valid target outside ``[0, vocab)`` gives a NaN loss (the eager path raises an IndexError).
Triton compiles the kernel once per logits dtype, vocabulary and gather on or off, at first use.
"""
from __future__ import annotations

import functools

import torch

from remat import caches

GATHER_BLOCK = 1024    # target columns copied per step of the gather loop


def available() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def compile_errors() -> tuple:
    """Triton's exceptions for a kernel it cannot build or launch on this GPU (empty without Triton)."""
    found = []
    try:
        from triton.compiler.errors import CompilationError
        found.append(CompilationError)
    except ImportError:
        pass
    try:
        from triton.runtime.errors import OutOfResources
        found.append(OutOfResources)
    except ImportError:
        pass
    return tuple(found)


def xent_rows(z, y, ignore_index: int, pre, gather=None):
    """The loss of one chunk's logits ``z`` [rows x vocab], which become their gradient in place.
    ``y``: the rows' targets; ``pre``: the 0-dim fp32 factor of the gradient. ``gather``:
    ``(columns, out)``, and ``out[r, j]`` becomes the gradient at ``z[r, columns[j]]`` for the
    first ``out.shape[0]`` rows."""
    kernel = _kernel()
    rows, vocab = z.shape
    block = min(32768, _next_power_of_two(vocab))
    losses = torch.empty(rows, dtype=torch.float32, device=z.device)
    columns, out = gather if gather is not None else (y, z)  # placeholders the kernel never reads
    with torch.cuda.device(z.device):
        kernel[(rows,)](z, z.stride(0), y, pre, losses, columns, out, out.stride(0), out.shape[0],
                        columns.numel(), vocab, ignore_index, BLOCK=block, GATHER=gather is not None,
                        GATHER_BLOCK=GATHER_BLOCK, num_warps=min(32, max(4, block // 1024)))
    return losses.sum()


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@caches.register
@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, defined on first use (importing Triton only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["out_stride", "out_rows", "n_columns"])
    def softmax_xent_rows(z_ptr, z_stride, y_ptr, pre_ptr, loss_ptr, columns_ptr, out_ptr, out_stride, out_rows,
                          n_columns, vocab, ignore_index, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                          GATHER_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * z_stride
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        offsets = tl.arange(0, BLOCK)
        top = float("-inf")
        total = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            x = tl.load(z_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
        in_range = (y >= 0) & (y < vocab)
        target = tl.load(z_row + y, mask=valid & in_range, other=0.0).to(tl.float32)
        target = tl.where(in_range, target, float("nan"))
        tl.store(loss_ptr + row, tl.where(valid, top + tl.log(total) - target, 0.0))
        weight = tl.where(valid, tl.load(pre_ptr), 0.0)
        scale = weight / total
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            inside = cols < vocab
            x = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.exp(x - top) * scale
            tl.store(z_row + cols, tl.where(cols == y, p - weight, p).to(z_ptr.dtype.element_ty), mask=inside)
        if GATHER:
            if row < out_rows:
                tl.debug_barrier()  # the row's gradient, stored by every thread above, is read back
                out_row = out_ptr + row * out_stride
                for start in range(0, n_columns, GATHER_BLOCK):
                    j = start + tl.arange(0, GATHER_BLOCK)
                    inside = j < n_columns
                    col = tl.load(columns_ptr + j, mask=inside, other=0)
                    tl.store(out_row + j, tl.load(z_row + col, mask=inside), mask=inside)

    return softmax_xent_rows
