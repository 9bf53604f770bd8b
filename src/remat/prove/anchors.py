"""The field's fused linear cross-entropy losses as bench anchors: Liger and Apple's CCE.

remat's chunked head (:mod:`remat.head`) is one answer to the LM head's logits, the
largest activation of a long-sequence step; the field's answer is a fused kernel that never
writes the ``[tokens, vocab]`` logits at all. The bench measures both in the same process on
the same batch, so a claim about the head is made against the kernels people actually use:
``liger`` (``LigerFusedLinearCrossEntropyLoss``) and ``cce``
(``cut_cross_entropy.linear_cross_entropy``), each on a ``keep`` model (no checkpointing).

How: neither library is patched into the model (Liger's ``apply_liger_kernel_to_*`` exists
per family and also swaps norms and MLPs, which would measure more than the loss). Instead
:func:`fused_loss_forward` runs the model's body (``model.base_model``) to its final hidden
states and hands them, the output embedding's weight and the labels shifted as Hugging Face
shifts them to the fused loss, so the row computes the model's own loss and nothing else
changes. The loss op is kept apart from the bench's strategy wiring (:func:`fused_anchor`),
as Liger keeps its ops apart from its model patches.

Limits: both packages run Triton kernels, so the rows apply on a GPU only (on the CPU they
are recorded as skipped, saying so); the LM head must have no bias, and a model that
soft-caps or scales its logits (Gemma 2, Cohere) is skipped, since the fused loss would not
compute its loss. Neither package is a dependency of remat: an anchor that does not import
is refused before anything is measured, with the command that installs it.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Callable, Optional

import torch


class Skip(Exception):
    """A bench strategy that does not apply here; the message says why (the bench records it
    as ``skipped``). It lives in this module, which imports nothing of the bench's, so that
    both raise the same class."""


# name -> (module to import, distribution to install, what the row measures)
FUSED_LOSSES = {
    "liger": ("liger_kernel", "liger-kernel", "Liger LigerFusedLinearCrossEntropyLoss"),
    "cce": ("cut_cross_entropy", "cut-cross-entropy", "Apple cut_cross_entropy.linear_cross_entropy"),
}


def fused_loss_unavailable(name: str) -> Optional[str]:
    """None if the anchor ``name`` can run here, else a message that says what to install."""
    if name not in FUSED_LOSSES:
        return f"unknown anchor {name!r}; known: {', '.join(FUSED_LOSSES)}"
    module, dist, _ = FUSED_LOSSES[name]
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a kernel package failing at import (no Triton, no GPU)
        return (f"the {name} anchor needs the {module} module, which does not import here "
                f"({type(e).__name__}: {str(e)[:120]}); install it with `pip install {dist}` or, on a "
                f"machine without a package registry, `pip install --no-deps .whl/{module}-*.whl`")
    return None


def fused_loss(name: str) -> Callable:
    """``loss(hidden [N, H], weight [V, H], targets [N]) -> mean CE`` of the anchor ``name``
    (targets equal to -100 are ignored, as in Hugging Face's loss)."""
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        module = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda hidden, weight, targets: module(weight, hidden, targets)
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy
        return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets, ignore_index=-100)
    raise ValueError(f"unknown fused loss {name!r}; known: {', '.join(FUSED_LOSSES)}")


def fused_loss_forward(model, loss: Callable) -> Callable:
    """``forward(input_ids=, labels=, ...)`` for a causal LM whose head and loss are ``loss`` on
    the final hidden states and the output embedding's weight; returns an object with
    ``.loss``, as a Hugging Face model does. Targets are shifted as Hugging Face shifts them
    (``labels[:, 1:]``, then one ignored position per row), so the loss is the model's own."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise Skip("the fused-loss anchors take an LM head without bias")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise Skip("the model transforms its logits (soft-capping or scaling); the anchor would not "
                   "compute the model's loss")
    body = model.base_model

    def forward(input_ids, labels=None, **kwargs):
        hidden = body(input_ids=input_ids, **kwargs).last_hidden_state
        labels = input_ids if labels is None else labels
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        return types.SimpleNamespace(loss=loss(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                               targets.reshape(-1)))
    return forward


def fused_anchor(name: str) -> Callable:
    """The bench's ``prepare(model, batch)`` for the anchor ``name``: the fused-loss forward on
    the untouched model, or :class:`Skip` off the GPU or when the package does not import."""
    def prepare(model, batch):
        if next(model.parameters()).device.type != "cuda":
            raise Skip(f"{name} runs Triton kernels: it only applies on a GPU")
        why = fused_loss_unavailable(name)
        if why:
            raise Skip(why)
        return fused_loss_forward(model, fused_loss(name)), contextlib.nullcontext, None, {
            "method": FUSED_LOSSES[name][2]}
    return prepare
