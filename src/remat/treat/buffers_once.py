"""The buffers-once guard: a recomputed block updates its state once per forward, as an untreated one.

A checkpoint's recompute runs the block's forward a second time. A forward that writes state
(BatchNorm's running statistics, updated in place; I-BERT's quantisation ranges, buffers assigned
anew and read by its output; RecurrentGemma's recurrent state, a plain attribute the next call
starts from) would then update it twice a step, and its recompute would start from the state the
forward left, so compute other values than the forward did. :func:`buffers_once` wraps the
checkpointed function so that its second and later calls start from the state its first call
started from and leave the state as the first call left it.

How: :func:`state_slots` lists every place a forward may keep state in: each buffer and each plain
attribute holding a tensor or None. Which of them a forward writes is learned at the block's first
forward, from each slot's tensor, version and value (fake tensors, which hold no values: tensor and
version); a module's buffers count together where any of them was written (a running mean can come
out bitwise unchanged while its batch count moves). From then on only those are copied, before each
forward, for its recompute; the recompute runs on the copies, then the forward's values are put back.
The copies are made outside the checkpoint's dispatch modes, so selective's op-by-op replay does not
see them. Under ``torch.compile`` this is left to the graph.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes


def state_slots(target: nn.Module) -> tuple:
    """``(module, name, holder)`` of every place a forward may keep state in: each buffer
    (``holder`` the module's ``_buffers``) and each plain attribute holding a tensor or None
    (``holder`` its ``__dict__``: RecurrentGemma keeps its recurrent and convolution states there)."""
    slots = []
    for module in target.modules():
        slots += [(module, name, module._buffers) for name, b in module._buffers.items() if b is not None]
        slots += [(module, name, module.__dict__) for name, value in module.__dict__.items()
                  if not name.startswith("_") and (value is None or isinstance(value, torch.Tensor))]
    return tuple(slots)


def buffers_once(function, state):
    """``function`` whose second and later calls (checkpoint's recompute) start from the state its
    first call started from and leave it as the first call left it (see the module doc).

    ``state``: the block's :class:`~remat.treat.treatments.TreatmentState`; its ``buffers`` are the
    slots to watch (:func:`state_slots`), its ``written`` is filled at the block's first forward
    with those the forward wrote, and only those are watched from then on."""
    calls, saved = [0], []
    watched = state.buffers if state.written is None else state.written

    def run(*flat, **kwargs):
        calls[0] += 1
        if torch.compiler.is_compiling():
            return function(*flat, **kwargs)
        if calls[0] == 1:
            # outside the checkpoint's dispatch modes: selective's op-by-op replay must not see these
            with _disable_current_modes():
                before = [_snapshot(holder.get(name)) for _, name, holder in watched]
            out = function(*flat, **kwargs)
            with _disable_current_modes():
                changed = {i for i, ((_, name, holder), old) in enumerate(zip(watched, before))
                           if _written(holder.get(name), *old)}
            # a module's buffers go together: BatchNorm's running mean can come out of a first forward
            # bitwise unchanged (a batch whose mean is exactly 0) while its batch count moves
            owners = {id(watched[i][0]) for i in changed if watched[i][2] is watched[i][0]._buffers}
            changed = sorted(changed | {i for i, (module, _, holder) in enumerate(watched)
                                        if holder is module._buffers and id(module) in owners})
            if state.written is None:
                state.written = tuple(watched[i] for i in changed)
            saved.extend((watched[i], before[i][2]) for i in changed)
            return out
        forwards = [(slot, slot[2].get(slot[1])) for slot, _ in saved]
        with _disable_current_modes():
            for (_, name, holder), value in saved:
                holder[name] = value if value is None else value.clone()
        try:
            return function(*flat, **kwargs)
        finally:
            for (_, name, holder), value in forwards:
                holder[name] = value
    return run


def _snapshot(value) -> tuple:
    """``(object, version, copy)`` of a state slot's value (None stays None)."""
    if value is None:
        return None, None, None
    return value, value._version, value.detach().clone()


def _written(now, tensor, version, value) -> bool:
    """Whether a state slot that held ``tensor`` (at ``version``, equal to ``value``) was written:
    assigned anew, written in place, or changed by a kernel that does not bump the version."""
    if now is None or tensor is None:
        return now is not tensor
    return now is not tensor or now._version != version or (
        not isinstance(now, FakeTensor) and not torch.equal(now, value))
