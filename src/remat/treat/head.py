"""Chunked LM head for Hugging Face models: the loss from ``labels`` without [tokens x vocab] logits.

How: the model's forward runs as usual up to its output embedding (``lm_head``); that one
call is intercepted, the hidden states it receives are kept, and the loss is computed
from them by :func:`remat.treat.chunked_loss.chunked_cross_entropy` (the loss op, a chunk
of tokens at a time; it knows nothing of Hugging Face). This module is the integration:
finding the LM inside the model (PEFT wrappers are looked through), reproducing the
model's loss semantics, its logit transform, and checking the transform on a probe.

What is reproduced from the model: label shifting (``ForCausalLMLoss``: labels padded
with ``ignore_index`` and shifted; ``shift_labels=`` used as given), masked-LM labels (no
shift), ``ignore_index``, the mean over non-ignored tokens or ``sum / num_items_in_batch``
(with no valid target the loss is the model's nan and the gradients are zeros, see
:mod:`~remat.treat.chunked_loss`), Gemma's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``, an lm_head bias, tied embeddings (the
gradient for the shared weight is returned once and autograd adds it to the embedding's),
frozen heads (LoRA: no weight gradient is computed) and MoE router auxiliary losses. The
logit transform is *checked*, once per model and dtype: the intercepted ``lm_head``
returns a small probe tensor and the model's own post-processing of it must equal ours,
else the call raises. fp32 matches the model's loss and gradients within 1e-6 relative
(the plain path's own fp32 rounding noise), bf16 within the plain path's own error
against fp64.

Integration: :func:`enable_chunked_head` installs, through :mod:`remat.treat.patches`,
the LM module's ``forward`` (:func:`_chunked_forward`) and its ``lm_head``'s
(:func:`_capture`, a pass-through except inside a chunked call);
:func:`disable_chunked_head` removes both. A call with ``labels`` while grad is enabled
returns the model's usual output class with ``loss`` set and ``logits=None``; any other
call (generation, evaluation, ``torch.no_grad()`` with labels, which the Trainer's eval
loop uses to get logits) runs the original forward untouched. The treated ``forward``
keeps the model's signature (``inspect.signature``), so the Trainer's
``remove_unused_columns`` and its ``num_items_in_batch`` detection see the real one.

``torch.compile`` (``model.compile()``, ``torch.compile(model)``, per-block compile): the
interception and the loss run as Python on purpose, the graph breaks at two clean
boundaries. The chunked ``forward`` is a frame dynamo skips (``torch.compiler.disable``,
not recursive), so the model's own forward it calls is compiled; the ``lm_head`` capture
and the loss are skipped entirely (the loss op compiles its own kernel on CUDA). The
obvious alternative, letting dynamo trace the interception, recompiled the model at every
step (a new patch object per call) or, on CUDA, traced around the patched ``lm_head``.

Limits: the output embedding must be a plain ``nn.Linear`` (LoRA or quantised layers on
``lm_head`` are refused); the model's forward must compute its loss through
``self.loss_function`` (or ``CrossEntropyLoss()`` for masked LMs).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat.treat import patches
from remat.treat.chunked_loss import chunked_cross_entropy, compute_dtype_of, is_fake

_TAG = "head"
_PROBE = (-48.0, -6.0, -1.5, -0.25, 0.0, 0.5, 3.0, 40.0)  # exact in fp16/bf16


@dataclass
class _HeadState:
    signature: Any
    chunk_tokens: Optional[int]
    masked: bool            # masked LM: labels are not shifted
    num_items: bool         # the model's loss honours num_items_in_batch / ignore_index kwargs
    aux_coef: bool          # the model adds router_aux_loss_coef * aux_loss when labels are given
    verified: set = field(default_factory=set)
    captured: Optional[list] = None  # during a chunked call: where the lm_head's input goes


def check_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None):
    """Raise the error :func:`enable_chunked_head` would raise, without changing ``model``;
    returns the LM module and the state the head would run with."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens <= 0):
        raise ValueError(f"chunk_tokens must be a positive integer or None (None: chosen for the "
                         f"vocabulary), got {chunk_tokens!r}")
    lm = _find_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(
            f"the chunked head needs {type(lm).__name__}'s output embedding to be a plain torch.nn.Linear, "
            f"got {type(head).__name__} (LoRA/quantisation on lm_head?); leave lm_head out of "
            "target_modules or use head='plain'")
    masked, num_items, aux = _loss_semantics(lm)
    signature = inspect.signature(type(lm).forward).replace(
        parameters=list(inspect.signature(type(lm).forward).parameters.values())[1:])
    if "labels" not in signature.parameters:
        raise ValueError(f"{type(lm).__name__}.forward has no 'labels' parameter; the chunked head "
                         "replaces the loss computed from labels: use head='plain'")
    return lm, _HeadState(signature, chunk_tokens, masked, num_items, aux)


def enable_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None) -> nn.Module:
    """Compute ``model``'s LM loss a chunk of tokens at a time (in place; returns ``model``).

    ``chunk_tokens``: rows per chunk; None picks
    :func:`~remat.treat.chunked_loss.default_chunk_tokens` for the vocabulary. Raises
    ValueError or TypeError for a model whose head or loss this module cannot reproduce
    exactly, before changing anything. The LM's ``forward`` keeps its signature (``inspect.signature``), so
    the Trainer's ``remove_unused_columns`` sees the model's real arguments.
    """
    lm, state = check_chunked_head(model, chunk_tokens)
    for fn, recursive in _EAGER_FRAMES:  # made now, so a compiled forward only looks them up
        _eager(fn, recursive)
    disable_chunked_head(lm)
    patches.install(lm, "forward", _chunked_forward, tag=_TAG, state=state)
    patches.install(lm.get_output_embeddings(), "forward", _capture, tag=_TAG, state=state)
    return model


def disable_chunked_head(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_chunked_head`; a no-op on a model without it."""
    patches.remove(model, tag=_TAG)
    return model


def _find_lm(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_chunked_head expects a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():  # outermost first; class-level lookup skips PEFT's __getattr__
        get_out = getattr(type(module), "get_output_embeddings", None)
        if callable(get_out) and hasattr(module, "config") and get_out(module) is not None:
            return module
    raise ValueError(
        f"no LM head found in {type(model).__name__}: the chunked head needs a Hugging Face causal "
        "or masked LM (a module whose get_output_embeddings() returns its lm_head); use head='plain'")


def _loss_semantics(lm: nn.Module):
    name = type(lm).__name__
    try:
        source = inspect.getsource(inspect.unwrap(type(lm).forward))
    except (OSError, TypeError):
        raise ValueError(f"cannot read {name}.forward's source to check how it computes its loss; "
                         "the chunked head only reproduces losses it has checked: use head='plain'") from None
    refuse = (f"{name}'s loss is not one the chunked head reproduces exactly ({{}}); "
              "use head='plain' for this model")
    extra = re.findall(r"loss \+= (.*)|loss = loss \+ (.*)", source)
    aux = bool(extra)
    if any("router_aux_loss_coef * aux_loss" not in "".join(e) for e in extra):
        raise ValueError(refuse.format("it adds other terms to the loss"))
    if "self.loss_function(" in source:
        from transformers.loss.loss_utils import LOSS_MAPPING
        fn = lm.loss_function
        if fn is LOSS_MAPPING["ForCausalLM"]:
            return False, True, aux
        if fn is LOSS_MAPPING["ForMaskedLM"]:
            return True, True, aux
        raise ValueError(refuse.format(f"loss_function is {getattr(fn, '__name__', fn)}"))
    if "ForMaskedLM" in name and "CrossEntropyLoss()" in source:
        return True, False, aux
    raise ValueError(refuse.format("its forward does not call self.loss_function"))


def _logit_transform(lm: nn.Module):
    """The model's post-``lm_head`` logit transform as (key, function or None)."""
    config = lm.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None and hasattr(config, "get_text_config"):
        cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        cap = float(cap)
        return ("softcap", cap), lambda z: torch.tanh(z / cap) * cap
    scale = getattr(lm, "logit_scale", getattr(config, "logit_scale", None))
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return ("scale", scale), lambda z: z * scale
    div = getattr(config, "logits_scaling", None)
    if isinstance(div, (int, float)) and not isinstance(div, bool):
        return ("div", div), lambda z: z / div
    return ("identity",), None


def _chunked_forward(patch, *args, **kwargs):
    """The LM's ``forward``: as a frame ``torch.compile`` does not trace (see the module
    docstring); the model's own forward, which it calls, is traced."""
    return _eager(_forward, recursive=False)(patch, *args, **kwargs)


def _forward(patch, *args, **kwargs):
    state = patch.state
    bound = state.signature.bind_partial(*args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not torch.is_grad_enabled():
        return patch.call_previous(*args, **kwargs)
    bound.arguments["labels"] = None
    state.captured = []
    try:
        out = patch.call_previous(*bound.args, **bound.kwargs)
    finally:
        captured, state.captured = state.captured, None
    return _eager(_head_loss)(patch.module, state, out, captured, labels, kwargs)


def _capture(patch, hidden, *args, **kwargs):
    """The ``lm_head``'s ``forward``: inside a chunked call it keeps the hidden states and
    returns a small probe instead of the logits (see :func:`_verify`); else the lm_head."""
    if patch.state.captured is None:
        return patch.call_previous(hidden, *args, **kwargs)
    return _eager(_keep)(patch.state.captured, hidden, patch.module.weight)


def _keep(captured, hidden, weight):
    captured.append(hidden)
    probe = torch.tensor(_PROBE, dtype=compute_dtype_of(hidden, weight), device=hidden.device)
    return probe.expand(*hidden.shape[:-1], len(_PROBE)).clone()


def _head_loss(self, state, out, captured, labels, kwargs):
    """The chunked loss from the captured hidden states, in the model's output class."""
    if len(captured) != 1:
        raise ValueError(f"{type(self).__name__}.forward called its lm_head {len(captured)} times; the "
                         "chunked head handles one call per forward: use head='plain'")
    head = self.get_output_embeddings()
    hidden = captured[0].to(head.weight.device)
    is_tuple = isinstance(out, tuple)
    probe_out = out[0] if is_tuple else out.logits
    key, transform = _logit_transform(self)
    cd = compute_dtype_of(hidden, head.weight)
    if (cd, key) not in state.verified and not is_fake(hidden):  # fake tensors hold no values
        _verify(self, probe_out, transform, cd, hidden)
        state.verified.add((cd, key))

    get = kwargs.get  # loss keywords (Trainer's num_items_in_batch ...) are always passed by name
    ignore = get("ignore_index", -100) if state.num_items else -100
    num_items = get("num_items_in_batch") if state.num_items else None
    shift = get("shift_labels") if state.num_items else None
    if state.masked:
        targets = labels
    elif shift is not None:
        targets = shift
    else:
        targets = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    loss = chunked_cross_entropy(hidden, head.weight, head.bias, targets, chunk_tokens=state.chunk_tokens,
                                 ignore_index=ignore, num_items_in_batch=num_items, transform=transform,
                                 compute_dtype=cd)
    aux = None if is_tuple else out.get("aux_loss")
    if state.aux_coef and aux is not None:
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    if is_tuple:
        return (loss,) + tuple(out[1:])
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)


# frames torch.compile must not trace: (function, recursive); see the module docstring
_EAGER_FRAMES = ((_forward, False), (_keep, True), (_head_loss, True))
_EAGER = {}


def _eager(fn, recursive=True):
    """``torch.compiler.disable(fn, recursive)``, made once (importing dynamo takes seconds,
    so not at import time; a Hugging Face model has imported it already)."""
    wrapped = _EAGER.get(fn.__name__)
    if wrapped is None:
        wrapped = _EAGER[fn.__name__] = torch.compiler.disable(fn, recursive=recursive)
    return wrapped


def _verify(lm, probe_out, transform, cd, hidden):
    probe = torch.tensor(_PROBE, dtype=cd, device=hidden.device)
    expected = probe if transform is None else transform(probe)
    shape = (*hidden.shape[:-1], len(_PROBE))
    ok = (torch.is_tensor(probe_out) and tuple(probe_out.shape) == shape and torch.allclose(
        probe_out.detach().float(), expected.float().expand(shape), rtol=2 * torch.finfo(cd).eps, atol=0))
    if not ok:
        got = probe_out.detach().reshape(-1, len(_PROBE))[0].tolist() if torch.is_tensor(probe_out) else probe_out
        raise ValueError(
            f"{type(lm).__name__} post-processes its logits in a way the chunked head does not reproduce: "
            f"lm_head outputs {list(_PROBE)} became {got}, expected {expected.float().tolist()}. "
            "Use head='plain' for this model (and report it: remat should learn the transform).")
