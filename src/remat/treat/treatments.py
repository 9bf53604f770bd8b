"""Per-block treatments: what a block keeps for backward and what it redoes.

How: a treated block keeps its class, its children and its parameters; only its
``forward`` is replaced, by an instance attribute that is a bound method
(``types.MethodType``) running the original forward under the treatment. Because the
module tree does not change, ``state_dict`` keys stay the same (checkpoints load either
way), FSDP2's ``fully_shard`` and ``Module.compile()`` applied afterwards see the block
they expect, and ``remove`` restores exactly what was there, including an instance
``forward`` that another library (accelerate's hooks) had set before us. A bound method,
unlike a closure, is re-bound by ``copy.deepcopy``, so a copied model is treated on its
own parameters.

The alternative, ``checkpoint_wrapper``, inserts a ``_checkpoint_wrapped_module`` level
into every parameter name; that is what breaks state-dict loading in many stacks.

Treatments:
- ``keep``: untouched.
- ``full``: non-reentrant ``torch.utils.checkpoint`` of the whole block: only its inputs
  are saved; one extra forward of the block in backward. RNG state is preserved, so
  dropout masks are the same in the recompute.
- ``selective``: the same checkpoint with an op-level policy: outputs of matmuls and
  attention kernels are saved, everything else (norms, activations, elementwise) is
  recomputed. No matmul runs twice.
- ``attention`` / ``mlp``: ``full`` applied to that sub-module only.
- ``offload`` / ``full+offload``: the block's saved tensors (or, with ``full``, only its
  checkpointed inputs) go to pinned host memory through :mod:`remat.offload.engine`.

Non-reentrant checkpointing gives parameter gradients even when no input requires grad
(LoRA over frozen embeddings), so ``enable_input_require_grads`` is not needed.
"""
from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor  # already loaded by torch itself
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from remat.treat.discovery import find_submodules
from remat.planning.plans import OFFLOADING_TREATMENTS, TREATMENTS

# Cache arguments must not be updated twice by a recompute; in training they are unused.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


@dataclass
class _BlockState:
    """What remat changed on one module, enough to run the treatment and to undo it."""

    treatment: str
    original_forward: Any
    had_instance_forward: bool
    instance_forward: Any = None
    engine: Any = None
    key: int = 0
    patched_submodules: list = field(default_factory=list)


def treatment_of(block: nn.Module) -> str:
    state = block.__dict__.get("_remat")
    return state.treatment if state is not None else "keep"


def apply_treatment(block: nn.Module, treatment: str, *, engine=None, key: int = 0) -> None:
    """Treat ``block`` in place; a block that already has a treatment gets the new one."""
    if treatment not in TREATMENTS:
        raise ValueError(f"unknown treatment {treatment!r}; expected one of {', '.join(TREATMENTS)}")
    remove_treatment(block)
    if treatment == "keep":
        return
    if treatment in ("attention", "mlp"):
        subs = find_submodules(block, treatment)
        if not subs:
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in block.named_children())
            raise ValueError(f"treatment {treatment!r}: no {treatment} sub-module found in "
                             f"{type(block).__name__} (children: {children}); use 'full' or "
                             "'selective' for this block")
        for _, sub in subs:
            _patch(sub, "full")
        _mark(block, _BlockState(treatment, None, False, patched_submodules=[s for _, s in subs]))
        return
    if treatment in OFFLOADING_TREATMENTS and engine is None:
        raise ValueError(f"treatment {treatment!r} needs an offload engine; use remat.apply()")
    _patch(block, treatment, engine=engine, key=key)


def remove_treatment(block: nn.Module) -> None:
    """Undo :func:`apply_treatment`; a no-op on an untreated block."""
    state = block.__dict__.pop("_remat", None)
    if state is None:
        return
    for sub in state.patched_submodules:
        remove_treatment(sub)
    if state.original_forward is None:
        return
    if state.had_instance_forward:
        block.__dict__["forward"] = state.instance_forward
    else:
        block.__dict__.pop("forward", None)


def _mark(module: nn.Module, state: _BlockState) -> None:
    # __dict__ directly: nn.Module.__setattr__ would be fine too, but this makes the
    # intent explicit: plain attributes, never submodules, parameters or buffers.
    module.__dict__["_remat"] = state


def _patch(module: nn.Module, treatment: str, *, engine=None, key: int = 0) -> None:
    had_instance = "forward" in module.__dict__
    state = _BlockState(treatment, module.forward, had_instance,
                        instance_forward=module.__dict__.get("forward"), engine=engine, key=key)
    _mark(module, state)
    module.__dict__["forward"] = types.MethodType(_treated_forward, module)


def _treated_forward(self: nn.Module, *args, **kwargs):
    state: _BlockState = self.__dict__["_remat"]
    if not torch.is_grad_enabled():
        return state.original_forward(*args, **kwargs)
    if self.training and getattr(self, "gradient_checkpointing", False) is True:
        raise ValueError(
            f"{type(self).__name__} has Hugging Face gradient checkpointing switched on while remat "
            f"treats it ({state.treatment!r}): the block would be checkpointed twice. Call "
            "model.gradient_checkpointing_disable() (Trainer: gradient_checkpointing=False) and "
            "let remat do it.")
    kwargs = _drop_cache(kwargs) if self.training else kwargs
    function, args = _positional(state.original_forward, args, kwargs)
    if state.treatment == "full":
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    if state.treatment == "selective":
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=selective_context)
    if state.treatment == "offload":
        with state.engine.saved_tensors(state.key):
            return function(*args)
    if state.treatment == "full+offload":
        with state.engine.saved_tensors(state.key):
            return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    raise AssertionError(f"unhandled treatment {state.treatment}")  # apply_treatment validated it


def _positional(forward, args: tuple, kwargs: dict):
    """``(function, args)`` such that ``function(*args)`` is ``forward(*args, **kwargs)`` and
    every tensor keyword is one of ``args``.

    ``checkpoint`` saves and restores the RNG state only of the devices of its *positional*
    tensors; a sub-module called with keywords only (Hugging Face attention:
    ``self_attn(hidden_states=...)``) would otherwise recompute its dropout on the GPU with
    a different mask. As positional inputs, they are also the checkpoint's saved inputs, so
    ``full+offload`` moves them. Non-tensor keywords ride along in a closure.
    """
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not tensor_keys:
        return (functools.partial(forward, **kwargs) if kwargs else forward), args
    rest = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    count = len(args)

    def function(*flat):
        return forward(*flat[:count], **rest, **dict(zip(tensor_keys, flat[count:])))
    return function, args + tuple(kwargs[k] for k in tensor_keys)


def _drop_cache(kwargs: dict) -> dict:
    if not any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
        return kwargs
    warnings.warn("remat: a KV cache was passed to a treated block in training; it is dropped (as "
                  "Hugging Face does under gradient checkpointing). Set use_cache=False.", stacklevel=3)
    return {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}


@functools.lru_cache(maxsize=1)
def saved_ops() -> frozenset:
    """Ops whose outputs the ``selective`` policy keeps: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_context():
    """Context pair for ``checkpoint(context_fn=...)``: save matmul/attention outputs.

    In eager mode the forward also runs under :class:`_KeptOutputGuard`, which refuses a
    block that modifies a kept output in place: torch's own check misses a mutation made
    through an ``_unsafe_view`` (``torch.matmul`` on 4-D tensors returns one), and the
    recompute would then apply the mutation twice and silently change the gradients
    (transformers < 5 T5 does ``scores += position_bias``).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    forward, recompute = create_selective_checkpoint_contexts(list(saved_ops()))
    if _tracing():
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
