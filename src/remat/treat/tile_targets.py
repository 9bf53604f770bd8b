"""What a tiled treatment may run in chunks: a block's token-wise sub-modules, checked before any change.

A token-wise sub-module is one whose every output row depends only on the same input row: an
MLP (dense or MoE: routing is per token) or a norm. :func:`tiled_targets` finds them (the
block's MLPs as :func:`~remat.treat.discovery.find_submodules` finds them, and its direct
children named like ``RMSNorm``/``LayerNorm``); :func:`check_tiling` refuses a block whose
targets cannot run on chunks of the hidden states alone, before the model is touched.

How a target is checked, each answer cached per module (or per block class):

- its ``forward`` signature names no second required argument (BLOOM's MLP takes the residual);
- the block's own source does not call it with more than the hidden states on every call
  (DeepSeek-V4 passes ``input_ids`` to its MoE), read with :mod:`ast`;
- a probe: 8 random tokens of its feature size run at once and as 3 + 5 give the same rows
  (with dropout's masks shared through :class:`~remat.treat.tile_replay.Replay`, its RNG,
  buffers and grads left alone). A module that raises on the probe, returns no tensor, or whose
  width cannot be read is refused with the reason.

Modules on the meta device or with fake parameters are taken as token-wise: nothing runs there,
and the real model is probed when the plan is applied.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
import weakref
from typing import Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from remat import caches
from remat.treat.discovery import find_submodules
from remat.treat.tile_replay import Replay

_NORM_CLASS = re.compile(r"(RMSNorm|RmsNorm|LayerNorm|Layernorm)$")
DEFAULT_TILE_TOKENS = 8192
"""Tokens per chunk where a record names none (the planner's own default,
:data:`remat.planning.plans.DEFAULT_TILE_TOKENS`, is this number: a test holds them equal)."""


def check_tile_tokens(tokens) -> None:
    """A chunk size is a positive integer (or None: :data:`DEFAULT_TILE_TOKENS`)."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0):
        raise ValueError(f"tile_tokens must be a positive integer (tokens per chunk of a tiled sub-module) "
                         f"or None for {DEFAULT_TILE_TOKENS}; got {tokens!r} ({type(tokens).__name__})")


def tiled_targets(block: nn.Module) -> list:
    """``[(relative name, module)]``: the token-wise sub-modules ``tiled`` runs in chunks: the block's
    MLPs (as :func:`~remat.treat.discovery.find_submodules` finds them) and its norms (direct
    children named like ``RMSNorm``/``LayerNorm``; group and batch norms mix tokens and are not)."""
    mlps = find_submodules(block, "mlp")
    norms = [(name, child) for name, child in block.named_children()
             if isinstance(child, nn.LayerNorm) or _NORM_CLASS.search(type(child).__name__)]
    return norms + mlps


def check_tiling(block: nn.Module) -> None:
    """Raise the error :func:`install_tiling` would raise, without changing ``block``: it has no
    token-wise sub-module, or one of them mixes tokens (:func:`_mixes_tokens`)."""
    targets = tiled_targets(block)
    if not targets:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in block.named_children())
        raise ValueError(f"a tiled treatment needs a token-wise sub-module (an MLP or a norm) in "
                         f"{type(block).__name__}, and it has none (children: {children}); use 'full' "
                         "or 'full+offload' for this block")
    for name, target in targets:
        needs = _needs_more_than_hidden(target) or _called_with_more(block, name)
        if needs:
            raise ValueError(f"{type(block).__name__}.{name} ({type(target).__name__}) {needs}, so it cannot be "
                             "tiled. Use 'full', 'mlp' or 'full+offload' for this block.")
        if _mixes_tokens(target) is True:
            raise ValueError(f"{type(block).__name__}.{name} ({type(target).__name__}) is not token-wise: run on "
                             "the tokens in two chunks it gives other outputs than on all of them at once "
                             "(it mixes tokens, or an MoE's routing depends on how many tokens it sees), so it "
                             "cannot be tiled. Use 'full', 'mlp' or 'full+offload' for this block.")


_PROBED = caches.register(weakref.WeakKeyDictionary(), "treat.tile_targets._PROBED")  # module -> whether it mixes tokens, or why it cannot be probed
_CALLS: dict = caches.register({}, "treat.tile_targets._CALLS")  # (block class, sub-module name) -> _called_with_more's answer



def _called_with_more(block: nn.Module, name: str) -> Optional[str]:
    """Why ``block``'s forward cannot hand its sub-module ``name`` the hidden states alone, or None: every
    call of ``self.<name>(...)`` in its source passes more (DeepSeek-V4's decoder layer always calls
    ``self.mlp(..., input_ids=input_ids)``, which its MoE's signature leaves optional). Read once per
    block class; where one call passes the hidden states alone, the call made is checked when it runs."""
    key = (type(block), name)
    if key not in _CALLS:
        _CALLS[key] = None
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(block).forward))))
        except (OSError, TypeError, SyntaxError):
            return None
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == name and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
        more = [c for c in calls if len(c.args) + len([k for k in c.keywords if not (
            isinstance(k.value, ast.Constant) and k.value.value is None)]) > 1]
        if calls and len(more) == len(calls):
            _CALLS[key] = (f"is called with more than the hidden states ({type(block).__name__}.forward: "
                           f"`{' '.join(ast.unparse(more[0]).split())}`), and a tiled sub-module runs on chunks of them")
    return _CALLS[key]


def _needs_more_than_hidden(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot run on the hidden states alone, or None: its ``forward`` names another
    required argument (BLOOM's MLP adds the residual, ``forward(hidden_states, residual)``), or it
    raises on a probe of hidden states (:func:`_mixes_tokens`'s: DeepSeek-V4's hash-routed MoE reads
    the ``input_ids`` its block passes). An optional argument the block passes after all is refused at
    the call (:func:`_tiled_forward`)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = ", ".join(p.name + ("" if p.default is p.empty else "=...") for p in parameters
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty for p in parameters[1:]):
        return f"needs more than the hidden states (forward({named})), and a tiled sub-module runs on chunks of them"
    probed = _mixes_tokens(module)
    return probed.replace("{forward}", f"forward({named})") if isinstance(probed, str) else None


def _mixes_tokens(module: nn.Module):
    """Whether ``module`` gives other rows for 8 tokens run at once than run as 3 + 5 (checked once
    per module, on random inputs of its feature size, with its RNG, buffers and grads left alone);
    a string saying why not where it cannot be probed (it raises, returns no tensor, or its width
    cannot be read: :func:`_needs_more_than_hidden` refuses it). Modules on the meta device or with
    fake parameters are taken as token-wise (nothing runs there; the real model is probed when the
    plan is applied)."""
    if module in _PROBED:
        return _PROBED[module]
    param = next(module.parameters(), None)
    features = _features(module)
    if param is None or param.device.type == "meta" or isinstance(param, FakeTensor):
        return False  # nothing to run it on (a fake-tensor profile: the real model is probed when applied)
    if features is None:  # a convolutional MLP on [batch, channels, height, width] (SwiftFormer's) among them
        return ("has no linear layer or hidden size to read its width from, so remat cannot check that it "
                "runs on [..., tokens, features] rows one at a time ({forward})")
    devices = [param.device.index or 0] if param.device.type == "cuda" else []
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        generator = torch.Generator(device=param.device).manual_seed(0)
        probe = torch.randn(1, 8, features, generator=generator, device=param.device).to(param.dtype)
        whole_replay, split_replay = Replay(8), Replay(8)
        try:
            with whole_replay.chunk(0, 8):
                whole = module(probe)
            split_replay.drawn = whole_replay.drawn  # the chunks get the same dropout masks
            parts = []
            for start, end in ((0, 3), (3, 8)):
                with split_replay.chunk(start, end):
                    parts.append(module(probe[:, start:end]))
        except Exception as error:  # noqa: BLE001 - the model's own code: any error means "not on hidden states alone"
            _PROBED[module] = (f"cannot run on the hidden states alone ({{forward}}: 8 random tokens of {features} "
                               f"features raised {type(error).__name__} in it), and a tiled sub-module runs on "
                               "chunks of them")
            return _PROBED[module]
        finally:
            for buffer, value in buffers:
                buffer.copy_(value)
    if not all(isinstance(t, torch.Tensor) for t in [whole, *parts]):
        mixes = (f"returns {type(whole).__name__}, not one tensor (an MoE returning its router logits?): its "
                 "chunks' outputs cannot be joined")
    else:
        tolerance = 1e-2 if param.dtype in (torch.float16, torch.bfloat16) else 1e-5
        mixes = not torch.allclose(torch.cat(parts, dim=1).float(), whole.float(), rtol=tolerance, atol=tolerance)
    _PROBED[module] = mixes
    return mixes


def _features(module: nn.Module):
    """The input feature size of a norm or an MLP: a norm's weight length, else the first linear
    layer's input size (``nn.Linear.in_features``; GPT-2's ``Conv1D`` keeps it as ``weight.shape[0]``),
    else a ``hidden_size``/``hidden_dim`` the module or a sub-module keeps."""
    if isinstance(module, nn.LayerNorm) or _NORM_CLASS.search(type(module).__name__):
        weight = getattr(module, "weight", None)
        shape = getattr(module, "normalized_shape", None)
        return shape[-1] if shape else (weight.shape[-1] if isinstance(weight, torch.Tensor) else None)
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return child.in_features
        if type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
            return child.weight.shape[0]
    for child in module.modules():  # experts kept as 3-D parameters (GPT-OSS): the width they were built for
        for name in ("hidden_size", "hidden_dim"):
            width = getattr(child, name, None)
            if isinstance(width, int) and not isinstance(width, bool) and width > 0:
                return width
    return None

