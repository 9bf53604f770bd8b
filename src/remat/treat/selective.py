"""The ``selective`` treatment's policy: which ops' outputs a block keeps, and the guard that
refuses a block the policy would give wrong gradients.

How: :func:`selective_context` is the ``context_fn`` of the block's non-reentrant checkpoint
(:mod:`remat.treat.treatments`): torch's selective-checkpoint modes save the outputs of the ops
in :func:`saved_ops` (matmuls and attention kernels) and recompute everything else in
backward, so no matmul runs twice. In eager mode a block's first forward of each call
structure (:func:`remat.treat.treatments._call_structure`) also runs under
:class:`_KeptOutputGuard`, which raises where an op writes in place into a kept output: torch's
own check misses a mutation made through an ``_unsafe_view`` (``torch.matmul`` on 4-D tensors
returns one), and the recompute would apply it twice and silently change the gradients
(transformers < 5 T5 does ``scores += position_bias``). Such a write is in the block's code, so
later forwards of the same structure skip the guard's per-op dispatch. Under ``torch.compile``
torch wants its own two modes untouched, so the guard is left out there.

Cost: every op of a selective block's forward and recompute passes through torch's caching mode
in Python: host time (llama-8b blocks on an H100: 0.72 of the forward's GPU time where ``keep``
takes 0.24; the guard on every forward added 7-15% to it, ``benchmarks/results/issue12/host_probe.md``),
and garbage that makes Python's collector run more often.
Under several ranks a collection mid-step, or a host that falls behind its GPU, holds the
others at the next collective (``benchmarks/results/issue12``): keep the collector out of the
steps there.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor  # already loaded by torch itself
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@functools.lru_cache(maxsize=1)
def saved_ops() -> frozenset:
    """Ops whose outputs the ``selective`` policy keeps: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_context(guard: bool = True):
    """Context pair for ``checkpoint(context_fn=...)``: save matmul/attention outputs.

    With ``guard``, in eager mode, the forward also runs under :class:`_KeptOutputGuard`, which
    refuses a block that modifies a kept output in place: torch's own check misses a mutation
    made through an ``_unsafe_view`` (``torch.matmul`` on 4-D tensors returns one), and the
    recompute would then apply the mutation twice and silently change the gradients
    (transformers < 5 T5 does ``scores += position_bias``).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    forward, recompute = create_selective_checkpoint_contexts(list(saved_ops()))
    if not guard or _tracing():
        return forward, recompute
    return _Both(forward, _KeptOutputGuard()), recompute


def _tracing() -> bool:
    """True under torch.compile: there torch wants SAC's own two modes, untouched (and
    torch 2.6 calls ``context_fn`` while AOT-tracing, where ``is_compiling()`` is False)."""
    from torch._guards import TracingContext
    return torch.compiler.is_compiling() or TracingContext.try_get() is not None


class _Both:
    """Enter two context managers as one (``context_fn`` must return exactly two)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        return self.outer.__exit__(*exc)


class _KeptOutputGuard(TorchDispatchMode):
    """Raise if an op writes in place into the storage of an output ``selective`` keeps."""

    def __init__(self):
        super().__init__()
        self.kept = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.kept and func._schema.is_mutable:
            for argument, value in zip(func._schema.arguments, args):
                info = argument.alias_info
                if info is not None and info.is_write and _storage_key(value) in self.kept:
                    raise ValueError(
                        f"treatment 'selective': this block modifies in place ({func}) the output of a "
                        "matmul/attention op that selective keeps for backward; recomputing it would "
                        "apply the change twice and give wrong gradients. Use 'full', 'attention' or "
                        "'mlp' for this block (or a newer transformers, which computes it out of place).")
        out = func(*args, **kwargs)
        if func in saved_ops():
            self.kept.update(_storage_key(t) for t in tree_flatten(out)[0])
            self.kept.discard(None)
        return out


def _storage_key(value):
    """The data pointer of a real tensor's storage; None for non-tensors and for fake or
    meta tensors (the planner's profiles), which hold no memory to alias."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or isinstance(value, FakeTensor):
        return None
    return value.untyped_storage().data_ptr()
