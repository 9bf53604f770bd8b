"""The offload engine's backward half: saved tensors come back, and records give back what they held.

:class:`_Backward` is the part of :class:`remat.offload.engine.OffloadEngine` that runs after a
block's forward (the engine inherits it; both share the engine's lock, queues and counters).

- The first unpack of a record makes it current: its host-only slots are copied back on a second
  stream (the two directions use different copy engines, so a backward's fetches overlap a
  forward's tail), the consuming stream waits on each slot's event, and the ``prefetch_blocks``
  records before it are fetched at once to overlap this block's backward. Destinations are
  allocated on the consuming stream and fenced so that the allocator never hands memory out while
  a copy writes it or a kernel reads it. The record that stops being current gives back its GPU
  copies (the host copies stay, so ``retain_graph`` re-fetches).
- Slots still queued for their device-to-host copy when their record becomes current are never
  moved; copies in flight are used from their GPU tensor directly.
- In-place writes: the versions a slot watches are read again when the engine lets go of the
  original storage and at each unpack; a change raises autograd's own RuntimeError.
- End of life: ``_drain`` counts the handles whose ``__del__`` queued a release (at packs, unpacks,
  block boundaries, :meth:`OffloadEngine.stats` and each backward's end); a record whose last
  handle is drained gives its pinned buffers back to the pool.

Why a base class rather than helper functions taking the engine: these methods read and write a
dozen of the engine's fields under its lock; as methods they keep the names the forward half and the
tests use (``engine._unpack``, ``engine._finalize``).

Limits: the in-place check misses a write made after the block ended and its copy landed, to a
tensor gone before the backward (the backward then uses the value saved before the write). Streams
are compared by their device object's ``key``, never with ``!=``. More: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import torch

from remat.offload.records import (_HOST, _INFLIGHT, _KEPT, _PENDING, _Packed, _Record, _Slot,
                                   _modified_error)


class _Backward:
    """Unpack, fetch back, release and finalize: the engine's methods after a block's forward."""

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
