"""A treated block's view of a KV cache: what it reads is the caller's, what it writes its own.

:class:`CacheView` is what :mod:`remat.treat.block_state` hands a treated block in place of a
transformers ``Cache``: a new cache of the caller's class whose layers are the caller's until the
block reads one, then a copy of it (:class:`_Layers`: the same tensors, so nothing is copied on the
device; dicts and lists of a layer copied, so its flags are its own), recorded as it was read. The
recompute gets a view of those recorded layers as they were (:meth:`CacheView.recompute_cache`), so
it sees what its forward saw and appends to nothing of the caller's; a layer its forward did not
read is one that raises if it is read (:class:`_Unread`: the recompute took another path).

After the forward (:meth:`CacheView.after_forward`) what the block changed is written back into the
caller's cache, or withheld: the caller's layer then refuses reads of the attributes the block
changed (:func:`_withhold`: its keys and values; a :class:`remat.treat.refusals.StepRefusal` from
inside the step), while the rest stays readable (an empty layer's length, the mamba states Zamba2's
attention shares a layer with). :func:`release_withheld`, called as the model's forward returns,
makes them ordinary layers again: the cache the model returns lacks the treated blocks, as
documented, and may be read. A layer a treated block wrote in place (a static cache) is refused,
as its recompute would see the new values. A layer's scalar tensors (0-dim: the token counters
transformers 5.25's linear-attention layers add to in place) are the exception: the block counts into
copies of its own (:func:`_own_scalars`), which are written into the caller's counters after the
forward (a counter holds no activation), and the recompute counts into copies of them as they were
read, so nothing is counted twice and nothing the block was handed changes under its recompute.

Why a copy per read layer and not the caller's cache: a recompute that appended to the caller's
cache would grow it twice; why not a new empty cache: a block then attends to nothing of a prefix
the caller's cache holds. Limits: a withheld layer's length read back (MPT's attention reads
layer 0's) is the empty layer's, not refused; a cache whose layers are not a list is not viewed.
"""
from __future__ import annotations

import copy
import weakref

import torch

from remat import caches
from remat.treat.refusals import StepRefusal


def viewable(cache) -> bool:
    """Whether ``cache`` can be viewed: its layers are a list (an encoder-decoder cache: both parts')."""
    parts = _parts(cache)
    if parts:
        return all(viewable(part) for _, part in parts)
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


def _own_scalars(layer) -> list:
    """Replace ``layer``'s scalar tensors (0-dim: counters such as transformers 5.25's
    ``cumulative_length_linear``, which a layer's update adds to in place) by copies of their own, as
    attributes and one level into dicts and lists; returns ``(container, key, copy, original, copy's
    version)`` for each. A block then counts into its copy, not into the caller's tensor, which its
    recompute would otherwise see counted twice."""
    owned = []
    state = vars(layer)
    containers = [state] + [v for v in state.values() if type(v) in (dict, list)]
    for container in containers:
        for key, value in (container.items() if isinstance(container, dict) else enumerate(container)):
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                copied = value.clone()
                container[key] = copied
                owned.append((container, key, copied, value, copied._version))
    return owned


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
        self.entry = {}  # index -> (the layer as first read, its tensors' versions then, scalars aside)
        self.as_read = {}  # index -> the layer as first read, its scalars copied then: the recompute's
        self.scalars = {}  # index -> the block's own copies of the layer's scalar tensors (_own_scalars)

    def _read(self, index: int) -> None:
        if index < 0:
            index += len(self)
        if 0 <= index < self.count and index not in self.entry:
            layer = list.__getitem__(self, index)
            kept = _copy_state(layer)
            # scalars aside: the recompute reads copies of them as they were now (``as_read``), so writes
            # into the caller's (its counters go on counting after this read) change nothing it sees
            self.entry[index] = (kept, [(t, t._version) for t in _tensors(kept) if t.dim() != 0])
            as_read = _copy_state(layer)
            _own_scalars(as_read)
            self.as_read[index] = as_read
            working = _copy_state(layer)
            self.scalars[index] = _own_scalars(working)
            list.__setitem__(self, index, working)

    def scalars_written_back(self) -> None:
        """Each layer's scalar tensors, where the block's copy is still there, put back as the caller's
        own, with what the block wrote into its copy written into them: a counter holds no activation,
        so the caller's counts as the untouched block's would (Inkling2's other convolutions then read
        it), and the layer is not changed by it."""
        for owned in self.scalars.values():
            for container, key, copied, original, version in owned:
                if container[key] is copied:
                    if copied._version != version:
                        original.copy_(copied)
                    container[key] = original

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


def _withheld_read(where: str, name: str) -> StepRefusal:
    return StepRefusal(
        f"the model read a layer of its KV cache ({where}) that {name}, treated "
        "by remat, filled in a copy of its own in this training forward: remat keeps a treated block's "
        "keys and values out of the model's cache there (as use_cache=False would), and this model reads "
        "its cache inside the training forward, so it would attend to an empty layer. remat stops here "
        "rather than train on it: pass use_cache=False when training, or give the blocks that fill the "
        "cache the treatment 'keep'.")


class _WithheldKeys(dict):
    """A withheld layer's dict attribute of which a treated block changed some keys only (states kept one
    per sub-module of the block, as Inkling2's ``conv_states``): reading, testing or taking one of
    ``withheld`` raises, as does a walk over the values; the other keys read and write as the layer's."""

    def __init__(self, items, withheld: frozenset, where: str, name: str):
        super().__init__(items)
        self.withheld, self.where, self.name = withheld, where, name

    def _check(self, key) -> None:
        if key in self.withheld:
            raise _withheld_read(f"{self.where}[{key!r}]", self.name)

    def _check_all(self) -> None:
        if self.withheld:
            raise _withheld_read(f"{self.where}[{sorted(self.withheld, key=repr)[0]!r}]", self.name)

    def __getitem__(self, key):
        self._check(key)
        return dict.__getitem__(self, key)

    def __contains__(self, key):
        self._check(key)
        return dict.__contains__(self, key)

    def get(self, key, default=None):
        self._check(key)
        return dict.get(self, key, default)

    def pop(self, key, *default):
        self._check(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        self._check(key)
        return dict.setdefault(self, key, default)

    def values(self):
        self._check_all()
        return dict.values(self)

    def items(self):
        self._check_all()
        return dict.items(self)

    def plain(self) -> dict:
        return dict(dict.items(self))


_GUARDED: dict = caches.register({}, "treat.cache_views._GUARDED")  # layer class -> its withheld subclass


def _withhold(layer, name: str, attributes) -> None:
    """Mark the caller's ``layer`` as one some of whose contents (``attributes``: the keys and values,
    a state-space layer's states; each mapped to None, or to the keys of a dict's entries changed where
    the rest were not: see :func:`_changed_contents`) treated block ``name`` kept in its own copy: reading
    any of those raises from now on, in the layer's own methods too (``update`` reads its keys). Its other
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
                raise _withheld_read(f"{_kind.__name__}.{attribute}", held[0])
            return _kind.__getattribute__(self, attribute)

        def __copy__(self):  # a view's copy of it stays withheld
            new = object.__new__(type(self))
            vars(new).update(vars(self))
            return new

        def __reduce_ex__(self, protocol, _kind=kind):  # pickles and deep-copies as the layer it was
            return _rebuild_layer, (_kind, _released_state(vars(self)))
        # ``_layer_type`` None: transformers registers every cache layer subclass that names one as the
        # class its caches build for that layer type (CacheLayerMixin.__init_subclass__)
        _GUARDED[kind] = type(f"Withheld{kind.__name__}", (kind,), {
            "__getattribute__": __getattribute__, "__copy__": __copy__, "__reduce_ex__": __reduce_ex__,
            "__module__": __name__, "_layer_type": None})
    whole = set()
    for attribute, entries in attributes.items():
        if entries is None:
            whole.add(attribute)
        else:   # some keys of a dict: those withheld, the rest the layer's as before
            vars(layer)[attribute] = _WithheldKeys(vars(layer)[attribute], entries, f"{kind.__name__}.{attribute}",
                                                   name)
    vars(layer)[_WITHHELD_BY] = (name, frozenset(whole))
    layer.__class__ = _GUARDED[kind]
    _HELD.append((weakref.ref(layer), kind))
    if len(_HELD) > 4096:  # released at the end of each forward of remat.apply's model; outside one, dead ones go
        _HELD[:] = [(ref, k) for ref, k in _HELD if ref() is not None]


def _changed_contents(new, old) -> dict:
    """The attributes holding tensors (directly or in a dict or list) whose values differ between two of
    :func:`_copy_state`'s copies of a layer: what a block's update put there; each mapped to None (the
    whole attribute), or, for a dict of which only some keys changed, to those keys (a layer shared by the
    block's sub-modules, each filling its own entry: Inkling2's ``conv_states``, one per convolution, the
    attention's and the rest of the block's)."""
    left, right = vars(new), vars(old)
    changed = {}
    for key in set(left) | set(right):
        a, b = left.get(key, _Missing), right.get(key, _Missing)
        if _same(a, b) or not any(_holds_tensor(v) for v in (left.get(key), right.get(key))):
            continue
        keys = set(a) | set(b) if type(a) is dict and type(b) is dict else ()
        entries = {k for k in keys if not _same(a.get(k, _Missing), b.get(k, _Missing))}
        # every key changed (or not a dict): the attribute as a whole, its keys with it
        changed[key] = frozenset(entries) if len(entries) < len(keys) else None
    return changed


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
            state = vars(layer)
            state.update(_released_state(state))
            del state[_WITHHELD_BY]
            layer.__class__ = kind


def _released_state(state: dict) -> dict:
    """A withheld layer's attributes as the layer's own: its partly withheld dicts plain again, no mark."""
    return {k: v.plain() if isinstance(v, _WithheldKeys) else v for k, v in state.items() if k != _WITHHELD_BY}


def _rebuild_layer(kind, state):
    layer = kind.__new__(kind)
    vars(layer).update(state)
    return layer


class CacheView:
    """A treated block's view of one caller's cache (module docstring): built for the forward
    (:meth:`forward_cache`), kept as what the forward read for the recompute (:meth:`recompute_cache`),
    written back or withheld after the forward (:meth:`after_forward`)."""

    def __init__(self, cache, name: str):
        self.name = name
        self.caller = cache
        self.parts = {attribute: CacheView(part, name) for attribute, part in _parts(cache)}
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
            self.layers.scalars_written_back()
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
                _, versions = entry
                if any(t._version != v for t, v in versions):
                    raise ValueError(
                        f"the model wrote in place into a tensor of layer {index} of the KV cache after {self.name} "
                        "(treated by remat) read it: its recompute would see other values than its forward saw, so "
                        "remat stops here. Give this block the treatment 'keep', or pass use_cache=False when training.")
                layer = _copy_state(self.layers.as_read[index])
                _own_scalars(layer)   # the recompute counts into its own copies too
                layers.append(layer)
            view.layers = layers
        return view
