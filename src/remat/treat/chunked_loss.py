"""Cross-entropy of a linear head, a chunk of rows at a time: the [rows x vocab] logits never exist.

This module is the loss op alone (torch only; it knows nothing of Hugging Face; the model
integration is :mod:`remat.treat.head`). :func:`chunked_cross_entropy` walks the hidden
states ``chunk_tokens`` rows at a time:

    z = h_c @ W^T (+ b)           in the compute dtype (the head's, or autocast's)
    x = transform(z).float()      an optional logit transform (soft-capping, scaling)
    loss += sum over valid rows of logsumexp(x) - x[target]
    g = (softmax(x) - onehot) / N  cast back to the compute dtype, through ``transform``
    grad_h[c] = g @ W;  grad_W += g^T @ h_c (fp32);  grad_b += sum(g)

All gradients are finished inside the forward loop, because the gradient of a
cross-entropy with respect to its logits is known the moment the loss is. Backward only
multiplies the stored ``grad_h`` / ``grad_W`` / ``grad_b`` by the incoming scalar. The
obvious alternative, each chunk's loss under ``torch.utils.checkpoint``, recomputes the
chunk's logits in backward: a second [tokens x hidden x vocab] matmul, measured at 0.75x
(DESIGN.md). Here the head costs the same three matmuls as the plain path. The peak is
one chunk's logits (the fused kernel turns them into their gradient in place) plus the
fp32 weight-gradient accumulator and ``grad_h``: it grows with the chunk, not with
tokens x vocab. The accumulator is kept in row blocks so that, at the end of the forward,
it becomes the weight's dtype one block at a time (half the bytes until backward, and never
fp32 and narrow copies of the whole at once); backward only scales it. Where the scale
(the incoming gradient, e.g. 1 / accumulation steps) is not a power of two this rounds
twice, to the weight's dtype and after scaling, a difference far below the bf16 inputs'
own rounding (tests/test_head.py compares with the plain path).

N is ``num_items_in_batch`` if given, else the number of non-ignored targets. With no
valid target (every target ignored, or N = 0) the loss is what ``sum / N`` gives, nan
(or inf) as in ``torch.nn.functional.cross_entropy``, and every gradient is finite: 1/N is
taken as 0, so rows contribute exactly zero, as they do in the plain path, where the
ignored rows' gradients are zeros (an SFT batch whose completion mask is empty must not
turn the weights into NaN at the next optimizer step). Where N = 0 but some target is
valid, the plain path's gradient is infinite and ours is zero.

On CUDA, with no transform, each chunk's softmax and gradient run as one compiled
kernel (:func:`_softmax_xent`, ``torch.compile(dynamic=False, fullgraph=True)``). It is
kept shape-stable: the last chunk's logits are padded to the chunk size (padded rows
have ignored targets, so they add zero to the loss and the gradients), and a batch
shorter than one chunk is padded to the next power of two (at least 128, at most the
chunk), so one compile serves every sequence length of a run and a handful serve short
batches. Only compile errors (dynamo/inductor failures, a missing Triton, the recompile
limit) fall back, for that shape only, with one warning that says why: to the same kernel
writing its gradient out of place (torch 2.6's inductor cannot compile the in-place one),
then to the eager path; anything else, an out-of-memory error included, propagates.

Limits: rounding follows the plain path (logits in the compute dtype, then ``.float()``);
fp16 gradients are scaled by 1/N only in backward, so they do not underflow under a
GradScaler. The loop is Python: not meant to be traced by ``torch.compile`` (the model
integration runs it outside the user's compiled graph).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_GiB = 2 ** 30
_ROUND = 128            # chunk sizes are multiples of this (tensor-core friendly)
_MAX_CHUNK = 8192       # assumed: beyond this the matmuls gain no speed, only memory
_DEFAULT_LOGIT_BYTES = _GiB  # default chunk: its fp32 logits take about this much
_PIECE_BYTES = 2 ** 27  # the fp32 weight-gradient accumulator is kept in row blocks of about this size
_EAGER_BLOCK_BYTES = 2 ** 27  # the eager path's fp32 copy of the logits, a block of rows at a time


def default_chunk_tokens(vocab: int) -> int:
    """The chunk whose fp32 logits take about 1 GiB: 2048 tokens at a 128k vocabulary."""
    rows = _DEFAULT_LOGIT_BYTES // (4 * max(int(vocab), 1))
    return int(min(_MAX_CHUNK, max(_ROUND, rows // _ROUND * _ROUND)))


def chunked_cross_entropy(hidden, weight, bias, targets, *, chunk_tokens=None, ignore_index=-100,
                          num_items_in_batch=None, transform=None, compute_dtype=None):
    """``sum(CE(transform(hidden @ weight.T + bias).float(), targets)) / N``, chunked.

    ``targets`` are already aligned with ``hidden`` rows (shift them first for causal
    LMs). N is ``num_items_in_batch`` if given, else the count of non-ignored targets.
    ``transform`` maps logits to logits in their own dtype (e.g. soft-capping).
    """
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.numel() != hidden2.shape[0]:
        raise ValueError(f"{targets.numel()} targets for {hidden2.shape[0]} hidden-state rows; "
                         "they must match (is logits_to_keep set while training?)")
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    cd = compute_dtype or compute_dtype_of(hidden, weight)
    chunk = int(chunk_tokens or default_chunk_tokens(weight.shape[0]))
    if chunk <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    return _ChunkedLoss.apply(hidden2, weight, bias, targets, divisor, chunk, int(ignore_index),
                              transform, cd)


def compute_dtype_of(hidden, weight):
    """The dtype the head's matmul runs in: autocast's if it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk, ignore_index, transform, cd):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want = want_h or want_w or want_b
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        n, hsize = hidden.shape
        # 1/N, and 0 for N = 0: no valid row then, and every gradient stays a finite zero
        inv = torch.where(divisor != 0, 1.0 / divisor, torch.zeros_like(divisor))
        # fp16 cannot hold (softmax - onehot) / N for large N: scale by 1/N in backward there.
        pre, post = (torch.ones_like(inv), inv) if cd == torch.float16 else (inv, torch.ones_like(inv))
        kernel = _fused_kernel(hidden.device) if transform is None and want else None
        rows = _kernel_rows(n, chunk) if kernel is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            grad_h = torch.empty(n, hsize, dtype=cd, device=h.device) if want_h else None
            acc_w = _Accumulator(weight.shape, h.device) if want_w else None
            acc_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if want_b else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                hc, yc = h[s:s + chunk], targets[s:s + chunk]
                m = hc.shape[0]
                if kernel is not None:
                    g = _padded_logits(hc, w, b, rows)  # the kernel turns the logits into their gradient
                    total += kernel(g, F.pad(yc, (0, rows - m), value=ignore_index), ignore_index, pre)
                    g = g[:m]  # the padded rows' gradient is zero
                elif transform is None and want:
                    g = F.linear(hc, w, b)  # in place again, a block of rows in fp32 at a time
                    total += _eager_kernel(g, yc, ignore_index, pre)
                elif transform is None:
                    total += _rows(F.linear(hc, w, b).float(), yc, ignore_index, pre, False)
                    g = None
                else:
                    # through the model's own ops, so rounding and derivative are its own
                    z = F.linear(hc, w, b).requires_grad_(want)
                    with torch.enable_grad():
                        x = transform(z).float()
                    total += _rows(x.detach(), yc, ignore_index, pre, want)
                    g = torch.autograd.grad(x, z, x.detach())[0] if want else None
                    del x, z
                if want_h:
                    torch.mm(g, w, out=grad_h[s:s + m])
                if want_w:
                    acc_w.add(g, hc)
                if want_b:
                    acc_b.add_(g.sum(0, dtype=torch.float32))
                del g
            # in the weight's own dtype from here to backward (half the bytes), except fp16,
            # whose unscaled sums may overflow: it waits for the scale in fp32
            grad_w = acc_w.finish(torch.float32 if cd == torch.float16 else weight.dtype) if want_w else None
        ctx.save_for_backward(grad_h, acc_b, post, *(grad_w or ()))
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, acc_b, post, *grad_w = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_loss.float() * post
        gh = (grad_h * scale).to(h_dtype) if grad_h is not None else None
        gw = _scaled(grad_w, scale, w_dtype) if grad_w else None
        gb = (acc_b * scale).to(b_dtype) if acc_b is not None else None
        return gh, gw, gb, None, None, None, None, None, None


class _Accumulator:
    """The fp32 weight gradient ``sum over chunks of g^T @ h``, kept as row blocks of about
    ``_PIECE_BYTES`` (128 MiB) instead of one tensor, so that turning it into the weight's
    dtype at the end of the forward (:meth:`finish`) frees each fp32 block as its narrow copy
    is made: 1x the fp32 bytes plus one block at the peak, not 1.5x."""

    def __init__(self, shape, device):
        rows, cols = shape
        step = max(1, _PIECE_BYTES // (4 * max(cols, 1)))
        self.pieces = [torch.zeros(min(step, rows - r), cols, dtype=torch.float32, device=device)
                       for r in range(0, rows, step)]

    def add(self, g, hc):
        """``+= g^T @ hc`` for one chunk: ``g`` [rows x vocab], ``hc`` [rows x hidden]."""
        start = 0
        for piece in self.pieces:
            _accumulate(piece, g[:, start:start + piece.shape[0]].t(), hc)
            start += piece.shape[0]

    def finish(self, dtype):
        """The blocks in ``dtype``, each fp32 block freed as soon as it is converted."""
        done = []
        while self.pieces:
            done.append(self.pieces.pop(0).to(dtype))
        return done


def _accumulate(acc, a, b):
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in the compute dtype.

    Where cuBLAS can write a half-precision product straight into an fp32 output
    (``torch.addmm(..., out_dtype=torch.float32)``, CUDA, torch >= 2.8: :func:`_fp32_out`),
    one GEMM accumulates in place: no [vocab x hidden] product in the compute dtype is
    materialised (0.5 GiB at a 128k vocabulary and hidden 2048), and each chunk's
    contribution is added unrounded. Elsewhere the product is formed in the compute
    dtype and added (the rounding the plain path's single weight-gradient GEMM has once
    happens once per chunk)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_out(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


_FP32_OUT = {}  # device type -> whether addmm(out_dtype=float32) works there


def _fp32_out(device) -> bool:
    """Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=torch.float32, out=fp32)`` runs on
    ``device`` and gives the fp32 product: probed once on small tensors (older torch has no
    ``out_dtype``: TypeError; a backend without the kernel: NotImplementedError/RuntimeError)."""
    if device.type not in _FP32_OUT:
        works = False
        if device.type == "cuda":
            a = torch.arange(-8, 8, device=device, dtype=torch.float32).reshape(4, 4).div_(7)
            acc = torch.ones(4, 4, device=device)
            try:
                torch.addmm(acc, a.bfloat16(), a.bfloat16(), out_dtype=torch.float32, out=acc)
                works = bool(torch.allclose(acc, 1 + a.bfloat16().float() @ a.bfloat16().float(), atol=1e-6))
            except (TypeError, NotImplementedError, RuntimeError):
                works = False
        _FP32_OUT[device.type] = works
    return _FP32_OUT[device.type]


def _rows(x, y, ignore_index, pre, want):
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


# ---------------------------------------------------------------- the fused chunk kernel

def _softmax_xent(z, y, ignore_index: int, pre):
    """The loss of one chunk; ``z`` (the logits) becomes ``(softmax - onehot) * pre`` in
    place, so one chunk-sized buffer serves both. One function for ``torch.compile`` to
    fuse: it reads the chunk's logits three times and writes the gradient once, where the
    eager ops of :func:`_rows` materialise the fp32 logits and pass over them about ten
    times (measured: the head's elementwise work is the difference between the chunked and
    the plain head's speed).

    The gradient is one pointwise expression of the logits and per-row values (the target
    column's ``p_t * w - w`` chosen by comparing column indices: the same fp32 operations
    as the eager path, rounded once), so inductor stores it straight into the logits'
    buffer; a scatter afterwards would make it materialise a chunk-sized temporary first."""
    loss, g = _xent_gradient(z, y, ignore_index, pre)
    z.copy_(g)  # one pointwise pass: inductor writes it into z
    return loss


def _softmax_xent_out(z, y, ignore_index: int, pre):
    """:func:`_softmax_xent` returning the gradient as a new tensor: for an inductor that
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


def _eager_kernel(z, y, ignore_index: int, pre):
    """What the fused kernel computes, by the eager ops: the CPU's path, the fallback where
    the kernel does not compile, and what a fake-tensor profile measures. It works on a
    block of rows at a time, so beside the logits it needs one block's fp32 copy
    (``_EAGER_BLOCK_BYTES``, 256 rows at a 128k vocabulary): the chunk's memory is about the
    fused kernel's, which keeps nothing chunk-sized beside the logits."""
    rows = max(1, _EAGER_BLOCK_BYTES // (4 * max(z.shape[1], 1)))
    loss = torch.zeros((), dtype=torch.float32, device=z.device)
    for r in range(0, z.shape[0], rows):
        x = z[r:r + rows].float()
        loss += _rows(x, y[r:r + rows], ignore_index, pre, True)
        z[r:r + rows] = x
    return loss


def _kernel_rows(n: int, chunk: int) -> int:
    """Rows of every logits block the kernel sees: the chunk, or for a batch shorter than
    one chunk the next power of two (at least ``_ROUND``), so few shapes ever compile."""
    if n >= chunk:
        return chunk
    return min(chunk, max(_ROUND, 1 << (max(n, 1) - 1).bit_length()))


def _padded_logits(hc, w, b, rows: int):
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


_KERNEL = {}         # "fn" / "out": the compiled _softmax_xent / _softmax_xent_out, made on first use
_OUT_SHAPES = {}     # (shape, dtype, device) -> why the in-place kernel is not used for it
_EAGER_SHAPES = {}   # (shape, dtype, device) -> why no compiled kernel is used for it


def _fused_kernel(device):
    """The fused chunk kernel for ``device`` (CUDA, with a working ``torch.compile``), or
    None: the eager ops then."""
    if device.type != "cuda":
        return None
    if "fn" not in _KERNEL:
        import torch._dynamo
        if not torch._dynamo.is_dynamo_supported():
            _KERNEL["fn"] = None
            warnings.warn("remat: torch.compile is not supported here, so the chunked loss uses its "
                          "eager path (correct, slower)", stacklevel=4)
        else:
            _KERNEL["fn"] = torch.compile(_softmax_xent, dynamic=False, fullgraph=True)
            _KERNEL["out"] = torch.compile(_softmax_xent_out, dynamic=False, fullgraph=True)
    return None if _KERNEL["fn"] is None else _run_fused


def _run_fused(z, y, ignore_index: int, pre):
    """The compiled in-place kernel; for a shape it cannot compile, the compiled out-of-place
    one; for a shape neither compiles, the eager ops (each step down warned once a shape)."""
    key = (tuple(z.shape), z.dtype, str(z.device))
    if key not in _OUT_SHAPES:
        try:
            return _KERNEL["fn"](z, y, ignore_index, pre)
        except _compile_errors() as error:
            _OUT_SHAPES[key] = _compile_failure(error, z, "one more chunk-sized buffer than planned (the "
                                                          "out-of-place kernel)")
    if key not in _EAGER_SHAPES:
        try:
            loss, g = _KERNEL["out"](z, y, ignore_index, pre)
            z.copy_(g)
            return loss
        except _compile_errors() as error:
            _EAGER_SHAPES[key] = _compile_failure(error, z, "the eager path, which is correct but slower")
    return _eager_kernel(z, y, ignore_index, pre)


def _compile_failure(error, z, instead: str) -> str:
    """Why a compile failed, warned once; an out-of-memory error inside it propagates."""
    if _out_of_memory(error):
        raise error
    why = f"{type(error).__name__}: {str(error).strip()[:300]}"
    warnings.warn(f"remat: the fused chunked-loss kernel could not be compiled for {list(z.shape)} {z.dtype} "
                  f"logits ({why}); chunks of this shape use {instead}", stacklevel=3)
    return why


def _compile_errors() -> tuple:
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


def _scaled(pieces, scale, dtype):
    """The weight gradient, one tensor in ``dtype``, from its row blocks times ``scale``, each
    block written straight into its rows (one pass, no temporary)."""
    rows = sum(p.shape[0] for p in pieces)
    out = torch.empty(rows, pieces[0].shape[1], dtype=dtype, device=pieces[0].device)
    start = 0
    for piece in pieces:
        torch.mul(piece, scale, out=out[start:start + piece.shape[0]])
        start += piece.shape[0]
    return out
