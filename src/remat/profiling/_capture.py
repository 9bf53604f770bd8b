"""The capture forward: what each block is, what it takes and what it returns, before any block is measured.

How: one forward (:func:`_capture`) through the user's loss, with hooks on every block, that builds the
autograd graph but keeps no saved tensor (saved-tensor hooks pack them to nothing), so each block's
input says whether it requires grad at no cost in memory. A pre-hook records every block's
configuration (:func:`_signature`: class, parameter shapes, attention kind, input shape, whether it
has a backward) and keeps the inputs of the first block of each configuration (detached, caches
dropped: :func:`_without_cache`); a post-hook records its output's shape (:class:`_Template`); hooks
on the blocks' sub-modules record their outputs' structure for the stubbed step
(:mod:`remat.profiling._head`). Every call is recorded in order (``calls``: ALBERT runs its one layer
group for every layer, :mod:`remat.planning.calls`). It stops where the LM head
(:func:`remat.treat.discovery.find_head`) is about to run once every block has run (a pre-hook
raising); a model without one runs its loss. The hidden-state conventions the block and head runs
share (:func:`_hidden_of`, :func:`_with_hidden`) live here too.

Why one real forward rather than building each block's inputs: the blocks get exactly the tensors and
keyword arguments (masks, position embeddings) the model's own forward makes. Why a signature rather
than the class: blocks of one class can cost differently (Gemma-2's sliding-window and global layers,
encoder and decoder). Why the graph: a frozen block whose input needs no gradient (a frozen vision
tower) saves nothing and has no backward, and is measured so; a block with trainable parameters runs
with an input that requires grad even where its own does not (LoRA over frozen embeddings).

Limits: a block must take its hidden state as the first floating-point positional argument or as
``hidden_states`` and return a tensor or a tuple that starts with it (the other elements are None in
the stub run, but for inputs the block hands back); a configuration attribute not in
:data:`CONFIG_ATTRIBUTES` is not seen; a block that the forward never calls is a ``ValueError``.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from remat.treat.discovery import find_head

# attributes that make two blocks of one class with the same parameters cost differently
CONFIG_ATTRIBUTES = ("attention_type", "layer_type", "is_sliding", "sliding_window", "is_decoder",
                     "is_causal", "has_relative_attention_bias")


def _signature(block: nn.Module, hidden=None) -> tuple:
    """What makes two blocks cost the same: class, parameters, the configuration attributes of
    the block and its direct children (sliding-window or global attention ...), the shape and
    dtype of its input and whether the block has a backward (:func:`_has_backward`)."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    config = []
    for prefix, module in [("", block)] + [(f"{n}.", m) for n, m in block.named_children()]:
        for attribute in CONFIG_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if value is not None and isinstance(value, (bool, int, float, str)):
                config.append((prefix + attribute, value))
    shape = None if hidden is None else (tuple(hidden.shape), hidden.dtype, _has_backward(block, hidden))
    return (type(block), params, tuple(config), shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Captured(Exception):
    pass


@dataclass(frozen=True)
class _Template:
    """A block's (or sub-module's) output: the first tensor's shape, dtype and device, and the
    container it came in (None: a bare tensor; else the tuple type and its length)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    container: type = None
    length: int = 1
    handed_back: tuple = ()
    """``(position, key)`` for each element of a tuple output that is one of the block's own
    non-tensor inputs, ``key`` an int (positional argument) or a str (keyword): transformers 4.x
    decoder layers (Falcon, StableLM) hand back the KV cache they were given, and the model
    reads its cache from there, so a stub must hand back the one it is given too."""
    rest: tuple = ()
    """The tuple's other elements as the capture saw them: a :class:`_Like` per tensor (the stub
    returns zeros of its shape), plain values as they were (Swin's output dimensions, which the
    model reads), None for what was None or handed back."""

    @staticmethod
    def of(out, args=(), kwargs=None) -> "_Template":
        if isinstance(out, torch.Tensor):
            return _Template(tuple(out.shape), out.dtype, out.device)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            inputs = list(enumerate(args)) + list((kwargs or {}).items())
            handed_back = tuple((position, key) for position, value in enumerate(out) if position > 0
                                and value is not None and not isinstance(value, torch.Tensor)
                                for key, given in inputs if given is value)
            back = {position for position, _ in handed_back}
            rest = tuple(None if position in back else tree_map(
                lambda v: _Like(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v, value)
                for position, value in enumerate(out) if position > 0)
            return _Template(tuple(out[0].shape), out[0].dtype, out[0].device, type(out), len(out), handed_back,
                             rest)
        raise TypeError(f"a block returned {type(out).__name__}; remat expects a tensor or a tuple whose first "
                        "element is the hidden state")

    def wrap(self, y, args=(), kwargs=None):
        """``y`` in the recorded container: the inputs handed back, zeros of the recorded shapes
        for the other tensors, the recorded plain values (see :attr:`rest`)."""
        if self.container is None:
            return y
        items = [y] + [tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=v.device)
                                if isinstance(v, _Like) else v, value) for value in self.rest]
        items += [None] * (self.length - len(items))
        for position, key in self.handed_back:
            items[position] = args[key] if isinstance(key, int) else (kwargs or {}).get(key)
        return self.container(items)


@dataclass(frozen=True)
class _Like:
    """A tensor's shape, dtype and device (a pytree leaf, unlike a tuple)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Capture:
    """What the capture forward saw, per block index."""

    signatures: list   # per block: _signature(...)
    inputs: dict       # block index -> (args, kwargs), for the first block of each signature only
    outputs: list      # per block: _Template of its output
    replays: list      # per block: [(sub-module, its output's structure)] to replay in stubs
    order: list        # block indices in the order the forward first called them
    calls: list        # block indices of every call, in order (a block called N times is there N times)


def _capture(model, batch, loss_fn, named) -> _Capture:
    """One forward that saves nothing for backward, stopped before the head once every block has run
    (see the module doc)."""
    n = len(named)
    signatures, outputs, replays = [None] * n, [None] * n, [None] * n
    inputs, seen, order, calls, sub_outputs = {}, set(), [], [], {}
    handles = []

    def pre(index, module, args, kwargs):
        calls.append(index)
        if signatures[index] is None:
            sig = _signature(module, _hidden_of(args, kwargs))
            signatures[index] = sig
            if sig not in seen:
                seen.add(sig)
                kept = _without_cache(*tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                                                (args, kwargs)))
                _hidden_of(*kept).requires_grad_(_has_backward(module, _hidden_of(args, kwargs)))
                inputs[index] = kept
            order.append(index)

    def post(index, module, args, kwargs, out):
        if outputs[index] is None:
            outputs[index] = _Template.of(out, args, kwargs)

    def head(module, args):  # the blocks are done once the head runs after all of them
        if all(o is not None for o in outputs):
            raise _Captured

    def sub_post(module, args, out):
        sub_outputs.setdefault(id(module), tree_map(
            lambda v: _Like(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v, out))

    restore = _tensor_attributes_restored(model)
    try:
        for index, (_, block) in enumerate(named):
            handles.append(block.register_forward_pre_hook(partial(pre, index), with_kwargs=True))
            handles.append(block.register_forward_hook(partial(post, index), with_kwargs=True))
            for sub in block.modules():
                if sub is not block:
                    handles.append(sub.register_forward_hook(sub_post))
        head_name = find_head(model)
        if head_name is not None:
            handles.append(model.get_submodule(head_name).register_forward_pre_hook(head))
        # the graph, for whether each block's input requires grad; no saved tensor, for memory
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_nothing, _nothing):
            loss_fn(model, batch)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
        restore()
    gc.collect()  # the forward stopped by an exception leaves reference cycles holding its tensors: free them now
    missing = [named[i][0] for i in range(n) if outputs[i] is None]
    if missing:
        raise ValueError(f"{len(missing)} block(s) were never called in the model's forward ({missing[:3]}); "
                         "pass blocks= with the modules the forward really runs")
    for index, (_, block) in enumerate(named):
        replays[index] = [(sub, sub_outputs[id(sub)]) for sub in block.modules()
                          if sub is not block and sub._forward_hooks and id(sub) in sub_outputs]
    return _Capture(signatures=signatures, inputs=inputs, outputs=outputs, replays=replays, order=order,
                    calls=calls)


def _tensor_attributes_restored(model: nn.Module):
    """Undo for the tensors a forward stores in plain module attributes (RecurrentGemma's recurrent
    and convolution states, which its next call starts from): the capture's, made under hooks that
    keep no saved tensor, must not become a later run's starting state (its backward would meet the
    capture's empty graph)."""
    before = {id(m): (m, {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}) for m in model.modules()}

    def undo():
        for module, tensors in before.values():
            for key, value in list(module.__dict__.items()):
                if isinstance(value, torch.Tensor) and tensors.get(key) is not value:
                    if key in tensors:
                        module.__dict__[key] = tensors[key]
                    else:
                        module.__dict__[key] = None
    return undo


def _has_backward(block: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether ``block``, given ``hidden`` (from the graph-building capture), has a backward: its
    input requires grad or it has trainable parameters."""
    return hidden.requires_grad or any(p.requires_grad for p in block.parameters())


def _nothing(_):
    return None


def _without_cache(args, kwargs):
    """A block's captured inputs without a live KV cache: run again and again, a cache object
    would grow with every run and carry the graph of the last one (``Trying to backward through
    the graph a second time`` on any model built with ``use_cache=True``, the config default)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    if not isinstance(cache, type):
        return args, kwargs
    args = tuple(None if isinstance(v, cache) else v for v in args)
    kwargs = {k: (None if isinstance(v, cache) else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache") is True:
        kwargs["use_cache"] = False
    return args, kwargs


def _hidden_of(args, kwargs) -> torch.Tensor:
    for value in args:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    value = kwargs.get("hidden_states")
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError("cannot tell which block input is the hidden state: expected a floating-point "
                     "tensor as the first positional argument or a 'hidden_states' keyword")


def _with_hidden(args, kwargs, new):
    old = _hidden_of(args, kwargs)
    args = tuple(new if a is old else a for a in args)
    kwargs = {k: (new if v is old else v) for k, v in kwargs.items()}
    return args, kwargs
