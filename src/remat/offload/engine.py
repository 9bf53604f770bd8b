"""Asynchronous activation offload: the tensors a block saves for backward live in pinned host
memory between its forward and its backward, moved on side streams while compute continues.

How it works. ``OffloadEngine.saved_tensors(key)`` installs
``torch.autograd.graph.saved_tensors_hooks`` around one block's forward (``offload``) or around
its non-reentrant checkpoint (``full+offload``: there the outer hooks see only the checkpoint's
inputs, which ``_NoopSaveInputs`` saves under the caller's hooks; the recomputation runs under
checkpoint's own hooks). Each forward call of a block gets a *record*; each distinct storage span
it saves is a *slot*, so a storage saved by several ops (or as several views) moves once and comes
back as the same views (``view(dtype).as_strided`` over one byte buffer).

- Kept where they are, never moved (:func:`keep_reason`, a pure function of the tensor): parameters,
  buffers and anything sharing their storage (storage identity, the local shard of a DTensor
  parameter included: FSDP2 frees and regrows those storages between uses); tensor subclasses;
  storages of 0 bytes or whose address PyTorch refuses to give; tensors under ``min_bytes``
  (hundreds of tiny copies would cost more Python than bus); anything not on a CUDA device.
- Devices: each saved tensor moves from its own device, on that device's pair of copy streams
  (:mod:`remat.offload.streams`), so a model spread over several GPUs (``device_map="auto"``)
  offloads every block; the window and the pinned pool are shared by all devices.
- Forward: a pack records an event on the compute stream and queues the slot. Device-to-host copies
  are issued on a dedicated stream (waiting on that event) while less than ``_ISSUE_WINDOW`` bytes
  are queued there, into buffers from a :class:`PinnedPool`. The engine keeps the GPU tensor alive
  and drops it once the copy's event has completed (``event.query()`` at later packs, at each
  offloaded block's end and at the first unpack of the backward) and its block has ended, so the
  caching allocator's ``allocated`` statistics stay honest (``record_stream`` would make freed
  memory look free before the copy ends). The forward runs ~4x faster than the bus on the bench
  model, so past the window (``max_pending_bytes``) the host waits on the *oldest copy's* event
  (never a device synchronize).
- Copies are issued lazily: slots still queued when the backward reaches them are never moved at
  all (the tail of the forward is needed first in backward), which saves both directions;
  copies already in flight are used from their GPU tensor directly.
- In-place writes. Under saved-tensor hooks autograd no longer checks that a saved tensor was not
  written in place before the backward, and a lazy copy would capture the written value. So each
  pack records ``t._version`` and keeps ``t.detach()`` (same version counter, same storage, which
  the engine holds anyway until the copy lands and the block ends) plus a weak reference to
  ``t``; the versions are read again when the engine lets go of the original storage and at each
  unpack, and a change raises autograd's own RuntimeError ("one of the variables needed for
  gradient computation has been modified by an inplace operation"). A copy that captured a write
  is therefore never used; a copy taken before a write is the value autograd saved.
- Backward runs blocks in reverse order. The first unpack of a record makes it current: its slots
  that live only on the host are copied back on a second stream (host-to-device; the two directions
  use different copy engines, so a backward's fetches overlap a forward's tail), the consuming
  stream waits on each slot's event (GPU side), and the ``prefetch_blocks`` records before it in
  forward order are fetched at once so their copies overlap this block's backward. Destination
  memory is allocated on the consuming stream and the copy stream first waits for it; a
  destination given up before the consuming stream waited on its copy is fenced on that stream
  first, and every other stream that read a slot's GPU memory is recorded on it
  (``record_stream``), so the allocator never hands it out while a copy writes it or a kernel
  reads it. The record that stops being current gives back its GPU copies (their host copies
  stay, so a second unpack under ``retain_graph`` re-fetches).
- Release. A packed handle's ``__del__`` (run by whichever thread drops it: the autograd thread,
  or a garbage-collection pass in the middle of a pack) only appends to a release queue
  (``collections.deque.append`` is atomic); the engine drains it under its lock at the next pack,
  unpack, block start or end, :meth:`OffloadEngine.stats`, and at the end of each backward (an
  autograd final callback). A record whose last handle is drained gives its pinned buffers back to
  the pool, fenced by the last host-to-device copy that read them.
- Pinned pool: buffers in power-of-two size classes, reused from step to step, bounded by a host
  memory limit that raises a ValueError before it is passed (:mod:`remat.offload.pinned`).
- Without CUDA (or with no parameter or buffer on a CUDA device) ``saved_tensors`` is a no-op and
  the engine warns once.
- Copies of the model: ``copy.deepcopy`` and ``pickle`` carry the engine's settings and its model
  reference (the copy's engine serves the copied model) and drop the lock, streams, events, pool and
  records, which the copy builds afresh.

Memory the engine adds. Beyond what a block holds while it runs, the engine holds GPU memory for
other blocks in two ways only: at most the *window* ``W`` (``max_pending_bytes``; default
``DEFAULT_WINDOW_RECORDS`` times the largest record packed) of saved tensors whose host copy has
not been seen to land, and during a block's backward the ``prefetch_blocks`` records fetched ahead.
The rule, why the window is one record, and its pure form ``gpu_overhead_bytes`` (for the
planner) are in :mod:`remat.planning.offload_model` (the planner models the engine; this package
never imports the planner, and a test checks the two defaults agree); the device objects that run the copies are in
:mod:`remat.offload.streams`. This module re-exports the names callers import from it.

How it differs from the obvious alternatives: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
copies synchronously on the compute stream (measured 0.13x eager on the bench model) and allocates
pinned memory per tensor; torchtune/TRL-style offloading issues every copy at once, so GPU memory is
not bounded while the bus lags, and uses ``record_stream``. Here the copy queue is short, the GPU
memory waiting for the bus is capped, and the tail of the forward is never moved.

Limits: the forward of an offloaded block runs at bus speed once the window is full (offloading
everything is bus bound: on an H100 pinned copies run ~55 GB/s each way, so ~25 GiB of activations
each way cost ~1 s against a 0.35 s compute step; offload some blocks, by plan). Copies in the two
directions overlap only where a backward meets a forward (the bus limit is the sum of both
directions at per-direction bandwidth). A saved view that covers less than half of its storage
moves just its span; otherwise the whole storage moves. Storages shared by several blocks move once
per block. The in-place check misses one case autograd catches: a write made after the block ended
and after its copy landed, to a tensor that is gone before the backward; the backward then uses the
value saved before the write (never the written one). Released records hold their memory until the
next drain (a forward without backward: until the next forward or :meth:`OffloadEngine.stats`).
Stream identities are compared by handle, never with ``!=`` (``torch.Stream`` compares
unequal-to-None as False, which silently skipped every wait in the first version). Not for use
inside CUDA-graph capture or ``torch.compile``d regions; move the model to its device before the
first step.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import warnings
import weakref
from typing import Optional

import torch
import torch.nn as nn

from remat.offload.pinned import GiB, MiB, PinnedPool  # noqa: F401  (GiB re-exported)
from remat.offload.streams import _Cuda, _Inline

DEFAULT_WINDOW_RECORDS = 1  # default max_pending_bytes: this many times the largest record packed
DEFAULT_MIN_BYTES = MiB  # smaller storages stay on the GPU (the profiler counts offload bytes with it)
_ISSUE_WINDOW = 512 * MiB  # bytes of D2H copies queued at once: ~10 ms of bus, enough to never idle

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


class OffloadEngine:
    """Moves the tensors blocks save for backward to pinned host memory and back, asynchronously.

    ``remat.apply`` creates one per call, shared by the model's offloaded blocks, and the
    treatments call ``with engine.saved_tensors(block_index): ...``.

    - ``min_bytes``: storages smaller than this stay on the GPU.
    - ``max_pending_bytes``: the window: GPU bytes of saved tensors whose host copy has not been
      seen to land; above it the forward waits for the bus. None: ``DEFAULT_WINDOW_RECORDS`` times
      the largest record (one block call's offloaded bytes) packed so far. See "Memory the engine
      adds" in the module docstring and ``remat.planning.offload_model.gpu_overhead_bytes``.
    - ``prefetch_blocks``: records copied back ahead of the backward (1 hides a block's copy
      behind the next block's backward when the bus keeps up).
    - ``host_memory_limit``: bytes of pinned memory the pool may hold (None: 60% of MemAvailable).
    - ``timing``: CUDA events around copies and waits, for :meth:`stats`.
    """

    # what a copy (deepcopy, pickle) carries; everything else is rebuilt by _start
    _SETTINGS = ("_model_ref", "min_bytes", "max_pending_bytes", "prefetch_blocks", "timing",
                 "_host_memory_limit", "_inline", "_delay", "_issue_window")

    def __init__(self, model: nn.Module, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 max_pending_bytes: Optional[int] = None, prefetch_blocks: int = 1,
                 host_memory_limit: Optional[int] = None, timing: bool = True,
                 _inline: bool = False, _copy_delay_cycles: int = 0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"OffloadEngine needs the nn.Module whose blocks it serves, got {type(model).__name__}")
        for name, value in (("min_bytes", min_bytes), ("prefetch_blocks", prefetch_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if max_pending_bytes is not None and (not isinstance(max_pending_bytes, int) or max_pending_bytes < 0):
            raise ValueError(f"max_pending_bytes must be a non-negative int (bytes) or None, got "
                             f"{max_pending_bytes!r}")
        self._model_ref = model  # the model owns the engine (through its blocks' state) and vice versa
        self.min_bytes = min_bytes
        self.max_pending_bytes = max_pending_bytes
        self.prefetch_blocks = prefetch_blocks
        self.timing = timing
        self._host_memory_limit = host_memory_limit
        self._inline = _inline
        self._delay = _copy_delay_cycles
        self._issue_window = _ISSUE_WINDOW
        self._start()

    def _start(self) -> None:
        """Everything that is not a setting: lock, devices, pool, queues, records, counters."""
        self.pool = PinnedPool(self._host_memory_limit, pin=not self._inline)
        self._lock = threading.RLock()
        self._released = collections.deque()  # records whose packed handles were dropped, one entry each
        self._callback_task = None  # the backward whose end drains the release queue
        self._devs = {torch.device("cpu"): _Inline()} if self._inline else {}  # device -> copy streams
        self._warned = False
        self._fingerprint = None
        self._parameters = {}
        self._on_cuda = False
        self._seq = 0
        self._largest = 0  # bytes of the largest record packed so far (the default window)
        self._live = {}  # seq -> record with packed handles still alive, in forward order
        self._current = None  # record the backward is consuming
        self._pending = collections.deque()
        self._pending_bytes = 0
        self._inflight = collections.deque()
        self._inflight_bytes = 0
        self._timed = {"d2h": collections.deque(), "h2d": collections.deque(), "wait": collections.deque()}
        self.reset_stats()

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self._SETTINGS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    # -- the interface treatments use --------------------------------------------------------

    def saved_tensors(self, key: int):
        """Context manager for one block's forward: what it saves for backward is offloaded."""
        if not self._ready():
            return contextlib.nullcontext()
        return _BlockContext(self, key)

    # -- statistics ----------------------------------------------------------------------------

    def reset_stats(self) -> None:
        with self._lock:
            self._counts = collections.Counter()
            self._times = collections.Counter()
            self._by_block = collections.Counter()

    def stats(self) -> dict:
        """Counters since :meth:`reset_stats`. Waits for the timing events still in flight, so
        call it between steps, not inside one.

        ``bytes_packed``: distinct GPU bytes the hooks took (for ``full+offload``: the checkpoint
        bytes; ``bytes_packed_by_block`` splits it by the treatments' block index, to set beside
        the profiler's prediction); ``bytes_d2h``/``bytes_h2d``: moved each way; ``bytes_never_moved``: still queued
        when backward needed them, so they stayed on the GPU; ``*_s``: copy and wait times (GPU
        events; ``host_wait_s`` is the forward blocked on the window, ``window_bytes``);
        ``compute_waits``: how many times a consuming stream was made to wait for a fetch;
        ``pinned_allocations`` counts since construction (constant once warmed up).
        """
        with self._lock:
            self._drain()
            for deque in self._timed.values():
                for start, end, _ in deque:
                    end.synchronize()
            self._reap()
            c, t = self._counts, self._times
            copy_s = t["d2h_s"] + t["h2d_s"]
            exposed_s = t["compute_wait_s"] + t["host_wait_s"]
            return {
                "tensors_seen": c["seen"], "tensors_kept_small": c["small"], "tensors_kept_param": c["param"],
                "tensors_kept_other": c["other"], "slots": c["slots"], "bytes_packed": c["bytes_packed"],
                "bytes_d2h": c["bytes_d2h"], "bytes_h2d": c["bytes_h2d"], "bytes_never_moved": c["kept"],
                "d2h_s": t["d2h_s"], "h2d_s": t["h2d_s"], "compute_wait_s": t["compute_wait_s"],
                "host_wait_s": t["host_wait_s"], "compute_waits": c["compute_waits"],
                "d2h_GBps": c["bytes_d2h"] / t["d2h_s"] / 1e9 if t["d2h_s"] else None,
                "h2d_GBps": c["bytes_h2d"] / t["h2d_s"] / 1e9 if t["h2d_s"] else None,
                "hidden_fraction": max(0.0, 1.0 - exposed_s / copy_s) if copy_s else None,
                "pinned_bytes": self.pool.held_bytes, "pinned_in_use_bytes": self.pool.in_use_bytes,
                "pinned_allocations": self.pool.allocations, "live_records": len(self._live),
                "window_bytes": self.window_bytes(),
                "bytes_packed_by_block": dict(sorted(self._by_block.items())),
            }

    # -- setup -----------------------------------------------------------------------------------

    def _ready(self) -> bool:
        first = next(self._model_ref.parameters(), None)
        storage = None if first is None else _storage_of(first)
        fingerprint = (id(first), None if storage is None else storage._cdata)
        if fingerprint != self._fingerprint:  # first use, model.to(...), parameters replaced
            self._fingerprint = fingerprint
            self._parameters = parameter_storages(self._model_ref)
            self._on_cuda = any(t.device.type == "cuda"
                                for t in (*self._model_ref.parameters(), *self._model_ref.buffers()))
        if self._inline or (torch.cuda.is_available() and self._on_cuda):
            return True
        if not self._warned:
            self._warned = True
            why = "CUDA is not available" if not torch.cuda.is_available() else "the model is not on a CUDA device"
            warnings.warn(f"remat offload: {why}, so offloaded blocks keep what they save in place "
                          "(no host copies, no memory saved); gradients are unchanged.", stacklevel=4)
        return False

    def _device(self, device: torch.device):
        """The copy streams of ``device``, made at its first saved tensor; None: not offloaded."""
        dev = self._devs.get(device)
        if dev is None and not self._inline and device.type == "cuda":
            dev = self._devs[device] = _Cuda(device)
        return dev

    def window_bytes(self) -> int:
        """The window in force: ``max_pending_bytes``, or its default from the records seen."""
        if self.max_pending_bytes is not None:
            return self.max_pending_bytes
        return DEFAULT_WINDOW_RECORDS * self._largest

    # -- forward: pack ---------------------------------------------------------------------------

    def _open(self, key) -> _Record:
        with self._lock:
            self._drain()
            self._seq += 1
            return _Record(self, self._seq, key)

    def _close(self, record: _Record) -> None:
        with self._lock:
            self._drain()
            record.open = False
            if record.handles == 0:
                self._finalize(record)
                return
            self._reap()
            if not record.fetched:  # copies that landed while the block ran: their GPU memory goes now
                for slot in record.slots:
                    if slot.state == _HOST and slot.gpu is not None:
                        self._drop_gpu(slot)

    def _pack(self, record: _Record, t: torch.Tensor):
        with self._lock:
            self._drain()
            c = self._counts
            c["seen"] += 1
            reason = keep_reason(t, self._parameters)
            dev = None if reason else self._device(t.device)
            if reason or dev is None:
                c[reason or "other"] += 1
                return t
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            es = t.element_size()
            lo = t.storage_offset()
            hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            total = storage.nbytes()
            if 2 * (hi - lo) * es >= total and total % es == 0:
                byte_lo, byte_hi = 0, total  # the whole storage: its other views dedupe onto it
            else:
                byte_lo, byte_hi = lo * es, hi * es
            nbytes = byte_hi - byte_lo
            if nbytes < self.min_bytes:
                c["small"] += 1
                return t
            span = (t.device, ptr, byte_lo, byte_hi)
            slot = record.by_span.get(span)
            # Same address is same storage only if the storage object is the one first seen (PyTorch
            # keeps one Python object per live storage); a freed one's address may be reused.
            if slot is None or slot.ref() is not storage:
                gpu = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, byte_lo, (nbytes,), (1,))
                stream = dev.current()
                ready = dev.event()
                ready.record(stream)
                slot = _Slot(record, dev, nbytes, gpu, ready, weakref.ref(storage), stream)
                record.slots.append(slot)
                record.by_span[span] = slot
                self._pending.append(slot)
                self._pending_bytes += nbytes
                c["slots"] += 1
                c["bytes_packed"] += nbytes
                record.nbytes += nbytes
                self._largest = max(self._largest, record.nbytes)
                self._by_block[record.key] += nbytes
            version = t._version
            slot.watch.append((t.detach(), version))  # the record is open: gpu is the original storage
            record.handles += 1
            if record.seq not in self._live:
                self._live[record.seq] = record
            self._pump()
            return _Packed(slot, t.dtype, t.shape, t.stride(), (lo * es - byte_lo) // es, version, weakref.ref(t))

    def _pump(self) -> None:
        """Issue queued D2H copies while the copy queue is short; wait while too much is pending."""
        self._reap()
        self._issue_pending()
        window = self.window_bytes()
        while self._pending_bytes + self._inflight_bytes > window:
            if not self._inflight:
                self._issue_one()
                continue
            start = time.perf_counter()
            self._inflight[0].d2h_end.synchronize()  # one copy's event, not the device
            self._times["host_wait_s"] += time.perf_counter() - start
            self._reap()
            self._issue_pending()

    def _issue_pending(self) -> None:
        while self._pending and self._inflight_bytes < self._issue_window:
            self._issue_one()

    def _issue_one(self) -> None:
        slot = self._pending.popleft()
        if slot.state != _PENDING:  # cancelled: the backward took it from the GPU
            return
        self._pending_bytes -= slot.nbytes
        dev, n = slot.dev, slot.nbytes
        buffer, fence = self.pool.take(n)
        start, end = dev.event(self.timing), dev.event(self.timing)
        with dev.on(dev.d2h):
            dev.d2h.wait_event(slot.ready)
            if fence is not None:
                dev.d2h.wait_event(fence)
            if self._delay:
                dev.sleep(self._delay)
            start.record(dev.d2h)
            dev.copy(buffer[:n], slot.gpu)
            end.record(dev.d2h)
        slot.host, slot.d2h_end, slot.ready, slot.state = buffer, end, None, _INFLIGHT
        self._inflight.append(slot)
        self._inflight_bytes += n
        self._counts["bytes_d2h"] += n
        if self.timing:
            self._timed["d2h"].append((start, end, "d2h_s"))

    def _reap(self) -> None:
        """Copies the host has seen complete: their GPU tensors can go (unless in use)."""
        while self._inflight and self._inflight[0].d2h_end.query():
            slot = self._inflight.popleft()
            self._inflight_bytes -= slot.nbytes
            slot.state = _HOST
            if not slot.record.fetched and not slot.record.open:
                self._drop_gpu(slot)
        self._settle_timing()

    def _settle_timing(self) -> None:
        for deque in self._timed.values():
            while deque and deque[0][1].query():
                start, end, name = deque.popleft()
                self._times[name] += start.elapsed_time(end) / 1e3

    # -- backward: unpack ------------------------------------------------------------------------

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        slot = packed.slot
        with self._lock:
            self._drain()
            self._drain_at_backward_end()
            self._check_version(packed)
            if self._current is not slot.record:
                self._activate(slot.record)
            if slot.gpu is None:  # dropped since its record was current (retain_graph, re-entry)
                self._fetch_slots([slot])
            dev = slot.dev
            stream = dev.current()
            key = dev.key(stream)
            if key not in slot.users:
                slot.users[key] = stream  # its GPU memory is read here: fenced or recorded when dropped
                if slot.h2d_end is not None:
                    self._wait(dev, stream, slot.h2d_end)
            typed = slot.gpu.view(packed.dtype)
        # as_strided's offset counts from the storage's start: a slot over the original tensor of
        # a partial span begins ``byte_lo`` into it, a fetched copy at 0
        return typed.as_strided(packed.size, packed.stride, typed.storage_offset() + packed.offset)

    def _check_version(self, packed: _Packed) -> None:
        """Raise autograd's error if the saved tensor was written in place since it was packed."""
        slot = packed.slot
        self._observe(slot)
        tensor = packed.ref()
        if tensor is not None and tensor._version != packed.version:
            raise _modified_error(packed, slot.dev.device, tensor._version, packed.version)
        if slot.changed is not None:
            raise _modified_error(packed, slot.dev.device, *slot.changed)

    @staticmethod
    def _observe(slot: _Slot) -> None:
        for tensor, version in slot.watch:
            if slot.changed is None and tensor._version != version:
                slot.changed = (tensor._version, version)

    def _drain_at_backward_end(self) -> None:
        """Make this backward drain the release queue when it ends (its records' last handles go
        as its nodes run, after the last unpack)."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._callback_task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        with self._lock:
            self._drain()

    def _activate(self, record: _Record) -> None:
        previous, self._current = self._current, record
        if previous is not None and not previous.done:
            self._release(previous)
        earlier = sorted((r for r in self._live.values() if r.seq < record.seq), key=lambda r: -r.seq)
        targets = [r for r in [record, *earlier[:self.prefetch_blocks]] if not r.fetched]
        for r in targets:
            r.fetched = True
            for slot in r.slots:
                if slot.state == _PENDING:  # never copied: it stays where it is, both directions saved
                    slot.state = _KEPT
                    self._pending_bytes -= slot.nbytes
                    self._counts["kept"] += slot.nbytes
        self._reap()  # after marking: copies that just landed keep their GPU tensor for this use
        for r in targets:
            missing = [s for s in reversed(r.slots) if s.gpu is None]  # backward goes in reverse
            if missing:
                self._fetch_slots(missing)

    def _fetch_slots(self, slots) -> None:
        for dev in {id(s.dev): s.dev for s in slots}.values():  # each from its own device
            group = [s for s in slots if s.dev is dev]
            stream = dev.current()
            destinations = [dev.empty(s.nbytes) for s in group]
            allocated = dev.event()
            allocated.record(stream)  # the memory is the consuming stream's; copy into it after this
            with dev.on(dev.h2d):
                dev.h2d.wait_event(allocated)
                for slot, gpu in zip(group, destinations):
                    if self._delay:
                        dev.sleep(self._delay)
                    start, end = dev.event(self.timing), dev.event(self.timing)
                    start.record(dev.h2d)
                    dev.copy(gpu, slot.host[:slot.nbytes])
                    end.record(dev.h2d)
                    slot.gpu, slot.h2d_end, slot.last_read = gpu, end, end
                    slot.alloc_stream, slot.alloc_key, slot.users = stream, dev.key(stream), {}
                    self._counts["bytes_h2d"] += slot.nbytes
                    if self.timing:
                        self._timed["h2d"].append((start, end, "h2d_s"))

    def _wait(self, dev, stream, event) -> None:
        self._counts["compute_waits"] += 1
        if not self.timing:
            stream.wait_event(event)
            return
        before, after = dev.event(True), dev.event(True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._timed["wait"].append((before, after, "compute_wait_s"))

    def _release(self, record: _Record) -> None:
        """Drop the GPU copies of slots that also live on the host (a later unpack re-fetches)."""
        record.fetched = False
        for slot in record.slots:
            if slot.state == _HOST and slot.gpu is not None:
                self._drop_gpu(slot)

    def _drop_gpu(self, slot: _Slot) -> None:
        """Let go of a slot's GPU memory so that no stream that used it is overtaken by its reuse."""
        dev = slot.dev
        if slot.h2d_end is None:  # the original storage: the last chance to see a write to it
            self._observe(slot)
            slot.watch = []
        elif slot.alloc_key not in slot.users:
            # prefetched, never consumed on the stream that owns the memory: that stream must not
            # reuse it before the copy into it has landed
            slot.alloc_stream.wait_event(slot.h2d_end)
        for key, stream in slot.users.items():
            if key != slot.alloc_key:  # read on another stream: the allocator waits for it too
                dev.free_after(slot.gpu, stream)
        slot.gpu = slot.h2d_end = slot.alloc_stream = slot.alloc_key = None
        slot.users = {}

    # -- end of a record's life --------------------------------------------------------------------

    def _drain(self) -> None:
        """Count the packed handles ``__del__`` queued; finalize records with none left (under the lock)."""
        released = self._released
        while released:
            record = released.popleft()
            record.handles -= 1
            if record.handles == 0 and not record.open:
                self._finalize(record)

    def _finalize(self, record: _Record) -> None:
        record.done = True
        self._live.pop(record.seq, None)
        if self._current is record:
            self._current = None
        for slot in record.slots:
            if slot.state == _PENDING:
                slot.state = _KEPT
                self._pending_bytes -= slot.nbytes
            elif slot.state == _INFLIGHT:
                # Its copy no longer matters but still reads the GPU tensor and writes the buffer:
                # the allocator holds the block back until the copy stream passes it (the one
                # record_stream, on memory the step no longer counts on), the pool's next copy into
                # the buffer waits for it; the window stops counting it now.
                slot.dev.free_after(slot.gpu, slot.dev.d2h)
                self._inflight.remove(slot)
                self._inflight_bytes -= slot.nbytes
                self.pool.give(slot.host, slot.d2h_end)
                slot.state, slot.host = _HOST, None
            if slot.gpu is not None:
                self._drop_gpu(slot)
            if slot.host is not None:
                self.pool.give(slot.host, slot.last_read)
                slot.host = None
        record.slots, record.by_span = [], {}
        self._reap()


class _BlockContext:
    """``with engine.saved_tensors(key):`` one record, hooks installed for the duration."""

    __slots__ = ("engine", "key", "record", "hooks")

    def __init__(self, engine: OffloadEngine, key: int):
        self.engine, self.key = engine, key

    def __enter__(self):
        self.record = self.engine._open(self.key)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self.engine._pack, self.record), self.engine._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.engine._close(self.record)
        return False
