"""The chunked head's gradients times backward's incoming factor: multiplied in fp32, rounded once.

:mod:`remat.head.chunked_loss` finishes every gradient inside its forward; its backward only
multiplies them by one factor (the loss's incoming gradient, times 1/N for fp16 heads), an fp32
0-dim tensor on the gradients' device. Eager CUDA ``bf16_tensor * fp32_0dim_tensor`` first casts
the factor to bf16 (the operands' common dtype: a 0-dim tensor does not promote), so a factor
that is not a power of two (1/3 from three accumulation steps; fp16's 1/N) lost its low bits: the
same relative error, up to 2^-9, on every element of the gradient, a bias where the plain head
multiplies in fp32. The CPU reads a 0-dim CPU tensor as an fp32 scalar, so CPU runs never
showed it. The mixed-dtype multiply is slow too: it is not vectorised, several times one pass
at the memory's speed over a 128k-vocabulary weight.

:func:`times` computes ``t * factor`` in fp32 and rounds once to the output's dtype, in place
or into a given tensor:

- where the eager op already does that (``t`` in fp32 or fp64, or off CUDA), the eager op;
- on CUDA, one Triton kernel over the flat tensors. In place, each program reads the factor
  first and reads and writes nothing when it is 1 (the usual case: no accumulation scaling, bf16), so the
  weight gradient's in-place scaling, a pass over 0.5 GiB at a 128k vocabulary, costs nothing
  then, without the host reading the factor (a sync);
- where Triton does not import or build (warned once; the eager way then for the rest of the
  process), or for strided tensors, the fp32 product a block of rows at a time (``BLOCK_BYTES``
  of fp32 beside the output).
"""
from __future__ import annotations

import functools

import torch

from remat import caches
from remat.head import xent_triton
from remat.head.xent_kernel import compile_failure

BLOCK_BYTES = 2 ** 27   # the fp32 block the eager CUDA path makes at a time
ELEMENTS = 16384        # elements a program of the kernel scales

_KERNEL = caches.register({}, "head.grad_scale._KERNEL")  # "fn": the kernel's launcher, made on first use; None where it cannot be


def times(t, factor, out):
    """``out = t * factor``, multiplied in fp32 and rounded once to ``out``'s dtype; ``out``
    may be ``t`` (in place). ``factor`` is a 0-dim fp32 tensor. Returns ``out``."""
    if _eager_is_exact(t):
        return torch.mul(t, factor, out=out)
    kernel = _kernel()
    if kernel is not None and t.is_contiguous() and out.is_contiguous():
        try:
            kernel(out, t, factor)
            return out
        except xent_triton.compile_errors() + (ImportError,) as error:
            compile_failure(error, "the chunked head's gradient scaling",
                            "it runs as eager fp32 ops, a block of rows at a time, from now on")
            _KERNEL["fn"] = None
    return in_blocks(t, factor, out)


def _eager_is_exact(t) -> bool:
    """Whether ``torch.mul(t, factor)`` multiplies by the fp32 factor itself: for fp32 and
    fp64 tensors, and off CUDA (the CPU reads a 0-dim tensor as an fp32 scalar)."""
    return t.dtype in (torch.float32, torch.float64) or t.device.type != "cuda"


def in_blocks(t, factor, out):
    """``out = t * factor`` through an fp32 copy of ``BLOCK_BYTES`` at a time (eager ops)."""
    if t.dim() == 0:
        return out.copy_(t.float() * factor)
    step = max(1, BLOCK_BYTES // (4 * max(t[0].numel(), 1)))
    for r in range(0, t.shape[0], step):
        out[r:r + step].copy_(t[r:r + step].float() * factor)
    return out


def _kernel():
    """The Triton kernel's launcher ``(out, t, factor)``, or None without Triton."""
    if "fn" not in _KERNEL:
        _KERNEL["fn"] = _launch if xent_triton.available() else None
    return _KERNEL["fn"]


def _launch(out, t, factor):
    n = t.numel()
    with torch.cuda.device(t.device):
        _triton_kernel()[(-(-n // ELEMENTS),)](t, out, factor, n, IN_PLACE=out.data_ptr() == t.data_ptr(),
                                               BLOCK=ELEMENTS, num_warps=8)


@caches.register
@functools.lru_cache(maxsize=None)
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit  # n specialised: knowing it a multiple of 16 lets Triton vectorise (4x faster, measured)
    def scale(t_ptr, out_ptr, factor_ptr, n, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
        factor = tl.load(factor_ptr)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        if IN_PLACE:
            inside = inside & (factor != 1.0)  # masked off: no memory traffic at all
        x = tl.load(t_ptr + offsets, mask=inside).to(tl.float32)
        tl.store(out_ptr + offsets, (x * factor).to(out_ptr.dtype.element_ty), mask=inside)

    return scale
