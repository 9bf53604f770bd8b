"""One chunk of the chunked cross-entropy: its summed loss, and its logits turned into their gradient in place.

:mod:`remat.head.chunked_loss` walks the hidden states a chunk of rows at a time; for each
chunk's logits ``z`` this module computes ``sum(logsumexp(x) - x[target])`` over the valid rows
and rewrites ``z`` as ``(softmax(x) - onehot) * pre`` (``x = z.float()``), so one chunk-sized
buffer serves both the logits and their gradient.

How: on CUDA, one hand-written Triton kernel (:mod:`remat.head.xent_triton`) reads the logits
from memory once and writes the gradient once, and copies out the target rows' columns the
weight-gradient sum wants (``gather``). Where it does not build (warned once), one kernel
compiled by inductor (:func:`softmax_xent`, ``torch.compile(dynamic=False, fullgraph=True)``)
reads the logits three times and writes the gradient once, and ``index_select`` gathers the
columns; the eager ops (:func:`row_losses`) materialise the fp32 logits and pass over them
about ten times. The compiled kernel is kept shape-stable by the caller (the Triton kernel's
grid is the rows: it needs no padding, and takes the padded rows as they come): the last
chunk's logits are padded to the chunk size (:func:`padded_logits`; padded rows have ignored
targets, so they add zero to the loss and the gradients), and a batch shorter than one chunk
is padded to the next power of two (:func:`kernel_rows`: at least 128 rows, at most the
chunk), so one compile serves every sequence length of a run and a handful serve short
batches. Only compile errors (dynamo and inductor failures, a missing Triton, the recompile
limit) fall back, for that shape only, with one warning that says why (:func:`run_fused`): to
the same kernel writing its gradient out of place (:func:`softmax_xent_out`: torch 2.6's
inductor cannot compile the in-place one), then to the eager ops (:func:`eager_kernel`, a
block of rows at a time); anything else, an out-of-memory error included, propagates. Off
CUDA, and where neither Triton nor dynamo works, the eager ops run.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from remat import caches
from remat.head import xent_triton

ROUND = 128  # the fewest rows the kernel is compiled for (and the chunk sizes' multiple)
EAGER_BLOCK_BYTES = 2 ** 27  # the eager path's fp32 copy of the logits, a block of rows at a time


def row_losses(x, y, ignore_index, pre, want):
    """Summed loss of one chunk; if ``want``, ``x`` becomes ``(softmax - onehot) * pre``
    in place (rows of ignored targets zero)."""
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    picked = x.gather(1, safe[:, None]).squeeze(1)
    m = x.amax(1, keepdim=True)
    x.sub_(m).exp_()
    s = x.sum(1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    if want:  # one pass: softmax and the 1/N scale together, then the one-hot at the targets
        weight = valid.to(x.dtype) * pre
        x.mul_(weight[:, None] / s)
        x.scatter_add_(1, safe[:, None], -weight[:, None])
    return loss


def softmax_xent(z, y, ignore_index: int, pre):
    """The loss of one chunk; ``z`` (the logits) becomes ``(softmax - onehot) * pre`` in
    place, so one chunk-sized buffer serves both. One function for ``torch.compile`` to
    fuse: it reads the chunk's logits three times and writes the gradient once, where the
    eager ops of :func:`row_losses` materialise the fp32 logits and pass over them about ten
    times (measured: the head's elementwise work is the difference between the chunked and
    the plain head's speed).

    The gradient is one pointwise expression of the logits and per-row values (the target
    column's ``p_t * w - w`` chosen by comparing column indices: the same fp32 operations
    as the eager path, rounded once), so inductor stores it straight into the logits'
    buffer; a scatter afterwards would make it materialise a chunk-sized temporary first."""
    loss, g = _xent_gradient(z, y, ignore_index, pre)
    z.copy_(g)  # one pointwise pass: inductor writes it into z
    return loss


def softmax_xent_out(z, y, ignore_index: int, pre):
    """:func:`softmax_xent` returning the gradient as a new tensor: for an inductor that
    fails to compile the in-place store (torch 2.6: a ``KeyError`` in its scheduler). It needs
    one more chunk-sized buffer."""
    loss, g = _xent_gradient(z, y, ignore_index, pre)
    return loss, g.to(z.dtype)


def _xent_gradient(z, y, ignore_index: int, pre):
    """The chunk's summed loss and ``(softmax - onehot) * pre`` (fp32, as one expression)."""
    x = z.float()
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    m = x.amax(1, keepdim=True)
    s = torch.exp(x - m).sum(1, keepdim=True)
    picked = x.gather(1, safe[:, None])
    lse = (m + s.log()).squeeze(1)
    loss = torch.where(valid, lse - picked.squeeze(1), torch.zeros_like(lse)).sum()
    weight = (valid.to(torch.float32) * pre)[:, None]
    scale = weight / s
    p = torch.exp(x - m) * scale
    at_target = torch.arange(z.shape[1], device=z.device)[None, :] == safe[:, None]
    return loss, torch.where(at_target, p - weight, p)


def eager_kernel(z, y, ignore_index: int, pre):
    """What the fused kernel computes, by the eager ops: the CPU's path, the fallback where
    the kernel does not compile, and what a fake-tensor profile measures. It works on a
    block of rows at a time, so beside the logits it needs one block's fp32 copy
    (``EAGER_BLOCK_BYTES``, 256 rows at a 128k vocabulary): the chunk's memory is about the
    fused kernel's, which keeps nothing chunk-sized beside the logits."""
    rows = max(1, EAGER_BLOCK_BYTES // (4 * max(z.shape[1], 1)))
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32   # a float64 model's sums stay float64
    loss = torch.zeros((), dtype=dtype, device=z.device)
    for r in range(0, z.shape[0], rows):
        x = z[r:r + rows].to(dtype)
        loss += row_losses(x, y[r:r + rows], ignore_index, pre, True)
        z[r:r + rows] = x
    return loss


def shape_kernel(z, y, ignore_index: int, pre):
    """What a fake-tensor profile runs for the chunk: the fused kernel's footprint, not its values.

    The GPU's Triton kernel reads the logits once and writes their gradient in place; one
    in-place op over ``z`` that reads it twice (read and write) stands in for its time, with the
    loss a zero. Its memory is the most either path takes beside the logits: one block's fp32 copy
    of :func:`eager_kernel` (the CPU's and the fallback's; the Triton kernel takes none), made and
    dropped once. Running :func:`eager_kernel` itself would cost a fake op per op per block: seconds
    of profiling per chunk size at a million tokens."""
    rows = min(z.shape[0], max(1, EAGER_BLOCK_BYTES // (4 * max(z.shape[1], 1))))
    # the block's fp32 copy and the per-row vectors row_losses holds beside it (valid, safe,
    # picked, max, sum, log-sum-exp, the loss terms, weight, its scale), each its own allocation
    block = [z[:rows].float(), y[:rows] != ignore_index, torch.empty(rows, dtype=torch.long, device=z.device),
             *(torch.empty(rows, dtype=torch.float32, device=z.device) for _ in range(8))]
    del block
    z.add_(z)
    return torch.zeros((), dtype=torch.float32, device=z.device)


def kernel_rows(n: int, chunk: int) -> int:
    """Rows of every logits block the kernel sees: the chunk, or for a batch shorter than
    one chunk the next power of two (at least ``ROUND``), so few shapes ever compile."""
    if n >= chunk:
        return chunk
    return min(chunk, max(ROUND, 1 << (max(n, 1) - 1).bit_length()))


def padded_logits(hc, w, b, rows: int):
    """``F.linear(hc, w, b)`` with zero rows below it up to ``rows`` (one buffer, no copy)."""
    m = hc.shape[0]
    if m == rows:
        return F.linear(hc, w, b)
    z = torch.empty(rows, w.shape[0], dtype=hc.dtype, device=hc.device)
    if b is None:
        torch.mm(hc, w.t(), out=z[:m])
    else:
        torch.addmm(b, hc, w.t(), out=z[:m])
    z[m:].zero_()
    return z


KERNEL = caches.register({}, "head.xent_kernel.KERNEL")  # "fn" / "out": the compiled softmax_xent / softmax_xent_out, made on first use
OUT_SHAPES = caches.register({}, "head.xent_kernel.OUT_SHAPES")  # (shape, dtype, device) -> why the in-place kernel is not used for it
EAGER_SHAPES = caches.register({}, "head.xent_kernel.EAGER_SHAPES")  # (shape, dtype, device) -> why no compiled kernel is used for it


def fused_kernel(device):
    """The fused chunk kernel for ``device`` (CUDA, with Triton or a working ``torch.compile``),
    or None: the eager ops then."""
    if device.type != "cuda":
        return None
    if "fn" not in KERNEL:
        import torch._dynamo
        KERNEL["triton"] = xent_triton.xent_rows if xent_triton.available() else None
        if not torch._dynamo.is_dynamo_supported():
            KERNEL["fn"] = None
            if KERNEL["triton"] is None:
                warnings.warn("remat: neither Triton nor torch.compile works here, so the chunked loss uses "
                              "its eager path (correct, slower)", stacklevel=4)
        else:
            KERNEL["fn"] = torch.compile(softmax_xent, dynamic=False, fullgraph=True)
            KERNEL["out"] = torch.compile(softmax_xent_out, dynamic=False, fullgraph=True)
    return None if KERNEL["fn"] is None and KERNEL.get("triton") is None else run_fused


def run_fused(z, y, ignore_index: int, pre, gather=None):
    """The chunk's loss, its logits ``z`` turned into their gradient in place, and with
    ``gather = (columns, out)`` the gradient's ``columns`` copied into ``out`` (its first
    ``out.shape[0]`` rows): by the Triton kernel (:mod:`remat.head.xent_triton`); where that does
    not build, the compiled in-place kernel; for a shape that cannot compile, the compiled
    out-of-place one; for a shape neither compiles, the eager ops (each step down warned once,
    the Triton kernel's for the process, the others' a shape)."""
    if KERNEL.get("triton") is not None:
        try:
            return KERNEL["triton"](z, y, ignore_index, pre, gather)
        except xent_triton.compile_errors() as error:
            KERNEL["triton"] = None
            compile_failure(error, "the Triton chunked-loss kernel", "chunks use the inductor-compiled kernel")
    loss = _compiled_or_eager(z, y, ignore_index, pre)
    if gather is not None:
        columns, out = gather
        torch.index_select(z[:out.shape[0]], 1, columns, out=out)
    return loss


def _compiled_or_eager(z, y, ignore_index: int, pre):
    key = (tuple(z.shape), z.dtype, str(z.device))
    what = f"the fused chunked-loss kernel for {list(z.shape)} {z.dtype} logits"
    if KERNEL.get("fn") is not None and key not in OUT_SHAPES:
        try:
            return KERNEL["fn"](z, y, ignore_index, pre)
        except compile_errors() as error:
            OUT_SHAPES[key] = compile_failure(error, what, "chunks of this shape use one more chunk-sized buffer "
                                                           "than planned (the out-of-place kernel)")
    if KERNEL.get("out") is not None and key not in EAGER_SHAPES:
        try:
            loss, g = KERNEL["out"](z, y, ignore_index, pre)
            z.copy_(g)
            return loss
        except compile_errors() as error:
            EAGER_SHAPES[key] = compile_failure(error, what, "chunks of this shape use the eager path, which is "
                                                             "correct but slower")
    return eager_kernel(z, y, ignore_index, pre)


def compile_failure(error, what: str, instead: str) -> str:
    """Why ``what`` did not compile, warned once with what runs ``instead``; an out-of-memory
    error inside the compile propagates."""
    if _out_of_memory(error):
        raise error
    why = f"{type(error).__name__}: {str(error).strip()[:300]}"
    warnings.warn(f"remat: {what} could not be compiled ({why}); {instead}", stacklevel=3)
    return why


def compile_errors() -> tuple:
    """Exceptions that mean "could not compile": dynamo and inductor failures (a missing or
    too old Triton arrives as BackendCompilerFailed), the recompile limit, a missing module."""
    from torch._dynamo import exc
    return (exc.BackendCompilerFailed, exc.Unsupported, exc.FailOnRecompileLimitHit, ImportError)


def _out_of_memory(error) -> bool:
    # a compile error may wrap an out-of-memory one (autotuning): that is not a compile failure
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False
