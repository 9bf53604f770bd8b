"""The offload engine's bookkeeping: which saved tensors may move, and the objects that track them.

:class:`remat.offload.engine.OffloadEngine` gives each forward call of a block a :class:`_Record`;
each distinct storage span the block saves is a :class:`_Slot` of it (one storage saved by several
ops or views moves once and comes back as the same views); what autograd holds instead of an
offloaded tensor is a :class:`_Packed` handle naming its slot and the view to rebuild. These objects
know nothing of the engine beyond the release queue a handle appends to.

- Never moved (:func:`keep_reason`, a pure function of the tensor): parameters, buffers and anything
  sharing their storage (a DTensor parameter's local shard included: FSDP2 frees and regrows those
  storages); tensor subclasses; storages of 0 bytes or without an address.
- In-place writes: under saved-tensor hooks autograd no longer checks that a saved tensor was not
  written before the backward, and a lazy copy would capture the written value. So a slot keeps,
  per handle, ``t.detach()`` and the version at the pack (``_Slot.watch``), and each handle a weak
  reference to ``t``; :func:`_modified_error` is autograd's own error.
- Release: a handle's ``__del__`` may run on any thread (even mid-pack, in a garbage-collection
  pass), so it only appends its record to the engine's release queue (an atomic ``deque.append``).

Why small ``__slots__`` objects rather than attributes on the saved tensors: a slot is shared by
every view of its storage and changes as copies land; only the engine, under its lock, touches it.

Limits: the parameter storages are a snapshot (:func:`parameter_storages`), taken again only when
the model's first parameter or its storage changes; a storage matched by ``_cdata`` counts only
while it is still the same object.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

_PENDING, _INFLIGHT, _HOST, _KEPT = "pending", "in flight", "host", "kept"


def _storage_of(t: torch.Tensor):
    """The storage under ``t`` (a DTensor's: its local shard's), or None where it has none to give."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def parameter_storages(model: nn.Module) -> dict:
    """``{storage._cdata: weakref(storage)}`` of ``model``'s parameters and buffers (identity, never
    the data pointer, which PyTorch refuses to give for a resharded FSDP2 or wrapper storage)."""
    found = {}
    for t in (*model.parameters(), *model.buffers()):
        storage = _storage_of(t)
        if storage is not None:
            found[storage._cdata] = weakref.ref(storage)
    return found


def keep_reason(t: torch.Tensor, parameters: dict) -> Optional[str]:
    """Why the engine must leave the saved tensor ``t`` where it is, or None if it may move it.

    ``"param"``: a parameter, a view of one, or anything else on a storage of ``parameters`` (as
    :func:`parameter_storages` returns them); ``"other"``: a tensor subclass (DTensor, quantized
    weights: their storage is not theirs to give), not strided, conjugate or negative bit set,
    empty, or a storage of 0 bytes or one whose address cannot be read (FSDP2 frees its storages
    between uses). Reads metadata only; touches no data.
    """
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return "param"
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_conj() or t.is_neg() \
            or t.numel() == 0:
        return "other"
    try:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return "other"
        storage.data_ptr()
    except RuntimeError:
        return "other"
    ref = parameters.get(storage._cdata)
    if ref is not None and ref() is storage:
        return "param"
    return None


def _modified_error(packed: "_Packed", device: torch.device, now: int, expected: int) -> RuntimeError:
    name = torch.empty(0, dtype=packed.dtype).type()
    if device.type != "cpu":
        name = name.replace("torch.", f"torch.{device.type}.", 1)
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{name} {list(packed.size)}], saved for backward in an offloaded block, is at "
        f"version {now}; expected version {expected} instead. Hint: autograd cannot check tensors "
        "that saved-tensor hooks hold, so remat's offload engine checked it; clone the tensor before "
        "writing to it in place, or enable anomaly detection without remat to find the operation, "
        "with torch.autograd.set_detect_anomaly(True).")


class _Record:
    """One forward call of one block: its slots, and how many packed handles autograd still holds."""

    __slots__ = ("engine", "seq", "key", "slots", "by_span", "nbytes", "handles", "open", "fetched", "done")

    def __init__(self, engine, seq, key):
        self.engine, self.seq, self.key = engine, seq, key
        self.slots, self.by_span, self.nbytes = [], {}, 0
        self.handles, self.open, self.fetched, self.done = 0, True, False, False


class _Slot:
    """One storage span on one device: where its bytes are (GPU tensor, host buffer or both), the
    copy events, the streams that used its GPU memory, and what the in-place check watches.

    ``watch``: ``(t.detach(), version)`` of each handle, kept while ``gpu`` is the original storage;
    ``changed``: ``(version, expected)`` once a write after the pack was seen.
    """

    __slots__ = ("record", "dev", "nbytes", "state", "gpu", "host", "ready", "d2h_end", "h2d_end",
                 "alloc_stream", "alloc_key", "users", "last_read", "ref", "watch", "changed")

    def __init__(self, record, dev, nbytes, gpu, ready, ref, stream):
        self.record, self.dev, self.nbytes, self.state, self.gpu, self.ready, self.ref = (
            record, dev, nbytes, _PENDING, gpu, ready, ref)
        self.alloc_stream, self.alloc_key = stream, dev.key(stream)
        self.host = self.d2h_end = self.h2d_end = self.last_read = self.changed = None
        self.users, self.watch = {}, []


class _Packed:
    """What autograd holds instead of an offloaded tensor: a slot, the view to rebuild, and the
    version the tensor had when autograd saved it."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset", "version", "ref")

    def __init__(self, slot, dtype, size, stride, offset, version, ref):
        self.slot, self.dtype, self.size, self.stride, self.offset = slot, dtype, size, stride, offset
        self.version, self.ref = version, ref

    def __del__(self):
        # Any thread, any moment (a GC pass inside a pack): only the atomic append, no engine logic.
        record = self.slot.record
        record.engine._released.append(record)
