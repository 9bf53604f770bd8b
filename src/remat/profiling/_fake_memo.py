"""A memo of fake kernels' outputs with a cheap key: the fake profile's repeated ops and views, about three times faster.

A fake profile dispatches every op of every block run through ``FakeTensorMode``, whose own cache
(``FakeTensorMode.cache``) already skips the fake kernel of an op it has seen, but spends most of a
hit on building its key: each tensor argument's full metadata through a general walk (about 60% of
a cached op's time on a 2-core CPU). A recurrent block makes that the profile's cost: transformers'
reference selective scan (Jamba, Mamba without ``mamba-ssm``) runs a Python loop over the sequence,
the same few ops at every position, ten thousand a run.

:class:`KernelMemo` keys an op on what its output's metadata can depend on: the op, the default
dtype, inference mode, and per argument its Python type and value, or for a fake tensor its type,
shape, strides, dtype, device, ``requires_grad`` and conjugate/negative bits. A hit makes each output
as torch's own cache hit does (``empty_strided`` on ``meta`` with the recorded metadata, wrapped in
a ``FakeTensor`` of the mode), so the outputs, and what the byte tracker counts, are the same.

What it memoises, and why that is safe:

- only ops that return new tensors (no alias in their schema, no input written): their outputs'
  shapes and strides follow from the inputs' shapes and strides, never from where an input starts
  in its storage, so the key leaves out storage offsets (the scan's per-position slices then share
  one entry, where torch's key misses at every position);
- only where torch's own cache took the op (its hit or miss counters moved and no bypass was
  counted): ops torch refuses to cache (data-dependent outputs, decompositions, outputs that are
  not fake tensors) are never memoised;
- only fake tensor arguments of this mode without values (``constant``), strided, and plain Python
  values (numbers, strings, dtypes, devices, sizes): anything else is dispatched as before;
- only outputs that are fake tensors of this mode (or a tuple of them and None), none sharing
  storage with an input or another output.

Views (:meth:`KernelMemo.replay_view`) are memoised by the same key, under the same conditions but
the last: every output must be a view of the op's first argument, a fake tensor of this mode. What is
recorded of each is its metadata and how far past its base's storage offset it starts; a replay sets
a new meta tensor onto the base's storage there, as torch's own cache hit does. That distance does
not depend on where the base starts (a view adds to its base's offset), except for ``as_strided``
and the like, which take an absolute ``storage_offset``: ops with such an argument are never memoised
(:func:`plain_view`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

from remat.profiling._meters import _is_view

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class _NotMemoisable(Exception):
    """An argument the key cannot stand for."""


class KernelMemo:
    """Output metadata of ``mode``'s fake kernels by cheap key (module doc). One per fake mode: its
    entries describe outputs of that mode only, and end with it."""

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        self.entries = {}
        self.views = {}

    def key(self, func, args, kwargs) -> Optional[tuple]:
        """The key of ``func`` on ``args`` and ``kwargs``, or None where an argument cannot be keyed."""
        try:
            return (func, torch.get_default_dtype(), torch.is_inference_mode_enabled(), self._signature(args),
                    self._signature(tuple(kwargs.items())) if kwargs else ())
        except _NotMemoisable:
            return None

    def _signature(self, value):
        if isinstance(value, FakeTensor):
            if value.fake_mode is not self.mode or value.constant is not None or value.layout is not torch.strided:
                raise _NotMemoisable
            return (type(value), value.shape, value.stride(), value.dtype, value.device, value.requires_grad,
                    value.is_conj(), value.is_neg())
        if isinstance(value, _PLAIN):
            return (type(value), value)
        if isinstance(value, (tuple, list)):
            return (type(value),) + tuple(self._signature(item) for item in value)
        raise _NotMemoisable

    def replay(self, key):
        """The outputs of a memoised op, new fake tensors; None where ``key`` was never recorded."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        outputs, is_tuple = entry
        made = tuple(None if meta is None else self._made(*meta) for meta in outputs)
        return made if is_tuple else made[0]

    def _made(self, shape, stride, dtype, device, requires_grad, conj, neg, past_base=None, base=None) -> FakeTensor:
        """A new fake tensor of that metadata: on a storage of its own, or (``base`` given) set onto
        ``base``'s storage ``past_base`` elements past where ``base`` starts."""
        with in_kernel_invocation_manager(self.mode):
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
            if conj:
                torch._C._set_conj(empty, True)
            if neg:
                torch._C._set_neg(empty, True)
            if base is not None:
                empty.set_(base.untyped_storage(), base.storage_offset() + past_base, shape, stride)
        return FakeTensor(self.mode, empty, device)

    def replay_view(self, key, base: FakeTensor):
        """The views of ``base`` a memoised view op made, new fake tensors on ``base``'s storage;
        None where ``key`` was never recorded."""
        entry = self.views.get(key)
        if entry is None:
            return None
        outputs, is_tuple = entry
        made = tuple(self._made(*meta, base=base) for meta in outputs)
        return made if is_tuple else made[0]

    def dispatched_view(self, key, dispatch, base: FakeTensor):
        """``dispatch()`` (a view op of ``base`` through the mode), its outputs recorded under ``key``
        where torch's own cache took the op and each is a view of ``base`` (module doc)."""
        out, cached = _through_torch_cache(dispatch)
        if cached:
            is_tuple = isinstance(out, tuple)
            outputs = out if is_tuple else (out,)
            storage = base.untyped_storage()
            if outputs and all(type(t) is FakeTensor and t.fake_mode is self.mode and t.constant is None
                               and t.layout is torch.strided and t.untyped_storage() is storage for t in outputs):
                self.views[key] = (tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_conj(),
                                          t.is_neg(), t.storage_offset() - base.storage_offset())
                                         for t in outputs), is_tuple)
        return out

    def dispatched(self, key, dispatch, inputs: list):
        """``dispatch()`` (the op through the mode), its outputs recorded under ``key`` where torch's
        own cache took the op and they are new fake tensors of the mode (module doc)."""
        out, cached = _through_torch_cache(dispatch)
        if cached:
            recorded = self._metadata(out, inputs)
            if recorded is not None:
                self.entries[key] = recorded
        return out

    def _metadata(self, out, inputs: list) -> Optional[tuple]:
        is_tuple = isinstance(out, tuple)
        outputs = out if is_tuple else (out,)
        seen = {id(t.untyped_storage()) for t in inputs}
        recorded = []
        for t in outputs:
            if t is None and is_tuple:
                recorded.append(None)
                continue
            if type(t) is not FakeTensor or t.fake_mode is not self.mode or t.constant is not None \
                    or t.layout is not torch.strided:
                return None
            storage = id(t.untyped_storage())
            meta = (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_conj(), t.is_neg())
            # a replayed output starts its own storage, of the size its strides need: as this one
            if storage in seen or t.storage_offset() != 0 \
                    or self._made(*meta).untyped_storage().nbytes() != t.untyped_storage().nbytes():
                return None
            seen.add(storage)
            recorded.append(meta)
        return tuple(recorded), is_tuple


def plain_view(func) -> bool:
    """Whether ``func`` is a view op of its first argument that adds to its offset: its schema's first
    argument alone aliases (not written), every return aliases, nothing is written, and no argument
    sets an absolute ``storage_offset`` (``as_strided``)."""
    arguments = func._schema.arguments
    return (_is_view(func) and bool(arguments) and arguments[0].alias_info is not None
            and all(a.alias_info is None for a in arguments[1:])
            and not any(a.name == "storage_offset" for a in arguments))


def _through_torch_cache(dispatch) -> tuple:
    """``(dispatch(), whether torch's own fake cache took it)``: its hits or misses moved, no bypass."""
    taken, bypassed = _torch_cache_counts()
    out = dispatch()
    taken_after, bypassed_after = _torch_cache_counts()
    return out, taken_after > taken and bypassed_after == bypassed


def _torch_cache_counts() -> tuple:
    """(hits + misses, bypasses) of torch's fake tensor cache, process-wide."""
    return (FakeTensorMode.cache_hits + FakeTensorMode.cache_misses, sum(FakeTensorMode.cache_bypasses.values()))
