"""Segments: K consecutive blocks checkpointed as one unit, while the model's own loop calls them.

Why not ``checkpoint_sequential``: it needs the blocks as a list of functions of one tensor, while
a Hugging Face model calls its layers in its own ``forward``, each with keyword arguments (rotary
tables, masks, cache positions) that may differ per layer. So a segment cannot be one
``checkpoint(...)`` call.

How: each block of a segment runs under ``saved_tensors_hooks`` that save nothing: every tensor
autograd would keep is replaced by a placeholder (:class:`_Holder`), and the call is recorded (the
function, its arguments, its RNG and autocast state). The first placeholder unpacked in backward
replays the recorded calls in order under ``enable_grad`` and hands each placeholder its recomputed
tensor. A segment keeps its first block's arguments; its backward holds the K blocks' activations
at once; each block is recomputed once.

Chaining: a tensor argument of block j that *is* an output of an earlier block of the run (the
hidden state) is recorded as "output k of call i" and replayed from the recomputed output; any
other tensor argument is kept as given (correct whatever the model does between blocks, only
costlier). A run starts at the segment's first block or at any block called out of order, and
ends at its last. Saved tensors are matched to placeholders by order within each call, as
non-reentrant ``checkpoint`` does; a recompute saving a different number is reported.

Limits: under ``torch.compile`` a segment's blocks run eagerly (a graph break around each); under
FSDP2 a segment must lie within one ``fully_shard`` unit, since earlier blocks are recomputed
during the last one's backward. More: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states



def segments_of(records) -> dict:
    """``{segment number: Segment}`` for the segments of ``records`` (the blocks'
    :class:`remat.planning.records.BlockRecord`, which number each segment and size it), one
    fresh :class:`Segment` each, shared by its blocks."""
    return {r.segment: Segment(r.segment, r.segment_size) for r in records if r.segment is not None}


class Segment:
    """Shared by the blocks of one segment: its size and the run its blocks are recording."""

    def __init__(self, number: int, size: int):
        self.number = number
        self.size = size
        self.run: Optional[_Run] = None

    def __getstate__(self):  # a copy or a pickle of the model starts with no run in flight
        return {"number": self.number, "size": self.size, "run": None}


def call(segment: Segment, position: int, function: Callable, args: tuple, kwargs: dict):
    """``function(*args, **kwargs)`` as block ``position`` of ``segment``: recorded, nothing saved."""
    if torch.compiler.is_compiling():  # compiled code saves other tensors than an eager replay
        return torch.compiler.disable(_call, recursive=True)(segment, position, function, args, kwargs)
    return _call(segment, position, function, args, kwargs)


def _call(segment: Segment, position: int, function: Callable, args: tuple, kwargs: dict):
    run = segment.run
    if position == 0 or run is None or len(run.calls) != position:
        run = segment.run = _Run(segment.number)
    try:
        out = run.call(function, args, kwargs)
    except BaseException:
        segment.run = None
        raise
    if position == segment.size - 1:
        segment.run = None  # from here the run lives on only in the placeholders autograd holds
    return out


class _Holder:
    """What autograd holds instead of a saved tensor (a weak key: it dies with the graph)."""


@dataclass(frozen=True)
class _Output:
    """In a recorded call: "tensor ``leaf`` of call ``call``'s output"."""

    call: int
    leaf: int


@dataclass
class _Call:
    function: Callable
    leaves: list          # its arguments, flattened; _Output where a leaf is an earlier call's output
    spec: Any             # the pytree spec of (args, kwargs)
    cpu_rng: torch.Tensor
    devices: tuple        # (device type, device indices, their RNG states)
    autocast: tuple       # ((device type, enabled, dtype), ...), cache_enabled
    holders: list         # weak references to its placeholders, in the order they were saved


class _Run:
    """One forward through a segment: the calls recorded, and the tensors recomputed in backward."""

    def __init__(self, number: int):
        self.number = number
        self.calls: list = []
        self.outputs: dict = {}  # id(tensor) -> (weakref, version, _Output): chaining by identity
        self.recomputed = weakref.WeakKeyDictionary()

    def call(self, function, args, kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
        devices = (device_type, *get_device_states(*tensors)) if device_type else None
        record = _Call(function, [self._source(leaf) for leaf in leaves], spec, torch.get_rng_state(),
                       devices, autocast_state(device_type), [])
        self.calls.append(record)

        def pack(tensor):
            holder = _Holder()
            record.holders.append(weakref.ref(holder))
            return holder
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = function(*args, **kwargs)
        index = len(self.calls) - 1
        for leaf, value in enumerate(tree_flatten(out)[0]):
            if isinstance(value, torch.Tensor):
                self.outputs[id(value)] = (weakref.ref(value), value._version, _Output(index, leaf))
        return out

    def _source(self, leaf):
        """``leaf`` as recorded: an earlier call's output (unchanged since) by reference, else itself."""
        if not isinstance(leaf, torch.Tensor):
            return leaf
        ref, version, source = self.outputs.get(id(leaf), (None, None, None))
        return source if ref is not None and ref() is leaf and leaf._version == version else leaf

    def _unpack(self, holder):
        if holder not in self.recomputed:
            self._recompute()
        return self.recomputed[holder]

    def _recompute(self):
        outputs = []
        devices = {(c.devices[0], i) for c in self.calls if c.devices for i in c.devices[1]}
        device_type = next(iter(devices))[0] if devices else None
        with torch.random.fork_rng(devices=sorted(i for _, i in devices), device_type=device_type or "cuda"), \
                torch.enable_grad():
            for index, record in enumerate(self.calls):
                leaves = [outputs[v.call][v.leaf] if isinstance(v, _Output) else v for v in record.leaves]
                args, kwargs = tree_unflatten(leaves, record.spec)
                torch.set_rng_state(record.cpu_rng)
                if record.devices:
                    set_device_states(record.devices[1], record.devices[2], device_type=record.devices[0])
                count = [0]

                def pack(tensor, record=record, count=count):
                    holder = record.holders[count[0]]() if count[0] < len(record.holders) else None
                    count[0] += 1
                    if holder is not None:
                        self.recomputed[holder] = tensor.detach() if tensor.requires_grad else tensor
                with autocast_as(record.autocast), torch.autograd.graph.saved_tensors_hooks(pack, _never):
                    out = record.function(*args, **kwargs)
                if count[0] != len(record.holders):
                    raise RuntimeError(
                        f"remat segment {self.number}: block {index} of the segment saved {len(record.holders)} "
                        f"tensors for backward in its forward but {count[0]} when recomputed, so the recompute "
                        "took another path (the block branches on state that changed since its forward). Use "
                        "'full' on these blocks instead of a segment.")
                outputs.append(tree_flatten(out)[0])


def _never(_):
    raise RuntimeError("remat segments: a recomputed graph is never differentiated")


def autocast_state(device_type: Optional[str]) -> tuple:
    """The autocast state now, for the CPU and ``device_type``: what :func:`autocast_as` re-enters
    where a recompute runs outside the forward's autocast (a segment's, a tiled sub-module's backward)."""
    kinds = ["cpu"] + ([device_type] if device_type and torch.amp.is_autocast_available(device_type) else [])
    return (tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds),
            torch.is_autocast_cache_enabled())


def autocast_as(state: tuple):
    """A context that runs under the autocast state :func:`autocast_state` recorded."""
    kinds, cache = state
    stack = contextlib.ExitStack()
    for kind, enabled, dtype in kinds:
        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack
