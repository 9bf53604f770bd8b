"""``remat.apply`` and ``remat.remove``: change a model in place, and undo it.

``apply`` discovers the blocks (or takes ``blocks=``), turns the spec into a
:class:`~remat.plan.Plan`, refuses a model on which Hugging Face gradient checkpointing
is on, and treats each block. It also guards the model against Hugging Face
checkpointing being switched on *later* (the Trainer does that at ``train()`` with
``gradient_checkpointing=True``): ``gradient_checkpointing_enable`` then raises instead
of silently checkpointing every block twice.

Under ``torch.compile`` an applied model also gets transformers' attention-mask decision as
eager mode makes it (:mod:`remat.treat.mask_skip`: SDPA's causal kernel instead of a
materialised mask, process-wide while the model lives); ``remove`` gives that back too.

Applying again replaces the previous plan; a block is never wrapped twice. Blocks that a
plan puts in one segment (``"segments:K"``) share one :class:`~remat.treat.segments.Segment`,
made fresh at each apply.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch.nn as nn

from remat.planning.plans import OFFLOADING_TREATMENTS, Plan, resolve
from remat.treat import mask_skip, patches
from remat.treat.discovery import BlockSelector, discover
from remat.treat.segments import segments_of
from remat.treat.treatments import apply_treatment, check_treatment, treatment_of

_PLAN = "_remat_plan"


def apply(model: nn.Module, spec="full", *, blocks: BlockSelector = None,
          head: Optional[str] = None, chunk_tokens: Optional[int] = None,
          tile_tokens: Optional[int] = None, offload_options: Optional[dict] = None) -> nn.Module:
    """Treat ``model``'s blocks according to ``spec``; returns ``model`` (changed in place).

    ``spec``: a treatment for every block (``"full"``, ``"selective"``, ``"attention"``,
    ``"mlp"``, ``"offload"``, ``"full+offload"``, ``"tiled"``, ``"full+tiled"``, ``"full+offload+tiled"``,
    ``"keep"``), ``"every:N[:treatment]"``,
    ``"first:N[:treatment]"``, ``"segments:K"`` / ``"segments:sqrt"`` (K consecutive blocks
    checkpointed as one unit, see :mod:`remat.planning.plans`), a ``{block_name: treatment}``
    mapping, or a :class:`Plan`.
    ``head="chunked"`` (or a plan whose head is chunked) computes the LM loss a chunk of
    tokens at a time; see :mod:`remat.treat.head`. ``tile_tokens``: tokens per chunk of the
    tiled treatments' token-wise sub-modules (:mod:`remat.treat.tiled`; default: the plan's, else
    8192). ``offload_options`` go to :class:`remat.offload.engine.OffloadEngine` (a plan may carry
    them in ``notes["offload_options"]``).

    All or nothing: the spec, the head and every block's treatment are checked before the
    model is touched, and if installing fails anyway the model is put back exactly as it
    was, its previous plan included.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.apply expects a torch.nn.Module as its first argument, got "
                        f"{type(model).__name__}; call remat.apply(model, spec)")
    _refuse_hf_checkpointing(model)
    structure = discover(model, blocks)
    plan = resolve(spec, structure.block_names)
    if head is not None or chunk_tokens is not None or tile_tokens is not None:
        plan = dataclasses.replace(plan, head=head if head is not None else plan.head,
                                   chunk_tokens=chunk_tokens if chunk_tokens is not None else plan.chunk_tokens,
                                   tile_tokens=tile_tokens if tile_tokens is not None else plan.tile_tokens)
    named = structure.blocks(model)
    offloading = any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values())
    for name, block in named:
        try:
            check_treatment(block, plan.blocks.get(name, "keep"))
        except ValueError as error:
            raise ValueError(f"block {name}: {error}") from None
    if plan.head == "chunked":
        from remat.treat.head import check_chunked_head
        check_chunked_head(model, chunk_tokens=plan.chunk_tokens)
    previous = patches.remove(model)
    try:
        engine = None
        if offloading:
            from remat.offload.engine import OffloadEngine
            options = offload_options if offload_options is not None else plan.notes.get("offload_options")
            engine = OffloadEngine(model, **dict(options or {}))
        segments = segments_of({name: plan.blocks.get(name, "keep") for name, _ in named})
        for index, (name, block) in enumerate(named):
            apply_treatment(block, plan.blocks.get(name, "keep"), engine=engine, key=index,
                            segment=segments.get(name, (None, 0)), tile_tokens=plan.tile_tokens)
        if plan.head == "chunked":
            from remat.treat.head import enable_chunked_head
            enable_chunked_head(model, chunk_tokens=plan.chunk_tokens)
        _guard_hf_checkpointing(model)
        patches.install_value(model, _PLAN, plan, tag="plan")
    except BaseException:
        patches.remove(model)
        patches.reinstall(previous)
        raise
    mask_skip.hold(model, structure.block_names)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every change remat made is undone, newest first. A wrapper that
    another library installed over remat's (accelerate's autocast ``forward``) stays, and
    remat's part inside it passes calls straight through."""
    patches.remove(model)
    mask_skip.release(model)
    return model


def current_plan(model: nn.Module) -> Optional[Plan]:
    """The plan last applied to ``model`` by :func:`apply`, or None."""
    return model.__dict__.get(_PLAN)


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
        for name in _HF_ENABLE_METHODS:
            if callable(getattr(type(module), name, None)):
                patches.install(module, name, _refuse_enable, tag="hf-guard")


def _refuse_enable(patch, *args, **kwargs):
    raise ValueError(
        "remat is applied to this model, so Hugging Face gradient checkpointing must stay off: "
        "it would checkpoint every block a second time. Set gradient_checkpointing=False in "
        "TrainingArguments (or don't call gradient_checkpointing_enable), or call "
        "remat.remove(model) first if you want Hugging Face's checkpointing instead.")
