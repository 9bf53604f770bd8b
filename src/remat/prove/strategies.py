"""The rows of ``remat bench``: each strategy is a name, a kind and a ``prepare(model, batch)``.

``prepare`` turns a freshly built model into what the bench times: ``(forward, context manager
factory, plan or None[, notes dict])``; :func:`remat.prove.bench.measure` runs it under one protocol
for every row. A strategy that cannot apply raises :class:`Skip` with the reason.

Anchors: ``eager`` (no checkpointing), ``hf_full`` (HF gradient checkpointing, non-reentrant),
``every2`` (``checkpoint_wrapper`` on every second layer), ``sac`` (HF checkpointing with an op-level
policy saving matmul and attention outputs), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu
(pin_memory=True)``), ``hf_every2`` and ``hf_offload`` (transformers' own ``every_n_layers=2`` /
``offload=True`` checkpointing, skipped where the arguments are absent) and, optionally,
``compile_<b>`` (``torch.compile`` with ``activation_memory_budget=b``) and the field's fused losses on
a ``keep`` model (``liger``, ``cce``: :mod:`remat.prove.anchors`), when they import.

remat rows: ``remat:<spec>`` (a uniform spec), ``remat@<budget>`` (the planner's plan for it) and
``remat+compile@<budget>`` (``remat.plan(..., compile=True)``, applied, then ``model.compile()``; the
compile happens in the warm-up steps, recorded as ``warmup_s``), with ``compile_1+mask_skip`` before
them: stock ``torch.compile`` with only remat's attention-mask skip (:mod:`remat.treat.mask_skip`), to
show what the plans add to it. Compiled rows record ``mask_skip``: whether that skip was in force.

The stacks users run (``stacks``: :mod:`remat.prove.stacks`): ``unsloth``, ``liger_hf``,
``liger_keep``, ``liger_remat@<budget>`` and ``compile_hf``; a Liger row builds its model inside
:func:`remat.prove.stacks.liger_patched` (:attr:`Strategy.around`), so the rows around it run the
stock modules. Compiled rows come last in :func:`strategies` (a compile takes most of a minute, and
the rest should not wait on it). Which transformers version names what: docs/design/diagnosis.md.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from remat.prove import stacks
from remat.prove.anchors import Skip, fused_anchor, fused_loss_unavailable
from remat.treat import mask_skip


@dataclass(frozen=True)
class Strategy:
    """One row of the bench."""
    name: str
    kind: str  # "anchor" (a stock strategy) or "remat"
    prepare: Callable  # (model, batch) -> (forward, context manager factory, plan or None[, notes dict])
    budget_bytes: Optional[int] = None
    compiled: bool = False  # runs under torch.compile: the compiler state is reset around it
    around: Optional[Callable] = None
    """``(model_type, cuda) -> context manager`` the bench enters before it builds the row's model and
    leaves after the model is freed (a Liger row's module-wide patch: :func:`remat.prove.stacks.liger_patched`)."""


def _plain(model, batch):
    return model, contextlib.nullcontext, None


def _enable_hf(model, checkpoint_kwargs: dict) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # newer transformers: gradient_checkpointing_enable is a deprecated alias
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def _hf_full(model, batch):
    _enable_hf(model, {"use_reentrant": False})
    return model, contextlib.nullcontext, None


def _compiled_hf(backend: Optional[str]):
    """HF checkpointing, then ``torch.compile`` (default ``activation_memory_budget``)."""
    def prepare(model, batch):
        _enable_hf(model, {"use_reentrant": False})
        return torch.compile(model, **_backend(backend)), contextlib.nullcontext, None
    return prepare


def _unsloth(model, batch):
    """HF checkpointing with Unsloth's offloaded checkpointer as every layer's checkpoint function
    (what ``use_gradient_checkpointing="unsloth"`` installs): the layer's input goes to host memory."""
    if next(model.parameters()).device.type != "cuda":
        raise Skip("Unsloth's offloaded checkpointing moves activations to host memory: it only applies on a GPU")
    checkpointer = stacks.unsloth_checkpointer()
    _enable_hf(model, {"use_reentrant": False})

    def offloaded(function, *args, **kwargs):
        return checkpointer.apply(functools.partial(function, **kwargs) if kwargs else function, *args)
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    for module in layers:
        module._gradient_checkpointing_func = offloaded
    return model, contextlib.nullcontext, None, {"method": f"unsloth_zoo {checkpointer.__name__}"}


def hf_checkpointing(model):
    """transformers' own every-N / offload checkpointing on ``model``: ``(method, name of its
    kwargs argument)``, or raises :class:`Skip` saying why the installed transformers has none.

    ``activation_checkpointing_enable(every_n_layers=, offload=)`` where it exists; transformers
    5.17 has the same two arguments on ``gradient_checkpointing_enable`` (read from its source),
    older versions on neither."""
    method = getattr(model, "activation_checkpointing_enable", None)
    if callable(method):
        return method, "activation_checkpointing_kwargs"
    method = getattr(model, "gradient_checkpointing_enable", None)
    if callable(method) and {"every_n_layers", "offload"} <= set(inspect.signature(method).parameters):
        return method, "gradient_checkpointing_kwargs"
    try:
        import transformers
        version = f"transformers {transformers.__version__}"
    except ImportError:
        version = "this model"
    raise Skip(f"{version} has no activation_checkpointing_enable(every_n_layers=, offload=) "
                "(nor those arguments on gradient_checkpointing_enable)")


def _hf_native(every_n_layers: int = 1, offload: bool = False):
    def prepare(model, batch):
        method, kwargs_name = hf_checkpointing(model)
        if offload and next(model.parameters()).device.type != "cuda":
            raise Skip("offload moves activations to host memory: it only applies on a GPU")
        method(**{kwargs_name: {"use_reentrant": False}}, every_n_layers=every_n_layers, offload=offload)
        return model, contextlib.nullcontext, None, {"method": method.__name__}
    return prepare


def _hf_sac(model, batch):
    from remat.treat.selective import selective_context
    # torch's selective-checkpoint modes as a user sets them, without remat's in-place guard
    _enable_hf(model, {"use_reentrant": False, "context_fn": functools.partial(selective_context, guard=False)})
    return model, contextlib.nullcontext, None


def _every2(model, batch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from remat.treat.discovery import discover
    names = discover(model).block_names[::2]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, checkpoint_wrapper(getattr(parent, child),
                                                  checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model, contextlib.nullcontext, None


def _save_on_cpu(model, batch):
    if next(model.parameters()).device.type != "cuda":
        raise Skip("save_on_cpu moves activations to host memory: it only applies on a GPU")
    return model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True), None


def _compiled(budget: float, backend: Optional[str] = None, *, skip_masks: bool = False):
    """Stock ``torch.compile`` at ``activation_memory_budget=budget``; ``skip_masks``: with remat's mask
    skip alone (no plan), to show how much of a compiled remat row's speed is
    :mod:`remat.treat.mask_skip` rather than its plan."""
    def prepare(model, batch):
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = budget  # measure() restores it afterwards
        if skip_masks:
            mask_skip.hold(model)
        return torch.compile(model, **_backend(backend)), contextlib.nullcontext, None
    return prepare


def _backend(backend: Optional[str]) -> dict:
    return {"backend": backend} if backend else {}


def _remat_spec(spec: str):
    def prepare(model, batch):
        import remat
        head = None
        if spec.endswith("+chunked"):
            spec_, head = spec[: -len("+chunked")], "chunked"
        else:
            spec_ = spec
        remat.apply(model, spec_, head=head)
        return model, contextlib.nullcontext, None
    return prepare


def _remat_budget(budget_bytes: int, gpu: Optional[str], profiles: dict, *, compile: bool = False,
                  backend: Optional[str] = None, optimizer: str = "none"):
    """remat's plan for ``budget_bytes`` (``compile``: planned for, and run under, ``model.compile()``).
    One profile per batch shape and mode serves every budget: ``remat.plan(..., profiled=)``
    (``profiles`` is one model's: the Liger-patched model's rows keep a dict of their own)."""
    def prepare(model, batch):
        import remat
        kwargs = {"gpu": gpu} if gpu else {}
        key = (compile, tuple((k, tuple(v.shape)) for k, v in sorted(batch.items())))
        if key not in profiles:
            profiles[key] = remat.profile(model, batch, compile=compile, optimizer=optimizer, **kwargs)
        plan = remat.plan(model, batch, budget_bytes, compile=compile, profiled=profiles[key], optimizer=optimizer,
                          **kwargs)
        remat.apply(model, plan)
        if compile:
            model.compile(**_backend(backend))  # in place: remat's wrappers stay visible to remat.remove
        return model, contextlib.nullcontext, plan
    return prepare


def strategies(budgets=(), *, uniform=("full", "selective"), compile_budgets=(), anchors=True,
               gpu: Optional[str] = None, compile_plans: bool = False, fused_anchors=(),
               compile_backend: Optional[str] = None, stack_rows=(), optimizer: str = "none") -> list:
    """The strategies to measure, in order. ``gpu`` names the rates the planner uses off-GPU.

    ``compile_plans``: a ``remat+compile@<budget>`` row per budget. ``fused_anchors``: names in
    :data:`remat.prove.anchors.FUSED_LOSSES`; one that does not import is refused here
    (ValueError saying what to install), before anything is measured. ``stack_rows``: names in
    :data:`remat.prove.stacks.STACKS` (ValueError for others); one that cannot run is recorded as
    skipped when measured. ``compile_backend``: ``torch.compile``'s backend for every compiled row
    (default inductor; ``aot_eager`` keeps CPU tests fast). ``optimizer``: what remat's plans are
    made for (a name of :data:`remat.prove.bench.OPTIMIZERS`, as the bench steps)."""
    for name in fused_anchors:
        why = fused_loss_unavailable(name)
        if why:
            raise ValueError(why)
    unknown = [name for name in stack_rows if name not in stacks.STACKS]
    if unknown:
        raise ValueError(f"unknown stack rows {unknown}; known: {', '.join(stacks.STACKS)}")
    out = []
    if anchors:
        out += [Strategy("eager", "anchor", _plain), Strategy("hf_full", "anchor", _hf_full),
                Strategy("every2", "anchor", _every2), Strategy("sac", "anchor", _hf_sac),
                Strategy("save_on_cpu", "anchor", _save_on_cpu),
                Strategy("hf_every2", "anchor", _hf_native(every_n_layers=2)),
                Strategy("hf_offload", "anchor", _hf_native(offload=True))]
    if "unsloth" in stack_rows:
        out.append(Strategy("unsloth", "anchor", _unsloth))
    if "liger_hf" in stack_rows:
        out.append(Strategy("liger_hf", "anchor", _hf_full, around=stacks.liger_patched))
    if "liger_keep" in stack_rows:
        out.append(Strategy("liger_keep", "anchor", _plain, around=stacks.liger_patched))
    out += [Strategy(f"remat:{spec}", "remat", _remat_spec(spec)) for spec in uniform]
    profiles, liger_profiles = {}, {}
    out += [Strategy(f"remat@{_fmt_gib(b)}", "remat", _remat_budget(b, gpu, profiles, optimizer=optimizer),
                     budget_bytes=b) for b in budgets]
    if "liger_remat" in stack_rows:
        out += [Strategy(f"liger_remat@{_fmt_gib(b)}", "remat",
                         _remat_budget(b, gpu, liger_profiles, optimizer=optimizer), budget_bytes=b, around=stacks.liger_patched)
                for b in budgets]
    out += [Strategy(name, "anchor", fused_anchor(name)) for name in fused_anchors]
    # last: a compile takes most of a minute, and the rest should not wait on it
    if anchors:
        out += [Strategy(f"compile_{b:g}", "anchor", _compiled(b, compile_backend), compiled=True)
                for b in compile_budgets]
    if "compile_hf" in stack_rows:
        out.append(Strategy("compile_hf", "anchor", _compiled_hf(compile_backend), compiled=True))
    if compile_plans:
        out.append(Strategy("compile_1+mask_skip", "remat", _compiled(1.0, compile_backend, skip_masks=True),
                            compiled=True))
        out += [Strategy(f"remat+compile@{_fmt_gib(b)}", "remat",
                         _remat_budget(b, gpu, profiles, compile=True, backend=compile_backend, optimizer=optimizer),
                         budget_bytes=b, compiled=True) for b in budgets]
    return out


def _fmt_gib(n: int) -> str:
    from remat.units import format_size
    return format_size(n).replace(" ", "").replace(".00", "")
