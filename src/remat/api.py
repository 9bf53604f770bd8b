"""``remat.apply`` and ``remat.remove``: change a model in place, and undo it.

``apply`` discovers the blocks (or takes ``blocks=``), turns the spec into a
:class:`~remat.plan.Plan`, refuses a model on which Hugging Face gradient checkpointing
is on, and treats each block. It also guards the model against Hugging Face
checkpointing being switched on *later* (the Trainer does that at ``train()`` with
``gradient_checkpointing=True``): ``gradient_checkpointing_enable`` then raises instead
of silently checkpointing every block twice.

Applying again replaces the previous plan; a block is never wrapped twice.
"""
from __future__ import annotations

import types
from typing import Optional

import torch.nn as nn

from remat.treat.discovery import BlockSelector, discover
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan, resolve
from remat.treat.treatments import apply_treatment, remove_treatment, treatment_of


def apply(model: nn.Module, spec="full", *, blocks: BlockSelector = None,
          head: Optional[str] = None, chunk_tokens: Optional[int] = None,
          offload_options: Optional[dict] = None) -> nn.Module:
    """Treat ``model``'s blocks according to ``spec``; returns ``model`` (changed in place).

    ``spec``: a treatment for every block (``"full"``, ``"selective"``, ``"attention"``,
    ``"mlp"``, ``"offload"``, ``"full+offload"``, ``"keep"``), ``"every:N[:treatment]"``,
    ``"first:N[:treatment]"``, a ``{block_name: treatment}`` mapping, or a :class:`Plan`.
    ``head="chunked"`` (or a plan whose head is chunked) computes the LM loss a chunk of
    tokens at a time; see :mod:`remat.treat.head`. ``offload_options`` go to
    :class:`remat.offload.engine.OffloadEngine` (a plan may carry them in ``notes["offload_options"]``).
    """
    _refuse_hf_checkpointing(model)
    structure = discover(model, blocks)
    plan = resolve(spec, structure.block_names)
    if head is not None or chunk_tokens is not None:
        plan = Plan(plan.blocks, head or plan.head, chunk_tokens or plan.chunk_tokens, plan.notes)
    remove(model)
    engine = None
    if any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values()):
        from remat.offload.engine import OffloadEngine
        options = offload_options if offload_options is not None else plan.notes.get("offload_options")
        engine = OffloadEngine(model, **dict(options or {}))
    for index, (name, block) in enumerate(structure.blocks(model)):
        apply_treatment(block, plan.blocks.get(name, "keep"), engine=engine, key=index)
    if plan.head == "chunked":
        from remat.treat.head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=plan.chunk_tokens)
    _guard_hf_checkpointing(model)
    model.__dict__["_remat_plan"] = plan
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every module gets back its original forward."""
    for module in model.modules():
        remove_treatment(module)
        for name, (had, previous) in module.__dict__.pop("_remat_hf_guard", {}).items():
            if had:
                module.__dict__[name] = previous
            else:
                module.__dict__.pop(name, None)
    plan = model.__dict__.pop("_remat_plan", None)
    if plan is not None and plan.head == "chunked":
        from remat.treat.head import disable_chunked_head
        disable_chunked_head(model)
    return model


def current_plan(model: nn.Module) -> Optional[Plan]:
    """The plan last applied to ``model`` by :func:`apply`, or None."""
    return model.__dict__.get("_remat_plan")


def treatments(model: nn.Module, blocks: BlockSelector = None) -> dict:
    """``{block_name: treatment}`` as the model is now."""
    structure = discover(model, blocks)
    return {name: treatment_of(block) for name, block in structure.blocks(model)}


def _refuse_hf_checkpointing(model: nn.Module) -> None:
    on = [name or type(model).__name__ for name, m in model.named_modules()
          if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        raise ValueError(
            "Hugging Face gradient checkpointing is on for this model "
            f"({', '.join(on[:3])}{' ...' if len(on) > 3 else ''}); remat would checkpoint on top of "
            "it. Call model.gradient_checkpointing_disable() first (Trainer: gradient_checkpointing="
            "False), then remat.apply(model, ...) gives the same memory saving and more.")


# transformers 5.x renamed the switch; both names stay guarded while either exists
_HF_ENABLE_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def _guard_hf_checkpointing(model: nn.Module) -> None:
    for module in model.modules():
        names = [n for n in _HF_ENABLE_METHODS if callable(getattr(type(module), n, None))]
        if not names:
            continue
        module.__dict__["_remat_hf_guard"] = {n: (n in module.__dict__, module.__dict__.get(n)) for n in names}
        for name in names:
            module.__dict__[name] = types.MethodType(_refuse_enable, module)


def _refuse_enable(self, *args, **kwargs):
    raise ValueError(
        "remat is applied to this model, so Hugging Face gradient checkpointing must stay off: "
        "it would checkpoint every block a second time. Set gradient_checkpointing=False in "
        "TrainingArguments (or don't call gradient_checkpointing_enable), or call "
        "remat.remove(model) first if you want Hugging Face's checkpointing instead.")
