"""Peak tensor memory of a region on any device, counted from the tensors themselves.

On CUDA, ``torch.cuda.max_memory_allocated`` is the truth and remat uses it. On the CPU
there is no allocator statistic, so this module tracks storages: a ``TorchDispatchMode``
sees every op's outputs, records each new storage (by data pointer, once) with a weak
reference, and after every op drops the ones that died. The running sum is the live
tensor bytes; its maximum is the peak. Tensors alive before the region (parameters,
inputs) are counted once at entry when passed as ``baseline``.

A wrapper subclass (a functional collective's ``AsyncCollectiveTensor``, a ``DTensor``) owns no
storage: it is counted by the plain tensors it wraps.

Limits: it counts tensor storage bytes, not allocator rounding or fragmentation (CUDA's
caching allocator rounds to 512 bytes and keeps blocks per stream), nor a kernel's scratch
memory that is never a tensor the dispatcher returns; ops that write into
storages created outside the mode are not new allocations, which is right. It costs a
Python call per op: use it on small models.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class PeakTracker(TorchDispatchMode):
    """``with PeakTracker(baseline=model.parameters()) as t: step()`` then ``t.peak``."""

    def __init__(self, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live = {}
        self.current = 0
        for tensor in baseline:
            self._add(tensor)
        self.peak = self.current

    def _add(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                self._add(getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._live and not self._live[ptr][0].expired():
            return
        size = storage.nbytes()
        self._live[ptr] = (StorageWeakRef(storage), size)
        self.current += size

    def _collect(self) -> None:
        dead = [ptr for ptr, (ref, _) in self._live.items() if ref.expired()]
        for ptr in dead:
            self.current -= self._live.pop(ptr)[1]

    def live_bytes(self) -> int:
        """Bytes of the tracked storages alive now (the running sum is updated per op)."""
        self._collect()
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._collect()
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._add(tensor)
        self.peak = max(self.peak, self.current)
        return out
