"""Liger's fused linear cross-entropy as a model's loss: the head mode ``"liger"``, per instance.

What: the LM module's ``forward`` becomes its family's ``lce_forward`` from liger-kernel (the model's
forward with the loss computed by ``LigerFusedLinearCrossEntropyFunction``: the ``[tokens x vocab]``
logits never exist, a chunk of them at a time, the input and weight gradients computed in the forward)
and the final norm runs Liger's RMSNorm, both installed through :mod:`remat.treat.patches` (tag
``"kernels-head"``; the ``forward`` keeps the model's signature for the Trainer's column filter), as
``use_liger_kernel=True`` runs them, but undoably and on this model alone.

Why beside remat's chunked head (:mod:`remat.head`): it is the loss users run with one flag, so a plan
chooses between the two (and the model's own) by what they cost; remat's reproduces every Hugging Face
loss it checks, Liger's the families it ships (the ones of :data:`remat.treat.kernels.FAMILIES`).

Limits: the output embedding must be a plain ``nn.Linear`` (LoRA on ``lm_head`` is refused: Liger's
loss reads its base weight); a model whose loss is Liger's already (liger-kernel patched it) has it as
its plain head, and the mode is not offered.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch.nn as nn

from remat.treat import patches
from remat.treat.kernels import (EXTRA, FAMILIES, _from_liger, _fused_norm, _Norm, _own_forward, family_of,
                                 liger_objects, liger_owned, liger_unavailable)

HEAD_TAG = "kernels-head"


def _find_lm(model: nn.Module) -> Optional[nn.Module]:
    """The outermost module with a config and an output embedding (a PEFT wrapper's base model)."""
    for module in model.modules():
        get_out = getattr(type(module), "get_output_embeddings", None)
        if callable(get_out) and hasattr(module, "config") and get_out(module) is not None:
            return module
    return None


def liger_loss(model: nn.Module) -> bool:
    """Whether ``model``'s LM computes its loss with Liger's fused linear cross-entropy already
    (its forward is Liger's ``lce_forward``: liger-kernel's patch, or remat's ``"liger"`` head)."""
    lm = _find_lm(model)
    return lm is not None and (patches.patch_of(lm, "forward", tag=HEAD_TAG) is not None or _liger_lm(lm))


def _liger_lm(lm: nn.Module) -> bool:
    """Whether liger-kernel itself made ``lm``'s forward its ``lce_forward`` (class-wide or on the instance)."""
    return _from_liger(_own_forward(lm)) or _from_liger(type(lm).forward)


def liger_head_unavailable(model: nn.Module) -> Optional[str]:
    """Why the ``"liger"`` head mode cannot run on ``model`` (liger-kernel missing, a family without
    Liger's ``lce_forward``, an output embedding that is not a plain ``nn.Linear``, a loss Liger's
    already computes), or None. Imports liger-kernel."""
    lm = _find_lm(model)
    if lm is None:
        return f"no LM head in {type(model).__name__}"
    family = family_of(lm)
    if family not in FAMILIES:
        return f"{type(lm).__name__} is not a family remat runs Liger's fused loss on ({', '.join(FAMILIES)})"
    if _liger_lm(lm):
        return f"{type(lm).__name__} computes its loss with Liger's fused linear cross-entropy already (its plain head)"
    if type(lm.get_output_embeddings()) is not nn.Linear:
        return (f"its output embedding is a {type(lm.get_output_embeddings()).__name__}, not a plain nn.Linear "
                "(LoRA or quantisation on lm_head): Liger's loss would read its base weight only")
    if (getattr(lm.config, "pretraining_tp", 1) or 1) > 1:
        return "pretraining_tp > 1, which Liger's loss refuses"
    if _own_forward(lm) is not None:
        return f"{type(lm).__name__}'s forward is replaced on the instance by another library"
    why = liger_unavailable()
    if why is not None:
        return f"liger-kernel does not import ({why}): {EXTRA}"
    try:
        importlib.import_module(f"liger_kernel.transformers.model.{family}").lce_forward  # noqa: B018
    except (ImportError, AttributeError) as error:
        return f"liger-kernel has no fused loss for {family} ({error})"
    return None


def install_liger_head(model: nn.Module) -> nn.Module:
    """Compute ``model``'s LM loss with Liger's fused linear cross-entropy (its family's ``lce_forward``
    as the LM's instance ``forward``, the signature kept) and its final norm with Liger's RMSNorm;
    ValueError where :func:`liger_head_unavailable` says why not. Returns ``model``."""
    why = liger_head_unavailable(model)
    if why is not None:
        raise ValueError(f"the 'liger' head cannot run on {type(model).__name__}: {why}; use head='plain' or "
                         "'chunked'")
    remove_liger_head(model)
    lm = _find_lm(model)
    family = family_of(lm)
    liger_objects()
    patches.install(lm, "forward", _liger_lm_forward, tag=HEAD_TAG, state=f"liger_kernel.transformers.model.{family}")
    base = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    norm = getattr(base, "norm", None)
    spec = FAMILIES[family]
    if isinstance(norm, nn.Module) and not liger_owned(norm) and getattr(norm, "weight", None) is not None:
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
        patches.install(norm, "forward", _fused_norm, tag=HEAD_TAG, bound=True,
                        state=_Norm(float(eps), spec.offset, spec.casting, spec.in_place))
    return model


def remove_liger_head(model: nn.Module) -> None:
    patches.remove(model, tag=HEAD_TAG)


def _liger_lm_forward(patch, *args, **kwargs):
    return importlib.import_module(patch.state).lce_forward(patch.module, *args, **kwargs)
