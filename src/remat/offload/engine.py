"""Asynchronous activation offload: the tensors a block saves for backward live in pinned host
memory between its forward and its backward, moved on side streams while compute continues.

How: ``OffloadEngine.saved_tensors(key)`` installs ``torch.autograd.graph.saved_tensors_hooks``
around one block's forward (``offload``) or around its non-reentrant checkpoint (``full+offload``:
the outer hooks then see only the checkpoint's inputs). Each forward call of a block gets a
*record*; each distinct storage span it saves is a *slot*, so a storage saved by several ops or
views moves once and comes back as the same views (:mod:`remat.offload.records`). A pack records an
event on the compute stream and queues the slot; device-to-host copies are issued on a copy stream
of the tensor's device (:mod:`remat.offload.streams`), into a reused :class:`PinnedPool`
(:mod:`remat.offload.pinned`), while less than ``ISSUE_WINDOW`` bytes are queued. The GPU tensor is
dropped once its copy's event has completed and its block has ended (no ``record_stream``, so the
allocator's statistics stay honest); past the window (``max_pending_bytes``) the host waits on the
oldest copy's event, never a device synchronize. Slots still queued when the backward reaches them
are never moved. The backward half (fetch back, prefetch, release) is :mod:`remat.offload.backward`,
which this class inherits.

Memory added beyond a running block: the window of tensors whose host copy has not landed, and the
``prefetch_blocks`` records fetched ahead; the planner models it (:mod:`remat.planning.offload_model`).

Why not the alternatives: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` copies synchronously
on the compute stream and pins per tensor; torchtune/TRL-style offloading issues every copy at once
(GPU memory unbounded while the bus lags) and uses ``record_stream``. Here the queue is short, the
memory waiting for the bus is capped, and the forward's tail is never moved.

Limits: once the window is full a block's forward runs at bus speed, so offload some blocks, by
plan, not all; not inside CUDA-graph capture or ``torch.compile``d regions; without CUDA
``saved_tensors`` is a no-op (warned once). This module re-exports the names callers import from
it. Details and measurements: ``docs/design/treatments.md``, ``benchmarks/results/issue3/README.md``.
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

from remat.offload.backward import _Backward
from remat.offload.pinned import GiB, MiB, PinnedPool  # noqa: F401  (GiB re-exported)
from remat.offload.records import (_HOST, _INFLIGHT, _PENDING, _Packed, _Record, _Slot, _storage_of,
                                   keep_reason, parameter_storages)
from remat.offload.streams import _Cuda, _Inline

DEFAULT_WINDOW_RECORDS = 1  # default max_pending_bytes: this many times the largest record packed
DEFAULT_MIN_BYTES = MiB  # smaller storages stay on the GPU (the profiler counts offload bytes with it)
ISSUE_WINDOW = 512 * MiB  # bytes of D2H copies queued at once: ~10 ms of bus, enough to never idle



class OffloadEngine(_Backward):
    """Moves the tensors blocks save for backward to pinned host memory and back, asynchronously.

    ``remat.apply`` creates one per call, shared by the model's offloaded blocks, and the treatments
    call ``with engine.saved_tensors(block_index): ...``.

    Args:
        model: the model whose blocks it serves (its parameters and buffers are never moved).
        min_bytes: storages smaller than this stay on the GPU.
        max_pending_bytes: the window: GPU bytes of saved tensors whose host copy has not been seen
            to land; above it the forward waits for the bus. None: ``DEFAULT_WINDOW_RECORDS`` times
            the largest record (one block call's offloaded bytes) packed so far
            (``remat.planning.offload_model.gpu_overhead_bytes`` models it).
        prefetch_blocks: records copied back ahead of the backward (1 hides a block's copy behind
            the next block's backward when the bus keeps up).
        host_memory_limit: bytes of pinned memory the pool may hold (None: 60% of MemAvailable).
        timing: CUDA events around copies and waits, for :meth:`stats`.

    Raises (during a step, not here):
        ValueError: the pinned pool would pass ``host_memory_limit``."""

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
        self._issue_window = ISSUE_WINDOW
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
        """The pack hook: a slot's handle, or for a tensor kept in place ``t.detach()``, never ``t``
        itself: a saved output handed back with its grad_fn is a cycle (output -> grad_fn -> saved
        variable -> output) that gc cannot see, so a forward that never reaches its backward (a step
        stopped by an error) would keep its whole graph and the model alive. Autograd re-attaches
        the grad_fn on unpack, so detaching loses nothing."""
        with self._lock:
            self._drain()
            c = self._counts
            c["seen"] += 1
            reason = keep_reason(t, self._parameters)
            dev = None if reason else self._device(t.device)
            if reason or dev is None:
                c[reason or "other"] += 1
                return t.detach()
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
                return t.detach()
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
        slot = self._pending[0]
        if slot.state != _PENDING:  # cancelled: the backward took it from the GPU
            self._pending.popleft()
            return
        dev, n = slot.dev, slot.nbytes
        buffer, fence = self.pool.take(n)   # may raise (the pool's limit): the slot stays queued
        self._pending.popleft()
        self._pending_bytes -= slot.nbytes
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
