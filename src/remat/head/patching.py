"""Putting the chunked head on a Hugging Face model and taking it off: the two patches and the call.

How: the model's forward runs as usual up to its output embedding (``lm_head``); that one call
is intercepted, the hidden states it receives are kept, and the loss is computed from them by
:func:`remat.head.hf_model.model_loss` (the model's loss semantics, through the chunked op).
:func:`enable_chunked_head` installs, through :mod:`remat.treat.patches` (the one registry of
changes to a user's module), the LM module's ``forward`` (:func:`_chunked_forward`) and its
``lm_head``'s (:func:`_capture`, a pass-through except inside a chunked call);
:func:`disable_chunked_head` removes both. A call with ``labels`` while grad is enabled returns
the model's usual output class with ``loss`` set and ``logits=None``; any other call
(generation, evaluation, ``torch.no_grad()`` with labels, which the Trainer's eval loop uses to
get logits) runs the original forward untouched. The treated ``forward`` keeps the model's
signature (``inspect.signature``), so the Trainer's ``remove_unused_columns`` and its
``num_items_in_batch`` detection see the real one.

``torch.compile`` (``model.compile()``, ``torch.compile(model)``, per-block compile): the
interception and the loss run as Python on purpose, the graph breaks at two clean
boundaries. The chunked ``forward`` is a frame dynamo skips (``torch.compiler.disable``,
not recursive), so the model's own forward it calls is compiled; the ``lm_head`` capture
and the loss are skipped entirely (the loss op compiles its own kernel on CUDA). The
obvious alternative, letting dynamo trace the interception, recompiled the model at every
step (a new patch object per call) or, on CUDA, traced around the patched ``lm_head``.

Autocast: the loss runs under the autocast in force where the model called its ``lm_head``
(:func:`_head_loss`), whatever wraps the forward from outside.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from remat.head.chunked_loss import compute_dtype_of
from remat.head.hf_model import check_chunked_head, model_loss, probe
from remat.treat import patches
from remat.treat.refusals import StepRefusal
from remat.treat.dynamo_cache import eager

_TAG = "head"


def enable_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None) -> nn.Module:
    """Compute ``model``'s LM loss a chunk of tokens at a time, in place; the [tokens x vocab] logits never exist.

    Args:
        model: a Hugging Face model with an LM head (causal LM, masked LM or encoder-decoder).
        chunk_tokens: rows per chunk; None picks :func:`~remat.head.chunked_loss.default_chunk_tokens`
            for the vocabulary.

    Returns:
        ``model``, whose ``forward(..., labels=...)`` returns the same loss (and gradients) as before.
        The LM's ``forward`` keeps its signature, so the Trainer's ``remove_unused_columns`` sees the
        model's real arguments.

    Raises:
        ValueError or TypeError: a model whose head or loss this package cannot reproduce exactly
        (:func:`~remat.head.hf_model.check_chunked_head`), before anything is changed.

    Example::

        enable_chunked_head(model)
        model(input_ids=ids, labels=ids).loss.backward()
        disable_chunked_head(model)"""
    lm, state = check_chunked_head(model, chunk_tokens)
    for fn, recursive in _EAGER_FRAMES:  # made now, so a compiled forward only looks them up
        eager(fn, recursive)
    disable_chunked_head(lm)
    patches.install(lm, "forward", _chunked_forward, tag=_TAG, state=state)
    patches.install(lm.get_output_embeddings(), "forward", _capture, tag=_TAG, state=state)
    return model


def disable_chunked_head(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_chunked_head`; a no-op on a model without it.

    Args:
        model: the model :func:`enable_chunked_head` was given.

    Returns:
        ``model``, its LM head as it was."""
    patches.remove(model, tag=_TAG)
    return model


def has_chunked_head(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is the chunked head's.

    Args:
        module: any module (the LM module :func:`enable_chunked_head` patched, or another).

    Returns:
        True where :func:`enable_chunked_head` put its forward on ``module``."""
    return patches.patch_of(module, "forward", tag=_TAG) is not None


def _chunked_forward(patch, *args, **kwargs):
    """The LM's ``forward``: as a frame ``torch.compile`` does not trace (see the module
    docstring); the model's own forward, which it calls, is traced."""
    return eager(_forward, recursive=False)(patch, *args, **kwargs)


def _forward(patch, *args, **kwargs):
    state = patch.state
    bound = state.signature.bind_partial(*args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not torch.is_grad_enabled():
        return patch.call_previous(*args, **kwargs)
    bound.arguments["labels"] = None
    if state.decoder is not None:  # what the model's forward would have done with its labels
        state.decoder.prepare(patch.module, bound.arguments, labels)
    state.captured = []
    try:
        out = patch.call_previous(*bound.args, **bound.kwargs)
    finally:
        captured, state.captured = state.captured, None
    return eager(_head_loss)(patch.module, state, out, captured, labels, kwargs)


def _capture(patch, hidden, *args, **kwargs):
    """The ``lm_head``'s ``forward``: inside a chunked call it keeps the hidden states and
    returns a small probe instead of the logits (see :mod:`~remat.head.hf_model`); else the lm_head."""
    if patch.state.captured is None:
        return patch.call_previous(hidden, *args, **kwargs)
    return eager(_keep)(patch.state, hidden, patch.module.weight)


def _keep(state, hidden, weight):
    state.captured.append((hidden, _autocast_at(hidden.device.type)))
    return probe(hidden, weight.shape[0], state.row_probe, compute_dtype_of(hidden, weight))


def _autocast_at(device_type: str):
    """The autocast in force where the model calls its ``lm_head``: ``(device type, dtype)``, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):   # a device type autocast does not know (meta)
        pass
    return None


def _as_at_head(autocast, device_type: str):
    """The loss runs under the autocast the ``lm_head`` call saw (see :func:`_head_loss`)."""
    now = _autocast_at(device_type)
    if autocast == now:
        return contextlib.nullcontext()
    if autocast is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(autocast[0], dtype=autocast[1])


def _head_loss(self, state, out, captured, labels, kwargs):
    """The chunked loss from the captured hidden states, in the model's output class.

    It runs under the autocast that was in force where the model called its ``lm_head``, not the
    one around this call: a wrapper that enters autocast inside the model's ``forward`` (accelerate's
    ``prepare``, which wraps ``forward`` before remat's when it runs first) has left it by now, and
    the plain head's matmul ran under it. Without this, ``prepare`` then ``apply`` would compute the
    bf16 head in fp32, and its loss and gradients would differ from the plain head's, while ``apply``
    then ``prepare`` matched them."""
    if len(captured) != 1:
        raise StepRefusal(f"{type(self).__name__}.forward called its lm_head {len(captured)} times; the "
                         "chunked head handles one call per forward: use head='plain'")
    head = self.get_output_embeddings()
    hidden, autocast = captured[0]
    hidden = hidden.to(head.weight.device)
    with _as_at_head(autocast, hidden.device.type):
        return model_loss(self, state, out, hidden, head, labels, kwargs)


# frames torch.compile must not trace: (function, recursive); see the module docstring
_EAGER_FRAMES = ((_forward, False), (_keep, True), (_head_loss, True))
