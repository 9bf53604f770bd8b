"""Liger's Triton kernels on fake tensors: stand-ins with their shapes, their saved bytes and their costs.

Why: a fake-tensor profile (no GPU, ``device="fake"``, long context) runs the model's forward and
backward on ``FakeTensor``s, and a Triton kernel handed one fails ("Pointer argument cannot be
accessed from Triton"; with a GPU present, an illegal memory access that takes the process
down). Every Liger kernel is launched from one of its autograd functions (``LigerRMSNormFunction``,
``LigerSiLUMulFunction``, ``LigerGELUMulFunction``, ``LigerRopeFunction``,
``LigerFusedLinearCrossEntropyFunction``, ``LigerCrossEntropyFunction``), whether the model was
patched by liger-kernel itself (class-wide, or the Trainer's ``use_liger_kernel=True``) or by
remat (:mod:`remat.treat.kernels`). :func:`liger_stand_ins` replaces each function's ``apply`` (and
the rotary embedding's dispatcher) for the length of a fake run, and puts them back after it.

How a stand-in models its kernel: it allocates what Liger's Python wrapper allocates on a CUDA
device (the outputs, RMSNorm's fp32 ``rstd`` row, the fused loss's gradient buffers and its one
reused ``chunk x vocab`` logits buffer), saves what the function saves with
``ctx.save_for_backward`` (RMSNorm: its input, weight and ``rstd``; SwiGLU/GeGLU: both projections;
RoPE: ``cos`` and ``sin``; the fused loss: the input and weight gradients it computed in forward),
writes in place where the kernel does (RoPE rotates ``q``/``k`` in place; the gated MLP's backward
writes its gradients into the saved projections; RMSNorm's into the output gradient where
``in_place``), and makes its outputs with one aten op that reads and writes the kernel's tensors
(``clone``, ``mul``, in-place ``mul_``), so the byte tracker charges the kernel's traffic over HBM
bandwidth; the fused loss's three matmuls per chunk are real ``mm``/``addmm`` ops on fake tensors,
charged by their FLOPs. Values are never computed: a stand-in refuses a real tensor.

Limits: a Liger function without a stand-in (layer norm, fused add-norm, MoE, JSD ...) raises a
ValueError naming it, as does any other op of Liger's dispatcher; the fused loss is modelled for
``reduction`` mean or sum (none is refused) without token scaling; RMSNorm's weight-gradient rows
are charged for :data:`SM_COUNT` streaming multiprocessors.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

SM_COUNT = 132
"""Streaming multiprocessors whose partial weight-gradient rows Liger's RMSNorm backward sums (H100, H200)."""


def _fake(name, *tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            raise RuntimeError(f"remat's stand-in for Liger's {name} ran on a real tensor; it only shapes fake runs")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        _fake("RMSNorm", X, W)
        shape = X.shape
        rows = X.contiguous().view(-1, shape[-1])
        Y = rows.clone()                                   # the kernel reads X, writes Y
        rstd_dtype = torch.float32 if casting_mode in ("llama", "gemma", 0, 1) else X.dtype
        rstd = rows.new_empty(rows.shape[0], dtype=rstd_dtype)
        ctx.in_place, ctx.shape, ctx.affine = in_place, shape, W is not None
        ctx.save_for_backward(rows, W, rstd) if W is not None else ctx.save_for_backward(rows, rstd)
        return Y.view(shape)

    @staticmethod
    def backward(ctx, dY):
        if ctx.affine:
            rows, W, _ = ctx.saved_tensors
        else:
            (rows, _), W = ctx.saved_tensors, None
        grad = dY.contiguous().view(-1, rows.shape[-1])
        dX = grad.mul_(rows) if ctx.in_place else torch.mul(grad, rows)   # in place: into dY, as Liger's
        dW = None
        if W is not None and ctx.needs_input_grad[1]:
            partial = rows.new_empty((SM_COUNT, rows.shape[-1]), dtype=torch.float32)
            dW = partial.sum(0).to(W.dtype)
        return dX.view(ctx.shape), dW, None, None, None, None, None


class _GatedMul(torch.autograd.Function):
    """SwiGLU's ``silu(a) * b`` and GeGLU's ``gelu(a) * b``: output new, backward into ``a`` and ``b``."""

    @staticmethod
    def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):
        _fake("gated MLP", a, b)
        a, b = a.contiguous(), b.contiguous()
        c = torch.mul(a, b)                                 # reads a and b, writes c
        if down_multiplier != 1.0:
            c = c * down_multiplier
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        a.mul_(dc)                                          # Liger writes da and db into a and b
        b.mul_(dc)
        return a, b, None, None


def _gelu_mul(a, b):
    return _GatedMul.apply(a, b)


def _tables(cos, sin, unsqueeze_dim):
    """``cos``/``sin`` as Liger's rope reshapes them (views)."""
    if cos.ndim == 4:
        dim = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1
        cos, sin = (cos.squeeze(dim), sin.squeeze(dim)) if cos.shape[dim] == 1 else (cos.squeeze(), sin.squeeze())
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos.contiguous(), sin.contiguous()


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        _fake("RoPE", q, k)
        cos, sin = _tables(cos, sin, unsqueeze_dim)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()   # [batch, seq, heads, dim]
        q.mul_(1.0)                                         # rotated in place, as the kernel does
        k.mul_(1.0)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        dq.mul_(1.0)
        dk.mul_(1.0)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None, None, None


def _rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, rotary_dim=None, **_):
    return _Rope.apply(q, k, cos, sin, position_ids, unsqueeze_dim, rotary_dim)


def _chunk_rows(rows: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """Liger's fused loss's chunk: the next power of two of ``rows / ceil(vocab / (c * hidden))``."""
    factor = -(-vocab // (chunk_mem_const * hidden))
    want = -(-rows // factor)
    return min(1 << max(0, want - 1).bit_length(), rows)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
                ce_mode=None, chunk_mem_const=1):
        _fake("fused linear cross-entropy", _input, weight)
        if reduction == "none" or use_token_scaling:
            raise ValueError("remat's fake-tensor stand-in for Liger's fused linear cross-entropy models "
                             f"reduction='mean'/'sum' without token scaling (got reduction={reduction!r}, "
                             f"use_token_scaling={use_token_scaling}); profile on the GPU")
        rows, hidden = _input.shape
        vocab = weight.shape[0]
        chunk = _chunk_rows(rows, hidden, vocab, chunk_mem_const or 1)
        wants = _input.requires_grad
        grad_input = torch.zeros_like(_input)
        grad_weight = torch.zeros_like(weight, dtype=accum_dtype or weight.dtype) if wants and weight.requires_grad \
            else None
        grad_bias = torch.zeros_like(bias, dtype=accum_dtype or bias.dtype) if wants and bias is not None else None
        loss_1d = _input.new_zeros(rows, dtype=torch.float32)
        logits = _input.new_empty((chunk, vocab))           # one buffer, reused by every chunk
        for start in range(0, rows, chunk):
            piece = _input[start:start + chunk]
            block = logits[:piece.shape[0]]
            torch.mm(piece, weight.t(), out=block)
            block.mul_(1.0)                                 # the loss kernel: logits read, their gradient written
            if wants:
                torch.mm(block, weight, out=grad_input[start:start + chunk])
            if grad_weight is not None:
                torch.addmm(grad_weight, block.t(), piece.to(block.dtype), out=grad_weight)
            if grad_bias is not None:
                grad_bias.add_(block.sum(0))
        del logits
        loss = loss_1d.sum()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        return loss, None, None, None

    @staticmethod
    def backward(ctx, grad_output, *_):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        grad_input.mul_(1.0)                                # scaled in place by the loss's gradient
        if grad_weight is not None:
            grad_weight.mul_(1.0)
        grads = (grad_input, grad_weight, None, grad_bias) + (None,) * 14
        return grads[:len(ctx.needs_input_grad)]


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                return_predicted_tokens=False):
        _fake("cross-entropy", _input)
        loss_1d = _input.new_zeros(_input.shape[0], dtype=torch.float32)
        _input.mul_(1.0)                                    # its gradient written into the logits
        if _input.requires_grad or ctx.needs_input_grad[0]:
            ctx.save_for_backward(_input.detach())
        return (loss_1d if reduction == "none" else loss_1d.sum()), None, None, None

    @staticmethod
    def backward(ctx, grad_output, *_):
        (grad,) = ctx.saved_tensors
        grad.mul_(1.0)
        return (grad,) + (None,) * 10


STAND_INS = {"LigerRMSNormFunction": _RMSNorm.apply, "LigerSiLUMulFunction": _GatedMul.apply,
             "LigerGELUMulFunction": _gelu_mul, "LigerRopeFunction": _Rope.apply,
             "LigerFusedLinearCrossEntropyFunction": _FusedLinearCrossEntropy.apply,
             "LigerCrossEntropyFunction": _CrossEntropy.apply}
"""Liger's autograd function (by class name) -> the stand-in its ``apply`` becomes in a fake run."""


def _refusal(name):
    def refuse(*args, **kwargs):
        raise ValueError(f"remat cannot profile Liger's {name} with fake tensors (its Triton kernel cannot run on "
                         f"them, and remat has no stand-in for it: it stands in for {', '.join(STAND_INS)}); "
                         "profile on the GPU (remat.plan with the model on CUDA, no device='fake')")
    return refuse


def _liger_functions() -> dict:
    """Every autograd function class liger-kernel's imported modules define or import, by identity."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("liger_kernel") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) and \
                    (value.__module__ or "").startswith("liger_kernel"):
                found[id(value)] = value
    return found


@contextlib.contextmanager
def liger_stand_ins():
    """Inside the block, every Liger autograd function's ``apply`` is its stand-in (or a refusal
    naming it) and Liger's dispatcher serves ``rope`` by the stand-in; all put back afterwards. A
    process that has not imported liger-kernel is left alone."""
    if "liger_kernel" not in sys.modules:
        yield
        return
    undo = []
    try:
        for cls in _liger_functions().values():
            own = cls.__dict__.get("apply", _ABSENT)
            undo.append((cls, own))
            cls.apply = staticmethod(STAND_INS.get(cls.__name__) or _refusal(cls.__name__))
        for name, module in list(sys.modules.items()):
            if name.startswith("liger_kernel") and module is not None and callable(vars(module).get("dispatch")):
                undo.append((module, ("dispatch", vars(module)["dispatch"])))
                module.dispatch = _dispatch
        yield
    finally:
        for owner, previous in reversed(undo):
            if isinstance(previous, tuple):
                setattr(owner, *previous)
            elif previous is _ABSENT:
                delattr(owner, "apply")
            else:
                owner.apply = previous


_ABSENT = object()


def _dispatch(op, *args, **kwargs):
    """Liger's multi-backend dispatcher during a fake run: ``rope`` by its stand-in, anything else refused."""
    if op == "rope":
        kwargs.pop("impl", None), kwargs.pop("mode", None)
        return _rope(*args, **kwargs)
    return _refusal(f"{op} (through its dispatcher)")()
