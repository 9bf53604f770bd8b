"""Asynchronous activation offload: the tensors a block saves for backward live in pinned host
memory between its forward and its backward, moved on side streams while compute continues.

How it works. ``OffloadEngine.saved_tensors(key)`` installs
``torch.autograd.graph.saved_tensors_hooks`` around one block's forward (``offload``) or around
its non-reentrant checkpoint (``full+offload``: there the outer hooks see only the checkpoint's
inputs, which ``_NoopSaveInputs`` saves under the caller's hooks; the recomputation runs under
checkpoint's own hooks). Each forward call of a block gets a *record*; each distinct storage span
it saves is a *slot*, so a storage saved by several ops (or as several views) moves once and comes
back as the same views (``view(dtype).as_strided`` over one byte buffer).

- Kept on the GPU, never moved: parameters, buffers and views of them (storage pointers compared
  against the model's, recollected when the first parameter's storage changes, e.g. ``model.to``);
  tensors under ``min_bytes`` (hundreds of tiny copies would cost more Python than bus); anything
  that is not a plain strided tensor on the model's CUDA device.
- Forward: a pack records an event on the compute stream and queues the slot. Device-to-host copies
  are issued on a dedicated stream (waiting on that event) while less than ``_ISSUE_WINDOW`` bytes
  are queued there, into buffers from a :class:`PinnedPool`. The engine keeps the GPU tensor alive
  and drops it once the copy's event has completed (``event.query()`` at later packs, at each
  offloaded block's end and at the first unpack of the backward), so the caching allocator's
  ``allocated`` statistics stay honest (``record_stream`` would make freed memory look free before
  the copy ends). The forward runs ~4x faster than the bus on the bench model, so past the window
  (``max_pending_bytes``) the host waits on the *oldest copy's* event (never a device synchronize).
- Copies are issued lazily: slots still queued when the backward reaches them are never moved at
  all (the tail of the forward is needed first in backward), which saves both directions;
  copies already in flight are used from their GPU tensor directly.
- Backward runs blocks in reverse order. The first unpack of a record makes it current: its slots
  that live only on the host are copied back on a second stream (host-to-device; the two directions
  use different copy engines, so a backward's fetches overlap a forward's tail), the consuming
  stream waits on each slot's event (GPU side), and the ``prefetch_blocks`` records before it in
  forward order are fetched at once so their copies overlap this block's backward. Destination
  memory is allocated on the consuming stream and the copy stream first waits for it; a
  destination given up before the consuming stream waited on its copy is fenced on that stream
  first, so the allocator never hands it out while a copy still writes it. The record that stops
  being current gives back its GPU copies (their host copies stay, so a second unpack under
  ``retain_graph`` re-fetches). When autograd frees a record's last packed handle (normally right
  after its backward node ran; on garbage collection for a forward that never saw backward), its
  pinned buffers go back to the pool, fenced by the last host-to-device copy that read them.
- Pinned pool: buffers in power-of-two size classes, reused from step to step, bounded by a host
  memory limit that raises a ValueError before it is passed (:mod:`remat.offload.pinned`).
- Without CUDA (or with the model on the CPU) ``saved_tensors`` is a no-op and the engine warns once.

Memory the engine adds. Beyond what a block holds while it runs, the engine holds GPU memory for
other blocks in two ways only: at most the *window* ``W`` (``max_pending_bytes``; default
``DEFAULT_WINDOW_RECORDS`` times the largest record packed) of saved tensors whose host copy has
not been seen to land, and during a block's backward the ``prefetch_blocks`` records fetched ahead.
The rule, why the window is one record, and its pure form :func:`gpu_overhead_bytes` (for the
planner) are in :mod:`remat.offload.overhead`; the device objects that run the copies are in
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
per block. Stream identities are compared by handle, never with ``!=`` (``torch.Stream`` compares
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

from remat.offload.overhead import DEFAULT_WINDOW_RECORDS, gpu_overhead_bytes  # noqa: F401  (re-exported)
from remat.offload.pinned import GiB, MiB, PinnedPool  # noqa: F401  (GiB re-exported)
from remat.offload.streams import _Cuda, _Inline

DEFAULT_MIN_BYTES = MiB  # smaller storages stay on the GPU (the profiler counts offload bytes with it)
_ISSUE_WINDOW = 512 * MiB  # bytes of D2H copies queued at once: ~10 ms of bus, enough to never idle

_PENDING, _INFLIGHT, _HOST, _KEPT = "pending", "in flight", "host", "kept"


def engine_of(model: nn.Module) -> Optional["OffloadEngine"]:
    """The engine ``remat.apply`` attached to ``model``'s offloaded blocks, or None."""
    for module in model.modules():
        state = module.__dict__.get("_remat")
        if state is not None and getattr(state, "engine", None) is not None:
            return state.engine
    return None


class _Record:
    """One forward call of one block: its slots, and how many packed handles autograd still holds."""

    __slots__ = ("engine", "seq", "key", "slots", "by_span", "nbytes", "handles", "open", "fetched", "done")

    def __init__(self, engine, seq, key):
        self.engine, self.seq, self.key = engine, seq, key
        self.slots, self.by_span, self.nbytes = [], {}, 0
        self.handles, self.open, self.fetched, self.done = 0, True, False, False


class _Slot:
    """One storage span: where its bytes are (GPU tensor, host buffer or both) and the copy events."""

    __slots__ = ("record", "nbytes", "state", "gpu", "host", "ready", "d2h_end", "h2d_end",
                 "alloc_stream", "alloc_key", "waited_key", "last_read", "ref")

    def __init__(self, record, nbytes, gpu, ready, ref):
        self.record, self.nbytes, self.state, self.gpu, self.ready, self.ref = (
            record, nbytes, _PENDING, gpu, ready, ref)
        self.host = self.d2h_end = self.h2d_end = self.last_read = None
        self.alloc_stream = self.alloc_key = self.waited_key = None


class _Packed:
    """What autograd holds instead of an offloaded tensor: a slot and the view to rebuild."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset")

    def __init__(self, slot, dtype, size, stride, offset):
        self.slot, self.dtype, self.size, self.stride, self.offset = slot, dtype, size, stride, offset

    def __del__(self):
        record = self.slot.record
        record.engine._drop_handle(record)


class OffloadEngine:
    """Moves the tensors blocks save for backward to pinned host memory and back, asynchronously.

    ``remat.apply`` creates one per call, shared by the model's offloaded blocks, and the
    treatments call ``with engine.saved_tensors(block_index): ...``.

    - ``min_bytes``: storages smaller than this stay on the GPU.
    - ``max_pending_bytes``: the window: GPU bytes of saved tensors whose host copy has not been
      seen to land; above it the forward waits for the bus. None: ``DEFAULT_WINDOW_RECORDS`` times
      the largest record (one block call's offloaded bytes) packed so far. See "Memory the engine
      adds" in the module docstring and :func:`gpu_overhead_bytes`.
    - ``prefetch_blocks``: records copied back ahead of the backward (1 hides a block's copy
      behind the next block's backward when the bus keeps up).
    - ``host_memory_limit``: bytes of pinned memory the pool may hold (None: 60% of MemAvailable).
    - ``timing``: CUDA events around copies and waits, for :meth:`stats`.
    """

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
        self._inline = _inline
        self._delay = _copy_delay_cycles
        self._issue_window = _ISSUE_WINDOW
        self.pool = PinnedPool(host_memory_limit, pin=not _inline)
        self._lock = threading.RLock()
        self._dev = None
        self._warned = False
        self._fingerprint = None
        self._param_ptrs = frozenset()
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

    # -- the interface treatments use --------------------------------------------------------

    def saved_tensors(self, key: int):
        """Context manager for one block's forward: what it saves for backward is offloaded."""
        if not self._ready():
            return contextlib.nullcontext()
        return _BlockContext(self, key)

    # -- statistics ----------------------------------------------------------------------------

    def reset_stats(self) -> None:
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
        param = next(self._model_ref.parameters(), None)
        if self._inline:
            if self._dev is None:
                self._dev = _Inline()
        elif not torch.cuda.is_available() or param is None or param.device.type != "cuda":
            if not self._warned:
                self._warned = True
                why = "CUDA is not available" if not torch.cuda.is_available() else "the model is not on a CUDA device"
                warnings.warn(f"remat offload: {why}, so offloaded blocks keep what they save in place "
                              "(no host copies, no memory saved); gradients are unchanged.", stacklevel=4)
            return False
        fingerprint = (id(param), param.data_ptr() if param is not None else None)
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            tensors = [*self._model_ref.parameters(), *self._model_ref.buffers()]
            self._param_ptrs = frozenset(t.untyped_storage().data_ptr() for t in tensors)
            if not self._inline and (self._dev is None or self._dev.device != param.device):
                self._dev = _Cuda(param.device)
        return True

    def window_bytes(self) -> int:
        """The window in force: ``max_pending_bytes``, or its default from the records seen."""
        if self.max_pending_bytes is not None:
            return self.max_pending_bytes
        return DEFAULT_WINDOW_RECORDS * self._largest

    # -- forward: pack ---------------------------------------------------------------------------

    def _open(self, key) -> _Record:
        with self._lock:
            self._seq += 1
            return _Record(self, self._seq, key)

    def _close(self, record: _Record) -> None:
        with self._lock:
            record.open = False
            if record.handles == 0:
                self._finalize(record)
            else:
                self._reap()

    def _pack(self, record: _Record, t: torch.Tensor):
        c = self._counts
        c["seen"] += 1
        dev = self._dev
        if (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            c["param"] += 1
            return t
        if type(t) is not torch.Tensor or t.device != dev.device or t.layout != torch.strided \
                or t.is_conj() or t.is_neg() or t.numel() == 0:
            c["other"] += 1
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_ptrs:
            c["param"] += 1
            return t
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
        with self._lock:
            span = (ptr, byte_lo, byte_hi)
            slot = record.by_span.get(span)
            # Same address is same storage only if the storage object is the one first seen (PyTorch
            # keeps one Python object per live storage); a freed one's address may be reused.
            if slot is None or slot.ref() is not storage:
                gpu = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, byte_lo, (nbytes,), (1,))
                ready = dev.event()
                ready.record(dev.current())
                slot = _Slot(record, nbytes, gpu, ready, weakref.ref(storage))
                record.slots.append(slot)
                record.by_span[span] = slot
                self._pending.append(slot)
                self._pending_bytes += nbytes
                c["slots"] += 1
                c["bytes_packed"] += nbytes
                record.nbytes += nbytes
                self._largest = max(self._largest, record.nbytes)
                self._by_block[record.key] += nbytes
            record.handles += 1
            if record.seq not in self._live:
                self._live[record.seq] = record
            self._pump()
        return _Packed(slot, t.dtype, t.shape, t.stride(), (lo * es - byte_lo) // es)

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
        dev, n = self._dev, slot.nbytes
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
            if not slot.record.fetched:
                slot.gpu = None
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
            if self._current is not slot.record:
                self._activate(slot.record)
            if slot.gpu is None:  # dropped since its record was current (retain_graph, re-entry)
                self._fetch_slots([slot])
            stream = self._dev.current()
            key = self._dev.key(stream)
            if slot.h2d_end is not None and slot.waited_key != key:
                self._wait(stream, slot.h2d_end)
                slot.waited_key = key
            typed = slot.gpu.view(packed.dtype)
        # as_strided's offset counts from the storage's start: a slot over the original tensor of
        # a partial span begins ``byte_lo`` into it, a fetched copy at 0
        return typed.as_strided(packed.size, packed.stride, typed.storage_offset() + packed.offset)

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
        dev = self._dev
        stream = dev.current()
        destinations = [dev.empty(s.nbytes) for s in slots]
        allocated = dev.event()
        allocated.record(stream)  # the memory is the consuming stream's; copy into it after this
        with dev.on(dev.h2d):
            dev.h2d.wait_event(allocated)
            for slot, gpu in zip(slots, destinations):
                if self._delay:
                    dev.sleep(self._delay)
                start, end = dev.event(self.timing), dev.event(self.timing)
                start.record(dev.h2d)
                dev.copy(gpu, slot.host[:slot.nbytes])
                end.record(dev.h2d)
                slot.gpu, slot.h2d_end, slot.last_read = gpu, end, end
                slot.alloc_stream, slot.alloc_key, slot.waited_key = stream, dev.key(stream), None
                self._counts["bytes_h2d"] += slot.nbytes
                if self.timing:
                    self._timed["h2d"].append((start, end, "h2d_s"))

    def _wait(self, stream, event) -> None:
        self._counts["compute_waits"] += 1
        if not self.timing:
            stream.wait_event(event)
            return
        before, after = self._dev.event(True), self._dev.event(True)
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
        if slot.h2d_end is not None and slot.waited_key != slot.alloc_key:
            # prefetched, never consumed on the stream that owns the memory: that stream must not
            # reuse it before the copy into it has landed
            slot.alloc_stream.wait_event(slot.h2d_end)
        slot.gpu = slot.h2d_end = slot.alloc_stream = slot.alloc_key = slot.waited_key = None

    # -- end of a record's life --------------------------------------------------------------------

    def _drop_handle(self, record: _Record) -> None:
        with self._lock:
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
                slot.gpu = None
            elif slot.state == _INFLIGHT:
                # Its copy no longer matters but still reads the GPU tensor and writes the buffer:
                # the allocator holds the block back until the copy stream passes it (the one
                # record_stream, on memory the step no longer counts on), the pool's next copy into
                # the buffer waits for it; the window stops counting it now.
                self._dev.free_after(slot.gpu, self._dev.d2h)
                self._inflight.remove(slot)
                self._inflight_bytes -= slot.nbytes
                self.pool.give(slot.host, slot.d2h_end)
                slot.state, slot.gpu, slot.host = _HOST, None, None
            else:
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
