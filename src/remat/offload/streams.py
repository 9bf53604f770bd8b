"""Where the offload engine's copies run: one CUDA device's streams and events, or a CPU stand-in.

How it works. :class:`remat.offload.engine.OffloadEngine` never calls ``torch.cuda`` directly; every
stream, event, allocation and copy goes through a small device object with the same few methods
(``current``, ``key``, ``empty``, ``copy``, ``free_after``, ``event``, ``on``, ``sleep`` and the
``d2h``/``h2d`` streams). :class:`_Cuda` is the real one: two side streams per device, one per
copy direction, so the two copy engines can run at once; the engine makes one for each CUDA device
its saved tensors are on, so a model spread over several GPUs copies each block from its own
device. :class:`_Inline` runs on CPU tensors
with synchronous copies and events that have always completed, so all of the engine's
bookkeeping (records, slots, prefetch order, pool reuse) runs in CPU tests; tests subclass it to
model lagging or deferred streams.

Why the indirection rather than ``if cuda:`` branches in the engine: the engine's ordering logic
is the part that goes wrong (a missing wait reads garbage, an early free corrupts a later tensor),
and a device object is the seam where a test can put streams that misbehave on purpose.

Limits: :class:`_Cuda` takes the identity of a stream from its handle (``cuda_stream``) because
``torch.Stream`` compares unequal-to-None as False; ``free_after`` is ``record_stream``, which the
engine uses only where it lets go of memory another stream may still use (a copy's source given up
before the copy ran; a slot read by a stream other than the one that allocated it). :class:`_Inline`
proves bookkeeping, not stream ordering on a real GPU.
"""
from __future__ import annotations

import contextlib

import torch


class _Cuda:
    """Streams and events of one CUDA device."""

    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def key(stream) -> int:
        """A stream's identity: ``torch.Stream`` objects compare ``!= None`` as False."""
        return stream.cuda_stream

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the current (copy) stream

    @staticmethod
    def free_after(tensor: torch.Tensor, stream) -> None:
        """Let the allocator reuse ``tensor``'s block only once ``stream``'s queued work is done."""
        tensor.record_stream(stream)

    @staticmethod
    def event(timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    @staticmethod
    def on(stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def sleep(cycles: int) -> None:
        torch.cuda._sleep(cycles)


class _InlineEvent:
    """An event that has always completed: copies on ``_Inline`` finish when issued."""

    def record(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class _InlineStream:
    def wait_event(self, event) -> None:
        pass


class _Inline:
    """CPU tensors, synchronous copies: runs all of the engine's bookkeeping without a GPU (tests)."""

    pin = False
    device = torch.device("cpu")
    _stream = _InlineStream()
    d2h = h2d = _stream

    def current(self):
        return self._stream

    @staticmethod
    def key(stream) -> int:
        return id(stream)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    @staticmethod
    def free_after(tensor: torch.Tensor, stream) -> None:
        pass  # copies here are done when issued

    @staticmethod
    def event(timing: bool = False):
        return _InlineEvent()

    @staticmethod
    def on(stream):
        return contextlib.nullcontext()

    @staticmethod
    def sleep(cycles: int) -> None:
        pass
