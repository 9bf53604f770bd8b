"""Skipping a tiled sub-module in a checkpoint's recompute where nothing saved reads its output.

Under ``full+tiled`` the block's checkpoint recomputes its forward in backward, tiled
sub-modules included. But a tiled sub-module's own backward recomputes its chunks from its
input, so inside the recompute its forward only serves what the recompute saves after it.
Where nothing after it saves a tensor (Llama's MLP: only the residual add follows, which saves
nothing), its output is never read, so the recompute saves its input and hands on zeros instead
of running it: the MLP's forward then runs twice a step under ``full+tiled`` (forward, and per
chunk in its backward), not three times.

How: :class:`CheckpointedCall` wraps the block's function as ``checkpoint`` calls it. In the
forward, each tiled call notes itself (its autograd node's sequence number, shapes, dtype);
after it, :func:`_mark_unread` walks the forward's own graph back from the block's outputs:
a call is unread where no node created after it saves a tensor (a post-MLP norm, Gemma-2's,
saves the MLP's output: that MLP is run). In the recompute, :meth:`CheckpointedCall.stand_in`
gives zeros for an unread call of the same shape. Calls recording outputs for the model (MoE
router logits) are always run. Eager only: compiled, the graph decides what is recomputed.
"""
from __future__ import annotations

import contextvars
from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from remat import caches

CURRENT_CALL = contextvars.ContextVar("remat_checkpointed_call", default=None)
"""The :class:`CheckpointedCall` running now (forward or recompute), or None."""


class CheckpointedCall:
    """A checkpointed block's function as ``checkpoint`` calls it, first in the forward, then in
    each recompute: the tiled sub-modules that run inside it learn in the forward which of their
    outputs the recompute never reads (see the module doc), and skip those in the recompute."""

    def __init__(self, function):
        self.function = function
        self.forwarded = False
        self.calls = []      # the forward's tiled calls in order: _TiledCall
        self.position = 0    # the recompute's tiled calls so far

    def __call__(self, *args):
        token = CURRENT_CALL.set(self)
        try:
            if self.forwarded:
                self.position = 0
                return self.function(*args)
            out = self.function(*args)
            self.forwarded = True
            _mark_unread(self.calls, out)
            return out
        finally:
            CURRENT_CALL.reset(token)

    def note(self, node, hidden: torch.Tensor, out: torch.Tensor, records: bool) -> None:
        """The forward ran a tiled call (``node``: its autograd node)."""
        self.calls.append(_TiledCall(node._sequence_nr(), tuple(hidden.shape), tuple(out.shape), out.dtype,
                                     records))

    def stand_in(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """In the recompute: zeros in place of the next tiled call's output where the forward found it
        unread, else None (run it). A recompute that calls other shapes than the forward runs all."""
        position, self.position = self.position, self.position + 1
        if position >= len(self.calls):
            return None
        call = self.calls[position]
        if not call.unread or call.hidden_shape != tuple(hidden.shape):
            return None
        with _disable_current_modes():  # not an op of the checkpoint's (torch >= 2.13 refuses ops its forward did not run)
            return hidden.new_zeros(call.out_shape, dtype=call.out_dtype)


class _TiledCall:
    __slots__ = ("sequence", "hidden_shape", "out_shape", "out_dtype", "records", "unread")

    def __init__(self, sequence, hidden_shape, out_shape, out_dtype, records):
        self.sequence, self.hidden_shape, self.out_shape = sequence, hidden_shape, out_shape
        self.out_dtype, self.records, self.unread = out_dtype, records, False


def _mark_unread(calls: list, outputs) -> None:
    """Mark the tiled calls whose output nothing saved reads: walking back from the block's outputs,
    no node created after the call (autograd numbers nodes in creation order) saves a tensor."""
    if not calls:
        return
    first = min(call.sequence for call in calls)
    stack = [t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, latest = set(), -1  # latest: the newest node that saves a tensor
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < first:
            continue  # a leaf, or made before the block's first tiled call
        if _saves_tensors(node):
            latest = max(latest, node._sequence_nr())
        stack.extend(next_node for next_node, _ in node.next_functions)
    for call in calls:
        call.unread = not call.records and latest <= call.sequence


_SAVES = caches.register({}, "treat.tile_skip._SAVES")  # built-in node class -> whether it saves tensors


def _saves_tensors(node) -> bool:
    """Whether an autograd node keeps tensors for its backward. A Python function's node is taken to
    (its ``ctx`` may hold tensors outside ``save_for_backward``); a built-in node's class says it
    with ``_raw_saved_*`` attributes (read by name, never unpacked: that would run the recompute)."""
    kind = type(node)
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return True
    if kind not in _SAVES:
        _SAVES[kind] = any(name.startswith("_raw_saved_") for name in dir(node))
    return _SAVES[kind]

