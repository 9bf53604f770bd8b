"""What a treated block is handed, kept as the untouched block sees it: in its forward and in every recompute.

A checkpointed block runs twice, in the forward and again in backward, and the recompute must be
handed the values its forward was handed, while the forward must leave behind what the untouched
block leaves. Python objects that reach a block through its arguments break both unless they are
looked after: a KV cache the block appends to, recurrent state a model writes into after the
block returns, a dict one block fills and another reads. :class:`BlockCall` looks after them, one
per call of a treated block (eager mode); nothing here copies a block's activations.

- KV caches (transformers' ``Cache``): the block gets a *view* (:class:`_CacheView`): a new cache
  of the caller's class whose layers are copied from the caller's on the block's first read of each
  (the same tensors: nothing is copied on the device), recorded as they are read. A recompute gets a
  view built from those recorded layers as they were when the forward read them, so it sees what
  its forward saw and appends to nothing of the caller's. After the forward, the layers the block
  changed are *written back* into the caller's cache, or *withheld*:
  withheld by default in a training forward (the caller's cache then lacks the treated blocks, as
  with Hugging Face checkpointing's ``use_cache=False``, so their keys and values are not kept
  alive for the rest of the step); written back in an eval-mode forward with gradients, and for a
  model that reads its own cache in the training forward (:func:`cache_reader`: PI0 asks its
  vision-language model for a cache and hands it to its action expert), whose cache then holds
  what it holds untouched. A treated block that reads a layer another treated block withheld is
  refused, not run on the empty layer.
- Tensors inside the arguments (tuples, lists, dicts, ``UserDict``, to :data:`_DEPTH` levels): their
  version counters are recorded at the call and compared before each recompute. A model that writes
  into one in place after the block returned (xLSTM copies the new recurrent state into the tensors
  it passed) would have the recompute see the new values; so a tensor seen for the first time at a
  path that does not require grad is copied at the call (once per tensor and version, shared by
  every block handed it), the recompute is handed the copy where the original changed, and the
  path is learned (:class:`InputLedger`): copied at every call from then on if it changed, never
  again if it did not. A changed tensor with no copy (one that requires grad, or a path that was
  clean until now) is refused in backward, with the argument named. Tensor arguments themselves
  are the checkpoint's saved inputs, whose versions autograd checks.
- Mutable containers (list, dict, ``UserDict``: Gemma-3n's shared key/value dict, filled by one
  layer and read by later ones): the forward gets the caller's object, so what it writes is seen;
  a recompute gets a copy of its contents at the call, so it reads what the forward read and writes
  nothing the caller sees.

How this differs from the obvious alternatives: dropping the cache (Hugging Face's
``use_cache=False`` under checkpointing) changes some models' arithmetic (GPT-2 attends over the
cache's concatenated keys) and breaks models that read it (PI0); handing the caller's cache to the
block lets a recompute append a second time; copying every argument at every call would double
what ``full`` keeps.

Under ``torch.compile`` (:func:`own_cache`) the block gets a new empty cache of the caller's layout
instead, built from constructor arguments read before the checkpoint (a view's copies would break
the graph), and tensors inside arguments are left to the graph; a block of a model that writes its
cache back runs eagerly there. Limits: tensors inside other objects (a dataclass, a custom state
object passed whole) are not watched; a cache without a ``layers`` list (transformers 4.x) gets the
empty cache of the compiled path; a model that reads a withheld layer outside a treated block (in
its own code after the blocks) is found only by :func:`cache_reader`'s reading of its forwards.
"""
from __future__ import annotations

import ast
import copy
import inspect
import sys
import textwrap
import warnings
import weakref
from collections import UserDict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from remat.treat.refusals import StepRefusal

_DEPTH = 3          # container levels walked below an argument
_MOST_TENSORS = 64  # tensors watched per call: beyond this an argument is a data structure, not state


@dataclass
class InputLedger:
    """Per treated block (in its ``TreatmentState``), learned over its calls: which paths into its
    arguments (``("arg", 1, 0)``: the first element of its second positional argument) hold a tensor
    the model writes into after the call (``mutated``: copied at every call) or never has (``clean``)."""

    clean: set = field(default_factory=set)
    mutated: set = field(default_factory=set)


def guarded(forward, args: tuple, kwargs: dict, ledger: "InputLedger", *, write_back: bool, name: str):
    """``(function, args, kwargs)`` to checkpoint in place of ``forward(*args, **kwargs)``, a treated
    block's call (eager mode): ``function``'s first call is the forward, handed views of the caller's
    KV caches; every later one is a recompute, handed what the forward was handed (module docstring).
    ``args`` and ``kwargs`` are the call's with each cache replaced by None: the checkpoint must not
    keep the caller's cache alive. Called outside any checkpoint's modes (the copies made here must
    not be recorded). ``write_back``: the caches' changes go back into the caller's (else withheld);
    ``name`` names the block in errors.

    Example::

        function, args, kwargs = guarded(block_forward, args, kwargs, InputLedger(), write_back=False,
                                         name="LlamaDecoderLayer")
        out = checkpoint(lambda *a: function(*a, **kwargs), *args, use_reentrant=False)
    """
    call = BlockCall(args, kwargs, ledger, write_back=write_back, name=name)
    args = tuple(None if ("arg", i) in call.views else v for i, v in enumerate(args))
    kwargs = {k: (None if ("kw", k) in call.views else v) for k, v in kwargs.items()}
    return call.wrap(forward), args, kwargs


class BlockCall:
    """One call of a treated block (:func:`guarded`): what it was handed, read at the call (its caches'
    views, the tensors and containers inside its arguments), and :meth:`wrap`, the function the
    checkpoint runs. It holds no tensor argument itself (those are the checkpoint's inputs, and a
    segment must not keep its later blocks' inputs alive)."""

    def __init__(self, args: tuple, kwargs: dict, ledger: InputLedger, *, write_back: bool, name: str):
        self.name = name
        self.ledger = ledger
        self.write_back = write_back
        self.calls = 0
        cache_types = _cache_types()
        self.views = {}       # argument key -> _CacheView
        self.watched = []     # _Watched, one per tensor inside an argument
        self.snapshots = {}   # id(container) -> its contents at the call
        self.direct = []      # (key, weak reference, version) of each tensor argument
        self.containers = {}  # argument key -> the container given (the recompute rebuilds it)
        for key, value in _arguments(args, kwargs):
            if isinstance(value, torch.Tensor):
                self.direct.append((key, weakref.ref(value), value._version))
            elif cache_types and isinstance(value, cache_types) and _viewable(value):
                self.views[key] = _CacheView(value, name)
            elif isinstance(value, (tuple, list, MutableMapping)):
                if self._walk(value, key, 0):
                    self.containers[key] = value
        if self.views and not write_back and not torch.compiler.is_compiling():
            _warn_cache_once()

    def _walk(self, value, path, depth) -> bool:
        """Record the tensors and the copyable containers inside ``value``; whether there is any."""
        if isinstance(value, torch.Tensor):
            if len(self.watched) < _MOST_TENSORS:
                self.watched.append(_Watched.of(value, path, self.ledger))
            return True
        if depth > _DEPTH or not isinstance(value, (tuple, list, MutableMapping)):
            return False
        items = list(value.items()) if isinstance(value, MutableMapping) else list(enumerate(value))
        copyable = type(value) in (list, dict) or isinstance(value, UserDict)
        if copyable:
            self.snapshots[id(value)] = items
        found = copyable
        for index, item in items:
            found = self._walk(item, path + (index,), depth + 1) or found
        return found

    def wrap(self, forward):
        """``forward`` as the checkpoint calls it: the forward with the views, each recompute with the
        arguments as the forward was handed them."""
        def run(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                for (kind, key), view in self.views.items():
                    if kind == "arg":
                        args = args[:key] + (view.forward_cache(),) + args[key + 1:]
                    else:
                        kwargs[key] = view.forward_cache()
                out = forward(*args, **kwargs)
                for view in self.views.values():
                    view.after_forward(self.write_back)
                self._check_during_forward()
                return out
            args, kwargs = self._recompute_arguments(args, kwargs)
            return forward(*args, **kwargs)
        return run

    def _check_during_forward(self) -> None:
        """A tensor inside an argument that the block itself wrote in place: its recompute needs the
        copy, which exists only where the path was not known clean."""
        for watched in self.watched:
            if watched.tensor._version != watched.version and watched.copy is None:
                raise _written_error(self.name, watched.path, "during its forward")

    def _recompute_arguments(self, args, kwargs):
        for key, ref, version in self.direct:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise _written_error(self.name, key, "after the block returned")
        swaps = {}
        for watched in self.watched:
            changed = watched.tensor._version != watched.version
            if changed and watched.copy is None:
                raise _written_error(self.name, watched.path, "after the block returned")
            if changed:
                swaps[watched.path] = watched.copy
                self.ledger.mutated.add(watched.path)
                self.ledger.clean.discard(watched.path)
            elif watched.copy is not None and watched.path not in self.ledger.mutated:
                self.ledger.clean.add(watched.path)
        args = list(args)
        for (kind, key), value in self.containers.items():
            rebuilt = self._rebuild(value, (kind, key), swaps)
            if kind == "arg":
                args[key] = rebuilt
            else:
                kwargs[key] = rebuilt
        for (kind, key), view in self.views.items():
            if kind == "arg":
                args[key] = view.recompute_cache()
            else:
                kwargs[key] = view.recompute_cache()
        return tuple(args), kwargs

    def _rebuild(self, value, path, swaps):
        """``value`` as it was at the call: a mutable container as a new one of its contents then, a
        tuple rebuilt where something inside it is; a tensor that changed since, its copy."""
        if isinstance(value, torch.Tensor):
            return swaps.get(path, value)
        items = self.snapshots.get(id(value))
        if isinstance(value, tuple):
            rebuilt = [self._rebuild(item, path + (i,), swaps) for i, item in enumerate(value)]
            if all(a is b for a, b in zip(rebuilt, value)):
                return value
            return type(value)._make(rebuilt) if hasattr(type(value), "_make") else type(value)(rebuilt)
        if items is None:  # not copied at the call (deeper than walked, or a mapping of its own kind)
            if any(p[:len(path)] == path for p in swaps):
                raise _written_error(self.name, path, "after the block returned")
            return value
        if isinstance(value, list):
            return [self._rebuild(item, path + (i,), swaps) for i, item in items]
        rebuilt = {k: self._rebuild(item, path + (k,), swaps) for k, item in items}
        if type(value) is dict:
            return rebuilt
        fresh = copy.copy(value)  # a UserDict: a new one of the same class
        fresh.data = rebuilt
        return fresh


def _arguments(args, kwargs):
    yield from ((("arg", i), v) for i, v in enumerate(args))
    yield from ((("kw", k), v) for k, v in kwargs.items())


def _written_error(name: str, path, when: str) -> ValueError:
    where = _describe(path)
    kind = StepRefusal if when == "during its forward" else ValueError  # a recompute's cannot take remat off
    return kind(
        f"{name} (treated by remat) was handed a tensor ({where}) that the model wrote in place {when}: "
        "its recompute would see other values than its forward saw, and its gradients would be wrong, so remat "
        "stops here. Give this block the treatment 'keep' (or 'offload', which recomputes nothing); for a "
        "recurrent model's state, pass use_cache=False when training.")


def _describe(path) -> str:
    kind, key, *rest = path
    head = f"argument {key}" if kind == "arg" else f"argument {key!r}"
    return head + "".join(f"[{r!r}]" for r in rest)


# ----------------------------------------------------------------------------- tensors inside arguments

_COPIES: dict = {}  # id(tensor) -> (weak tensor, version, weak copy): one copy per tensor and version


class _Watched(NamedTuple):
    path: tuple
    tensor: torch.Tensor
    version: int
    copy: Optional[torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor, path: tuple, ledger: InputLedger) -> "_Watched":
        wanted = path in ledger.mutated or (path not in ledger.clean and not tensor.requires_grad
                                            and not isinstance(tensor, nn.Parameter))
        return cls(path, tensor, tensor._version, _copy_of(tensor) if wanted else None)


def _copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` as it is now, shared by every block handed the same tensor at this version."""
    held = _COPIES.get(id(tensor))
    if held is not None and held[0]() is tensor and held[1] == tensor._version and held[2]() is not None:
        return held[2]()
    with _disable_current_modes(), torch.no_grad():
        made = tensor.detach().clone()
    if len(_COPIES) > 256:
        for key in [k for k, (t, _, c) in _COPIES.items() if t() is None or c() is None]:
            del _COPIES[key]
    _COPIES[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(made))
    return made


# ----------------------------------------------------------------------------- KV caches

def _viewable(cache) -> bool:
    parts = _parts(cache)
    if parts:
        return all(_viewable(part) for _, part in parts)
    return isinstance(getattr(cache, "layers", None), list)


def _parts(cache) -> list:
    """An encoder-decoder cache's two caches, as ``(attribute, cache)``; [] for others."""
    parts = [(name, getattr(cache, name, None)) for name in ("self_attention_cache", "cross_attention_cache")]
    return parts if all(part is not None for _, part in parts) else []


def _copy_state(obj):
    """A new object of ``obj``'s class holding the same attribute values, its dicts and lists copied
    (a layer's ``has_previous_state`` dict must not be shared with the caller's). Made directly, not by
    ``copy.copy`` (a cache layer is a plain object; this runs for every layer a treated block reads)."""
    state = getattr(obj, "__dict__", None)
    if state is None or hasattr(type(obj), "__slots__") and type(obj).__slots__:
        new = copy.copy(obj)
        state = vars(new)
    else:
        new = object.__new__(type(obj))
    vars(new).update({k: v.copy() if type(v) in (dict, list) else v for k, v in state.items()})
    return new


def _tensors(obj) -> list:
    found = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) in (dict, list):
            found += [v for v in (value.values() if isinstance(value, dict) else value) if isinstance(v, torch.Tensor)]
    return found


def _same(value, other) -> bool:
    """Whether two attribute values of :func:`_copy_state`'s copies are the same: by identity, one level
    into dicts and lists (numbers and strings by value)."""
    if type(value) in (dict, list) and type(other) is type(value):
        if len(value) != len(other):
            return False
        pairs = ((v, other.get(k, _Missing)) for k, v in value.items()) if isinstance(value, dict) else zip(value, other)
        return all(_same(a, b) for a, b in pairs)
    return value is other or (_plain(value) and _plain(other) and value == other)


class _Missing:
    pass


def _plain(value) -> bool:
    return isinstance(value, (bool, int, float, str, type(None)))


def _differs(a, b) -> bool:
    left, right = vars(a), vars(b)
    return left.keys() != right.keys() or any(not _same(v, right[k]) for k, v in left.items())


class _Layers(list):
    """A view's layers: the caller's layer objects until the block reads one, then a copy of it
    (:func:`_copy_state`), whose state as it was then is kept (``entry``) for the recompute. Every way
    Python code reads a list item (index, slice, iteration) goes through here."""

    def __init__(self, layers):
        super().__init__(layers)
        self.count = len(layers)
        self.entry = {}  # index -> (the layer as first read, its tensors' versions then)

    def _read(self, index: int) -> None:
        if index < 0:
            index += len(self)
        if 0 <= index < self.count and index not in self.entry:
            layer = list.__getitem__(self, index)
            kept = _copy_state(layer)
            self.entry[index] = (kept, [(t, t._version) for t in _tensors(kept)])
            list.__setitem__(self, index, _copy_state(layer))

    def __getitem__(self, index):
        if isinstance(index, slice):
            for i in range(*index.indices(len(self))):
                self._read(i)
        else:
            self._read(index)
        return list.__getitem__(self, index)

    def __iter__(self):
        for i in range(len(self)):
            self._read(i)
        return list.__iter__(self)

    def __reversed__(self):
        for i in range(len(self)):
            self._read(i)
        return list.__reversed__(self)


class _Unread:
    """In a recompute's view: a layer the forward did not read (its state was not kept)."""

    def __init__(self, index: int, name: str):
        object.__setattr__(self, "_where", (index, name))

    def __getattribute__(self, attribute):
        if attribute == "__class__":
            return object.__getattribute__(self, attribute)
        index, name = object.__getattribute__(self, "_where")
        raise ValueError(f"the recompute of {name} (treated by remat) read layer {index} of its KV cache, which its "
                         "forward did not read: it took another path than its forward, so remat stops here. "
                         "Give this block the treatment 'keep', or pass use_cache=False when training.")


_WITHHELD_BY = "_remat_withheld_by"  # on a withheld layer: (the block that withheld it, the attributes)
_GUARDED: dict = {}  # layer class -> its withheld subclass


def _withhold(layer, name: str, attributes) -> None:
    """Mark the caller's ``layer`` as one some of whose contents (``attributes``: the keys and values,
    a state-space layer's states) treated block ``name`` kept in its own copy: reading any of those
    raises from now on, in the layer's own methods too (``update`` reads its keys). Its other
    attributes stay readable (its length while it is empty, its kind, another sub-module's states in
    the same layer object: Zamba2's mamba mixer and its attention share one). The layer keeps its
    class's behaviour otherwise (it becomes an instance of a subclass) until :func:`release_withheld`."""
    kind = type(layer)
    if _WITHHELD_BY in vars(layer) or not attributes:
        return
    if kind not in _GUARDED:
        def __getattribute__(self, attribute, _kind=kind):
            held = object.__getattribute__(self, "__dict__").get(_WITHHELD_BY)
            if held is not None and attribute in held[1]:
                raise StepRefusal(
                    f"the model read a layer of its KV cache ({_kind.__name__}.{attribute}) that {held[0]}, treated "
                    "by remat, filled in a copy of its own in this training forward: remat keeps a treated block's "
                    "keys and values out of the model's cache there (as use_cache=False would), and this model reads "
                    "its cache inside the training forward, so it would attend to an empty layer. remat stops here "
                    "rather than train on it: pass use_cache=False when training, or give the blocks that fill the "
                    "cache the treatment 'keep'.")
            return _kind.__getattribute__(self, attribute)

        def __copy__(self):  # a view's copy of it stays withheld
            new = object.__new__(type(self))
            vars(new).update(vars(self))
            return new

        def __reduce_ex__(self, protocol, _kind=kind):  # pickles and deep-copies as the layer it was
            return _rebuild_layer, (_kind, {k: v for k, v in vars(self).items() if k != _WITHHELD_BY})
        # ``_layer_type`` None: transformers registers every cache layer subclass that names one as the
        # class its caches build for that layer type (CacheLayerMixin.__init_subclass__)
        _GUARDED[kind] = type(f"Withheld{kind.__name__}", (kind,), {
            "__getattribute__": __getattribute__, "__copy__": __copy__, "__reduce_ex__": __reduce_ex__,
            "__module__": __name__, "_layer_type": None})
    vars(layer)[_WITHHELD_BY] = (name, frozenset(attributes))
    layer.__class__ = _GUARDED[kind]
    _HELD.append((weakref.ref(layer), kind))
    if len(_HELD) > 4096:  # released at the end of each forward of remat.apply's model; outside one, dead ones go
        _HELD[:] = [(ref, k) for ref, k in _HELD if ref() is not None]


def _changed_contents(new, old) -> set:
    """The attributes holding tensors (directly or in a dict or list) whose values differ between two of
    :func:`_copy_state`'s copies of a layer: what a block's update put there."""
    left, right = vars(new), vars(old)
    return {key for key in set(left) | set(right)
            if not _same(left.get(key, _Missing), right.get(key, _Missing))
            and any(_holds_tensor(v) for v in (left.get(key), right.get(key)))}


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if type(value) in (dict, list):
        return any(isinstance(v, torch.Tensor) for v in (value.values() if isinstance(value, dict) else value))
    return False


_HELD: list = []  # (weak layer, its class) of every layer withheld since the last release


def release_withheld() -> None:
    """Make every layer withheld so far an ordinary one again: the model's forward has returned, and
    what reads the cache it returned (documented to lack the treated blocks) is no longer refused.
    :func:`remat.apply`'s wrapper of the model's ``forward`` calls this as the forward ends."""
    while _HELD:
        layer, kind = _HELD.pop()
        layer = layer()
        if layer is not None and _WITHHELD_BY in vars(layer):
            del vars(layer)[_WITHHELD_BY]
            layer.__class__ = kind


def _rebuild_layer(kind, state):
    layer = kind.__new__(kind)
    vars(layer).update(state)
    return layer


class _CacheView:
    """A treated block's view of one caller's cache (module docstring): built for the forward, kept
    as what the forward read for the recompute, written back or withheld after the forward."""

    def __init__(self, cache, name: str):
        self.name = name
        self.caller = cache
        self.parts = {attribute: _CacheView(part, name) for attribute, part in _parts(cache)}
        # the cache's own attributes at the call, without its layers (the recompute must not keep them alive)
        self.kept = _copy_state(cache)
        for attribute in self.parts:
            setattr(self.kept, attribute, None)
        if not self.parts:
            self.kept.layers = None
        self.layers = None  # the forward's _Layers
        self.forward_view = None

    def forward_cache(self):
        view = _copy_state(self.kept)
        for attribute, part in self.parts.items():
            setattr(view, attribute, part.forward_cache())
        if not self.parts:
            view.layers = self.layers = _Layers(self.caller.layers)
        self.forward_view = view
        return view

    def after_forward(self, write_back: bool) -> None:
        """Write back what the block changed in the caller's cache, or withhold it; then forget the caller."""
        view, caller = self.forward_view, self.caller
        for part in self.parts.values():
            part.after_forward(write_back)
        if self.layers is not None:
            for index, (_, versions) in self.layers.entry.items():
                if any(t._version != v for t, v in versions):
                    raise StepRefusal(
                        f"{self.name} (treated by remat) wrote in place into a tensor of layer {index} of the KV cache "
                        "it was handed (a static cache?): its recompute would see the new values, so remat stops "
                        "here. Give this block the treatment 'keep', or use a dynamic cache (or use_cache=False) "
                        "when training.")
            layers = self.layers
            changed = [i for i in range(len(layers)) if i >= layers.count or (
                i in layers.entry and _differs(list.__getitem__(layers, i), layers.entry[i][0]))]
            make = getattr(caller, "layer_class_to_replicate", None)
            for index in changed:
                layer = list.__getitem__(layers, index)
                if index < len(caller.layers):
                    if write_back:
                        caller.layers[index] = layer
                    else:
                        _withhold(caller.layers[index], self.name, _changed_contents(layer, layers.entry[index][0]))
                elif write_back:
                    caller.layers.append(layer)
                elif callable(make):  # a lazily filled cache: in the block's place, an empty layer, withheld
                    empty = make()
                    _withhold(empty, self.name, _changed_contents(layer, empty))
                    caller.layers.append(empty)
        if write_back:
            kept = vars(self.kept)
            for attribute, value in vars(view).items():
                if attribute != "layers" and attribute not in self.parts and not (
                        attribute in kept and _same(value, kept[attribute])):
                    setattr(caller, attribute, value)
        self.caller = self.forward_view = None  # the recompute needs only what the forward read

    def recompute_cache(self):
        view = _copy_state(self.kept)
        for attribute, part in self.parts.items():
            setattr(view, attribute, part.recompute_cache())
        if self.layers is not None:
            layers = []
            for index in range(self.layers.count):
                entry = self.layers.entry.get(index)
                if entry is None:
                    layers.append(_Unread(index, self.name))
                    continue
                kept, versions = entry
                if any(t._version != v for t, v in versions):
                    raise ValueError(
                        f"the model wrote in place into a tensor of layer {index} of the KV cache after {self.name} "
                        "(treated by remat) read it: its recompute would see other values than its forward saw, so "
                        "remat stops here. Give this block the treatment 'keep', or pass use_cache=False when training.")
                layers.append(_copy_state(kept))
            view.layers = layers
        return view


# ----------------------------------------------------------------------------- the compiled path

def own_cache(forward, args: tuple, kwargs: dict):
    """``(forward, args, kwargs)`` in which each KV cache argument is a new empty cache of its layout,
    at the forward and at every recompute (the compiled path, module docstring). Any argument that *is*
    a Hugging Face ``Cache``, whatever its keyword is called in the installed transformers, is replaced."""
    cache_types = _cache_types()
    keys = [k for k, v in kwargs.items() if isinstance(v, cache_types)]
    slots = [i for i, v in enumerate(args) if isinstance(v, cache_types)]
    if not keys and not slots:
        return forward, args, kwargs
    if not torch.compiler.is_compiling():
        _warn_cache_once()
    # the layouts, read here, outside the checkpoint: the body that builds the empty caches only
    # builds (see _cache_layout); and only the caches' layouts: a segment must not keep its later
    # blocks' inputs, nor the caller's cache, through this closure
    layouts = {**{i: _cache_layout(args[i]) for i in slots}, **{k: _cache_layout(kwargs[k]) for k in keys}}

    def with_new_caches(*call_args, **call_kwargs):
        call_args = tuple(_build_empty(layouts[i]) if i in slots else v for i, v in enumerate(call_args))
        call_kwargs.update({k: _build_empty(layouts[k]) for k in keys})
        return forward(*call_args, **call_kwargs)
    args = tuple(None if i in slots else v for i, v in enumerate(args))
    kwargs = {k: (None if k in keys else v) for k, v in kwargs.items()}
    return with_new_caches, args, kwargs


def has_cache(args: tuple, kwargs: dict) -> bool:
    cache_types = _cache_types()
    return bool(cache_types) and any(isinstance(v, cache_types) for v in (*args, *kwargs.values()))


class _CacheLayout(NamedTuple):
    """What :func:`_build_empty` needs to build a new, empty cache laid out as one given: its class,
    the layouts of an encoder-decoder cache's two parts (None for others), and each layer's class and
    constructor arguments (None: the cache fills its layers lazily)."""
    kind: type
    parts: Optional[tuple]
    layers: Optional[tuple]


def _cache_layout(cache) -> Optional[_CacheLayout]:
    """How to build a new, empty cache laid out as ``cache`` is; None where a layer's constructor
    arguments cannot be read back.

    The layout matters: hybrid models (Jamba, Bamba, Falcon-H1, LFM2, Zamba2, Qwen3-Next) build
    ``DynamicCache(config=...)``, one layer object per layer type (a linear-attention layer for
    a state-space mixer, a sliding-window layer, ...), and their mixers read their own layer's
    kind; a bare ``type(cache)()`` fills lazily with plain key/value layers, on which a mamba
    mixer's ``get_conv_state`` fails. So each layer is rebuilt empty as its own class, from the
    constructor arguments it keeps as attributes of the same name (``sliding_window``,
    ``number_of_states``, ``max_cache_len``). An encoder-decoder cache is rebuilt from its two
    parts.

    Read once per call of the block, before its checkpoint; the forward and each recompute then
    build from it. Reading fills a module dict on a class's first read, and under
    ``torch.compile`` a dict written inside a checkpoint's body is a side effect dynamo refuses
    there: it broke the graph at every checkpoint, and the block ran eager."""
    parts = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    if all(part is not None for part in parts):
        part_layouts = tuple(_cache_layout(part) for part in parts)
        return None if None in part_layouts else _CacheLayout(type(cache), part_layouts, None)
    layers = getattr(cache, "layers", None)
    if not (isinstance(layers, list) and layers and getattr(cache, "layer_class_to_replicate", None) is None):
        return _CacheLayout(type(cache), None, None)
    # transformers >= 5: built from a config, every layer of its own kind
    arguments = [_layer_arguments(layer) for layer in layers]
    if None in arguments:
        return None
    return _CacheLayout(type(cache), None, tuple((type(layer), a) for layer, a in zip(layers, arguments)))


def _build_empty(layout: Optional[_CacheLayout]):
    """A new, empty cache built from :func:`_cache_layout`'s ``layout``, or None where none can be
    built (the block then runs without a cache, as with ``use_cache=False``): a layout that could not
    be read, or a class that cannot be built without arguments (transformers 4.x's hybrid caches,
    which its models never build in a training forward anyway)."""
    if layout is None:
        return None
    try:
        if layout.parts is not None:
            empty = [_build_empty(part) for part in layout.parts]
            return layout.kind(*empty) if None not in empty else None
        fresh = layout.kind()
        if layout.layers is not None:
            fresh.layers = [kind(**arguments) for kind, arguments in layout.layers]
            fresh.layer_class_to_replicate = None
        return fresh
    except (TypeError, ValueError):
        return None


def _layer_arguments(layer) -> Optional[dict]:
    """The arguments ``layer`` was built with, read back from its attributes of the same names, or
    None if a required one cannot be found."""
    parameters = _constructor_parameters(type(layer))
    if parameters is None:
        return None
    arguments = {}
    for name, required in parameters:
        if hasattr(layer, name):
            arguments[name] = getattr(layer, name)
        elif required:
            return None
    return arguments


_CONSTRUCTOR_PARAMETERS: dict = {}


def _constructor_parameters(kind: type) -> Optional[tuple]:
    """``(name, required)`` of each argument ``kind.__init__`` takes by name (None: its signature
    cannot be read). Read once per class: each forward and recompute of a treated block rebuilds
    every layer of the model's cache, so ``inspect.signature`` per layer and call cost host time in
    the square of the number of layers a step. Kept in a plain dict, not ``functools.lru_cache``,
    which dynamo warns of (and traces through) in every compiled model with a cache."""
    if kind not in _CONSTRUCTOR_PARAMETERS:
        try:
            parameters = inspect.signature(kind.__init__).parameters.values()
        except (TypeError, ValueError):
            _CONSTRUCTOR_PARAMETERS[kind] = None
        else:
            _CONSTRUCTOR_PARAMETERS[kind] = tuple((p.name, p.default is p.empty) for p in parameters
                                                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return _CONSTRUCTOR_PARAMETERS[kind]


def _cache_types() -> tuple:
    cache_utils = sys.modules.get("transformers.cache_utils")  # imported by any HF model that has one
    cache = getattr(cache_utils, "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


_WARNED = set()


def _warn_cache_once() -> None:
    if "cache" not in _WARNED:
        _WARNED.add("cache")
        warnings.warn("remat: a KV cache reached a treated block in a training forward; remat gives the "
                      "block a copy of its own at each call (a recompute must not append to yours), "
                      "so the cache the model returns lacks the treated blocks. Pass use_cache=False when "
                      "training to silence this.", stacklevel=5)


# ----------------------------------------------------------------------------- models that read their cache

_READERS: dict = {}  # class -> the call in its forward that asks for a cache, or ""


def cache_reader(model: nn.Module) -> Optional[str]:
    """Where ``model`` reads its own KV cache inside a training forward, or None: a ``forward`` among
    its modules' classes that calls a sub-module with ``use_cache=True`` written out (PI0 asks its
    vision-language model for the prefix cache its action expert attends to), read from the source
    once per class. :func:`remat.apply` has such a model's treated blocks write their keys and
    values back into the model's cache (module docstring)."""
    for module in model.modules():
        kind = type(module)
        if kind not in _READERS:
            _READERS[kind] = _forced_cache_call(kind)
        if _READERS[kind]:
            return _READERS[kind]
    return None


def _forced_cache_call(kind: type) -> str:
    forward = kind.__dict__.get("forward")
    if forward is None or kind.__module__.startswith(("torch.", "remat.")):
        return ""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(
                k.arg == "use_cache" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords):
            return f"{kind.__name__}.forward calls {ast.unparse(node.func)}(..., use_cache=True)"
    return ""


__all__ = ["BlockCall", "InputLedger", "cache_reader", "guarded", "has_cache", "own_cache", "release_withheld"]
