"""Cross-entropy of a linear head, a chunk of rows at a time: the [rows x vocab] logits never exist.

The loss op alone (torch only; the Hugging Face integration is :mod:`remat.head.hf_model`).
:func:`chunked_cross_entropy` walks the hidden states ``chunk_tokens`` rows at a time:

    z = h_c @ W^T (+ b)           in the compute dtype (the head's, or autocast's)
    x = transform(z).float()      an optional logit transform (soft-capping, scaling)
    loss += sum over valid rows of logsumexp(x) - x[target]
    g = (softmax(x) - onehot) / N  cast back to the compute dtype, through ``transform``
    grad_h[c] = g @ W;  grad_W += g^T @ h_c;  grad_b += sum(g) (fp32)

All gradients are finished inside the forward loop, since a cross-entropy's logits gradient is
known the moment its loss is; backward only scales the stored gradients by the incoming scalar
(:mod:`remat.head.grad_scale`, in fp32). The obvious alternative, each chunk's loss under
``torch.utils.checkpoint``, recomputes the chunk's logits in backward: a second [tokens x hidden x
vocab] matmul. Here the head costs the plain path's three matmuls, and the peak is one chunk's
logits plus the weight-gradient sum and ``grad_h``: it grows with the chunk, not tokens x vocab.

The weight gradient's sum (:func:`_accumulator`): a bf16 head with a large vocabulary sums it in
bf16 with the batch's target rows summed in fp32 beside it (:class:`_TargetRows`: a bf16 sum's
bytes, an fp32 sum's error); every other head in fp32 (:class:`_Accumulator`), cast to the weight's
dtype block by block at the end of the forward.

N is ``num_items_in_batch`` if given, else the number of non-ignored targets. With no valid target
the loss is nan (or inf), as ``cross_entropy`` gives, and every gradient is finite: 1/N is taken as
0 (an SFT batch with an empty completion mask must not turn the weights into NaN).

On CUDA with no transform each chunk is one compiled kernel (:mod:`remat.head.xent_kernel`). Limits:
rounding follows the plain path; the loop is Python, not traced by ``torch.compile``. More: the design doc.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from remat import caches
from remat.head.grad_scale import times
from remat.head.xent_kernel import (ROUND, eager_kernel, fused_kernel, kernel_rows, padded_logits, row_losses,
                                   shape_kernel)

_GiB = 2 ** 30
_MAX_CHUNK = 8192       # assumed: beyond this the matmuls gain no speed, only memory
_DEFAULT_LOGIT_BYTES = _GiB  # default chunk: its fp32 logits take about this much
_PIECE_BYTES = 2 ** 27  # the fp32 weight-gradient accumulator is kept in row blocks of about this size
_ALIGN_ROWS = 8         # target rows are padded to a multiple of this: 16 bytes of bf16


def default_chunk_tokens(vocab: int) -> int:
    """The chunk whose fp32 logits take about 1 GiB: 2048 tokens at a 128k vocabulary.

    Args:
        vocab: the head's vocabulary size.

    Returns:
        Rows per chunk, a multiple of the row rounding, capped above."""
    rows = _DEFAULT_LOGIT_BYTES // (4 * max(int(vocab), 1))
    return int(min(_MAX_CHUNK, max(ROUND, rows // ROUND * ROUND)))


def chunked_cross_entropy(hidden, weight, bias, targets, *, chunk_tokens=None, ignore_index=-100,
                          num_items_in_batch=None, transform=None, compute_dtype=None):
    """``sum(CE(transform(hidden @ weight.T + bias).float(), targets)) / N``, a chunk of rows at a time.

    Args:
        hidden: ``[..., hidden]`` states, one row per target.
        weight: the head's ``[vocab, hidden]`` weight; ``bias``: its bias or None.
        targets: class ids already aligned with ``hidden``'s rows (shift them first for causal LMs).
        chunk_tokens: rows per chunk; None: :func:`default_chunk_tokens`.
        ignore_index: targets that count for nothing.
        num_items_in_batch: N if given, else the count of non-ignored targets.
        transform: maps logits to logits in their own dtype (e.g. soft-capping), or None.
        compute_dtype: the logits' dtype; None: autocast's, else the weight's.

    Returns:
        The loss, a 0-dim tensor; its backward only scales the gradients the forward finished.

    Raises:
        ValueError: the targets' count differs from the rows', or ``chunk_tokens`` is not positive.

    Example::

        loss = chunked_cross_entropy(h[:, :-1], lm_head.weight, None, ids[:, 1:])"""
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if targets.numel() != hidden2.shape[0]:
        raise ValueError(f"{targets.numel()} targets for {hidden2.shape[0]} hidden-state rows; "
                         "they must match (is logits_to_keep set while training?)")
    cd = compute_dtype or compute_dtype_of(hidden, weight)
    chunk = int(chunk_tokens or default_chunk_tokens(weight.shape[0]))
    if chunk <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    # targets the host holds (labels left on the CPU) are ordered there: no wait for the GPU
    order = None
    if targets.device != hidden.device and targets.device.type == "cpu" and _wants_target_rows(weight, targets, cd,
                                                                                               chunk):
        order = _by_first_use(targets.masked_fill(targets == ignore_index, 0), chunk)
        order = (order[0].to(hidden.device, non_blocking=True), order[1])
    targets = targets.to(hidden.device, non_blocking=True)
    acc = sum_dtype(cd)
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(acc)
    elif isinstance(num_items_in_batch, torch.Tensor):
        divisor = num_items_in_batch.to(hidden.device, non_blocking=True).to(acc)
    else:  # a number: filled on the device, not copied from the host (a copy would wait for the GPU)
        divisor = torch.full((), float(num_items_in_batch), dtype=acc, device=hidden.device)
    return _ChunkedLoss.apply(hidden2, weight, bias, targets, divisor, chunk, int(ignore_index),
                              transform, cd, order)


def sum_dtype(compute_dtype) -> torch.dtype:
    """The dtype the loss, its softmax and the gradient sums are taken in: fp32, or float64 for a
    float64 model (whose plain loss is float64 throughout)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def compute_dtype_of(hidden, weight):
    """The dtype the head's matmul runs in: autocast's if it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk, ignore_index, transform, cd, order=None):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want = want_h or want_w or want_b
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        n, hsize = hidden.shape
        # 1/N, and 0 for N = 0: no valid row then, and every gradient stays a finite zero
        inv = torch.where(divisor != 0, 1.0 / divisor, torch.zeros_like(divisor))
        # fp16 cannot hold (softmax - onehot) / N for large N: scale by 1/N in backward there.
        pre, post = (torch.ones_like(inv), inv) if cd == torch.float16 else (inv, torch.ones_like(inv))
        fake = isinstance(hidden, FakeTensor)  # a profile's run: only shapes and bytes matter
        acc = sum_dtype(cd)
        # the fused kernels compute in fp32: a float64 model takes the eager ops, in float64
        kernel = (fused_kernel(hidden.device) if transform is None and want and not fake and acc == torch.float32
                  else None)
        rows = kernel_rows(n, chunk) if kernel is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            grad_h = torch.empty(n, hsize, dtype=cd, device=h.device) if want_h else None
            known = {} if order is None else {"order": order}  # the targets' order, made on the host
            acc_w = _accumulator(weight, targets, ignore_index, cd, chunk, **known) if want_w else None
            acc_b = torch.zeros(bias.shape, dtype=acc, device=h.device) if want_b else None
            total = torch.zeros((), dtype=acc, device=h.device)
            for s in range(0, n, chunk):
                hc, yc = h[s:s + chunk], targets[s:s + chunk]
                m = hc.shape[0]
                gathered = kernel is not None
                if kernel is not None:
                    g = padded_logits(hc, w, b, rows)  # the kernel turns the logits into their gradient
                    total += kernel(g, F.pad(yc, (0, rows - m), value=ignore_index), ignore_index, pre,
                                    acc_w.columns(m) if want_w else None)
                    g = g[:m]  # the padded rows' gradient is zero
                elif transform is None and want:
                    g = F.linear(hc, w, b)  # in place again, a block of rows in fp32 at a time
                    total += (shape_kernel if fake else eager_kernel)(g, yc, ignore_index, pre)
                elif transform is None:
                    total += row_losses(F.linear(hc, w, b).to(acc), yc, ignore_index, pre, False)
                    g = None
                else:
                    # through the model's own ops, so rounding and derivative are its own
                    z = F.linear(hc, w, b).requires_grad_(want)
                    with torch.enable_grad():
                        x = transform(z).to(acc)
                    total += row_losses(x.detach(), yc, ignore_index, pre, want)
                    g = torch.autograd.grad(x, z, x.detach())[0] if want else None
                    del x, z
                if want_h:
                    torch.mm(g, w, out=grad_h[s:s + m])
                if want_w:
                    acc_w.add(g, hc, gathered)
                if want_b:
                    acc_b.add_(g.sum(0, dtype=acc))
                del g
            # in the weight's own dtype from here to backward (half the bytes), except fp16,
            # whose unscaled sums may overflow: it waits for the scale in fp32
            grad_w = acc_w.finish(torch.float32 if cd == torch.float16 else weight.dtype) if want_w else None
        ctx.in_place = isinstance(acc_w, _TargetRows)
        # backward's factor (1/N for fp16, else 1) and a slot for the scale it applies in place
        factors = torch.stack((post, torch.zeros_like(post)))
        ctx.save_for_backward(grad_h, acc_b, factors, *(grad_w or ()))
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, acc_b, factors, *grad_w = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_loss.to(factors.dtype) * factors[0]
        gh = times(grad_h, scale, torch.empty_like(grad_h, dtype=h_dtype)) if grad_h is not None else None
        if ctx.in_place:  # one tensor in the weight's dtype: scaled where it lies, handed on as it is
            gw = _scaled_in_place(ctx, grad_w[0], scale, factors)
        else:
            gw = _scaled(grad_w, scale, w_dtype) if grad_w else None
        gb = (acc_b * scale).to(b_dtype) if acc_b is not None else None
        return gh, gw, gb, None, None, None, None, None, None, None


def _accumulator(weight, targets, ignore_index, cd, chunk, order=None):
    """The weight gradient's accumulator: :class:`_TargetRows` where :func:`_wants_target_rows`,
    else :class:`_Accumulator`. ``order``: the targets' :func:`_by_first_use`, if known already."""
    if _wants_target_rows(weight, targets, cd, chunk):
        capacity = _aligned(min(targets.numel() + 1, weight.shape[0]))
        return _TargetRows(weight, targets, ignore_index, capacity, chunk, order)
    return _Accumulator(weight.shape, weight.device, sum_dtype(cd))


def _wants_target_rows(weight, targets, cd, chunk) -> bool:
    """A bf16 head where :class:`_TargetRows` holds at most 0.8x the fp32 sum's bytes.

    Per target row it holds its fp32 sum, its bf16 copy at the end and one chunk's gathered
    column (``6 * hidden + 2 * chunk`` bytes) beside the bf16 sum (``2 * hidden`` a vocabulary
    row) where the fp32 sum holds 4: at 0.8x its row GEMM costs at most a fifth of the weight
    gradient's."""
    vocab, hsize = weight.shape
    capacity = _aligned(min(targets.numel() + 1, vocab))
    per_row = 6 * hsize + 2 * min(chunk, targets.numel())
    return weight.dtype == cd == torch.bfloat16 and 2 * vocab * hsize + capacity * per_row <= 0.8 * 4 * vocab * hsize


class _TargetRows:
    """The weight gradient summed in the weight's dtype (bf16), with the rows of the batch's
    targets summed in fp32 beside it and written over theirs at the end.

    Why: a bf16 running sum rounds once a chunk, where the plain path's one GEMM rounds once; a
    whole fp32 sum holds twice the bytes. The rows that carry the gradient's weight are the
    targets' (each gets ``p - 1`` of its rows' hidden states, every other row only ``p``), at most
    ``min(tokens + 1, vocab)`` of them (row 0 stands in for ignored targets); summed in fp32 they
    keep the plain path's error (measured: ``docs/history.md``).

    A row's fp32 sum starts at the chunk where it is first a target, from its bf16 sum so far. The
    rows are ordered by first use (:func:`_by_first_use`: one wait for the GPU a step, none where
    the host holds the targets), so each chunk's gather and fp32 GEMM cover only a prefix. The
    fp32 rows are allocated for ``capacity`` rows whatever the batch holds, so the peak does not
    depend on its values; row counts are padded to a multiple of ``_ALIGN_ROWS`` for cuBLAS's fast
    kernels. On fake tensors the first ``capacity`` rows stand in for the targets. More:
    ``docs/design/treatments.md``."""

    def __init__(self, weight, targets, ignore_index, capacity, chunk, order=None):
        vocab, hsize = weight.shape
        n = targets.numel()
        self.full = torch.zeros(vocab, hsize, dtype=weight.dtype, device=weight.device)
        self.exact = torch.zeros(capacity, hsize, dtype=torch.float32, device=weight.device)
        self.buffer = torch.empty(min(chunk, n) * capacity, dtype=weight.dtype, device=weight.device)
        chunks = -(-n // chunk)
        if is_fake(targets):
            rows = torch.arange(min(capacity, vocab), device=targets.device)
            first_uses = [rows.numel()] * chunks
        elif order is not None:
            rows, first_uses = order
        else:
            rows, first_uses = _by_first_use(targets.masked_fill(targets == ignore_index, 0), chunk)
        self.count = rows.numel()
        self.rows = F.pad(rows, (0, _aligned(self.count) - self.count))
        # per chunk: the rows whose fp32 sums start there (none on fake tensors), and the prefix in use
        starts = [0] + first_uses[:-1]
        self.fresh = [(0, 0)] * chunks if is_fake(targets) else list(zip(starts, first_uses))
        self.in_use = [min(_aligned(b), self.rows.numel()) for b in first_uses]
        self.chunk = 0

    def columns(self, m):
        """``(target columns, out)``: the next chunk's prefix of rows in use, and the [m x rows]
        buffer the chunk kernel copies their gradient columns into (:func:`run_fused`'s ``gather``)."""
        used = self.in_use[self.chunk]
        return self.rows[:used], self.buffer[:m * used].view(m, used)

    def add(self, g, hc, gathered=False):
        """``+= g^T @ hc`` for one chunk, in bf16, and the rows in use in fp32 (their columns
        copied out by the chunk kernel if ``gathered``, else gathered here)."""
        start, end = self.fresh[self.chunk]
        if end > start:  # rows first used here: their fp32 sums start from the bf16 sums so far
            self.exact[start:end] = self.full.index_select(0, self.rows[start:end])
        self.full.addmm_(g.t(), hc)
        rows, picked = self.columns(g.shape[0])
        if not gathered:
            torch.index_select(g, 1, rows, out=picked)
        _accumulate(self.exact[:rows.numel()], picked.t(), hc)
        self.chunk += 1

    def finish(self, dtype):
        """The sum, its target rows replaced by their fp32 sums rounded once (the padding's
        rows left out)."""
        self.full.index_copy_(0, self.rows[:self.count], self.exact[:self.count].to(dtype))
        self.exact = self.buffer = None
        return [self.full]


def _by_first_use(targets, chunk):
    """The distinct ``targets``, ordered by the position of their first use, and for each chunk
    of ``chunk`` positions the count of them first used in that chunk or before (a prefix).

    A stable sort puts each value's first position at the start of its run (sorts and masks
    only: deterministic on CUDA, where a scatter of minimum positions would use atomics). Every
    step stays on the device but the last: the positions that are not a value's first sort after
    all the others (keyed ``n``) instead of being dropped by a boolean index (a wait for the
    device each), and the counts per chunk, the last of which is the number of distinct values,
    come to the host in one copy: the one wait."""
    n = targets.numel()
    values, positions = torch.sort(targets, stable=True)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    firsts, order = torch.sort(torch.where(starts, positions, n), stable=True)
    ends = torch.arange(chunk, n + chunk, chunk, device=targets.device).clamp(max=n)
    counts = torch.searchsorted(firsts, ends).tolist()
    return values[order[:counts[-1]]], counts


def _aligned(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``_ALIGN_ROWS``."""
    return -(-rows // _ALIGN_ROWS) * _ALIGN_ROWS


def is_fake(tensor) -> bool:
    """Whether ``tensor`` holds no values: a fake tensor (planning without a GPU) or on ``meta``."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _scaled_in_place(ctx, grad_w, scale, factors):
    """``grad_w`` times ``scale``, in place at the first backward: no second weight-sized tensor.

    The gradient handed on is ``grad_w`` itself (autograd's accumulation then takes it as the
    weight's ``.grad`` without a copy). The multiplication goes through ``.data``, whose
    in-place ops autograd's version check does not see, so that a second backward through a
    retained graph can still unpack ``grad_w``. That second backward must not change it again
    (``torch.autograd.grad``'s caller may hold the first gradient): it gets a new tensor. If
    what it unpacked is the storage scaled before, that is ``grad_w`` times the ratio of the
    scales (exact for the usual ones, 1 or a power of two), and an error if the first scale
    was 0 (nothing is left to rescale); a saved-tensor hook that unpacks a copy
    (``save_on_cpu``) gives the unscaled sum again, scaled anew. A caller that changes the
    first gradient in place and then runs a second backward meets autograd's in-place error.

    The first scale is kept in the saved ``factors[1]`` (written through ``.data`` too), not on
    ``ctx``: ``ctx`` lives as long as the graph, and a 0-dim tensor there would stay allocated
    through the rest of the backward (a 512-byte block: the step's peak was that much over
    Liger's in the bench); saved tensors are freed once this backward has run."""
    if not hasattr(ctx, "scaled_pointer"):
        times(grad_w.data, scale, grad_w.data)
        factors.data[1].copy_(scale)
        ctx.scaled_pointer = None if is_fake(grad_w) else grad_w.data_ptr()
        return grad_w
    if ctx.scaled_pointer is None or grad_w.data_ptr() != ctx.scaled_pointer:
        return times(grad_w, scale, torch.empty_like(grad_w))
    applied = factors[1]
    if not bool(applied != 0):
        raise RuntimeError("remat's chunked head: the first backward through this retained graph scaled the "
                           "weight gradient by 0 in place, so a second backward cannot recover it; give the "
                           "first backward a non-zero gradient, or run the loss forward again")
    return times(grad_w, scale / applied, torch.empty_like(grad_w))


class _Accumulator:
    """The fp32 weight gradient ``sum over chunks of g^T @ h``, kept as row blocks of about
    ``_PIECE_BYTES`` (128 MiB) instead of one tensor, so that turning it into the weight's
    dtype at the end of the forward (:meth:`finish`) frees each fp32 block as its narrow copy
    is made: 1x the fp32 bytes plus one block at the peak, not 1.5x."""

    def __init__(self, shape, device, dtype=torch.float32):
        rows, cols = shape
        step = max(1, _PIECE_BYTES // (4 * max(cols, 1)))
        self.pieces = [torch.zeros(min(step, rows - r), cols, dtype=dtype, device=device)
                       for r in range(0, rows, step)]

    def columns(self, m):
        """No columns to copy out (see :meth:`_TargetRows.columns`)."""
        return None

    def add(self, g, hc, gathered=False):
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


_FP32_OUT = caches.register({}, "head.chunked_loss._FP32_OUT")  # device type -> whether addmm(out_dtype=float32) works there


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


def _scaled(pieces, scale, dtype):
    """The weight gradient, one tensor in ``dtype``, from its row blocks times ``scale``, each
    block written straight into its rows (one pass, no temporary)."""
    rows = sum(p.shape[0] for p in pieces)
    out = torch.empty(rows, pieces[0].shape[1], dtype=dtype, device=pieces[0].device)
    start = 0
    for piece in pieces:
        times(piece, scale, out[start:start + piece.shape[0]])
        start += piece.shape[0]
    return out
