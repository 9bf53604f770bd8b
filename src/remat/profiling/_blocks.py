"""Each block configuration alone per treatment: its memory marks, saved bytes and seconds (a ``BlockCost``).

How (:func:`_block_cost`): the treatment is applied to the block, which runs alone on its captured
inputs (:func:`_block_run`): a fresh input that requires grad, as inside a stack (unless the block has
no backward in the model: :mod:`remat.profiling._capture`), a forward, an autograd sink (:class:`_Sink`)
that hands back a fresh output gradient, a backward, with a meter mark at each boundary (forward peak
and kept + output; kept for backward; backward peak and gradients left). Saved-tensor hooks on the
warm-up run record which storages it saves: whether it keeps its input, and the bytes the offload
engine would move (``offloadable``: saved storages of at least ``min_offload_bytes``, parameters
excluded). On a GPU the seconds come from :func:`_block_seconds`: several forwards in a row, then their
backwards, as a step queues them. Compiled (``backend`` given), every run goes through the block's
compiled call (:mod:`remat.profiling._compiled`), compiled by a first run that is not measured.

Why chains of one block rather than one run, or the whole model: a step queues every block's forward
and then their backwards, and a block timed in that pattern reads what it costs there; memory needs
one run only. Stable times (two profiles of one model must choose one plan for one budget; a
``selective`` block's host time is the unstable term): the median of every reading of ``ROUNDS``
timed chains, the garbage collector held off.

A block with no backward (frozen parameters and an input that needs no gradient: a frozen vision
tower) runs its forward only; it saves nothing, under any treatment.

Limits: a treatment the block cannot take raises ``ValueError`` (the caller leaves it out); a
checkpointed sub-module called with one tensor several times cannot run under the tracking hooks (a
``CheckpointError``): it runs untracked, and whether it saves its input is taken from ``keep``.
Offload costs are bytes that would move, not measured copies.
"""
from __future__ import annotations

import contextlib
import statistics

import torch
from torch.utils.checkpoint import CheckpointError

from remat.profiling._capture import _hidden_of, _nbytes, _tensor_attributes_restored, _with_hidden
from remat.profiling._meters import _chain, _gc_paused
from remat.profiling._room import available_bytes
from remat.planning.costs import BlockCost
from remat.planning.offload_model import pinned_bytes
from remat.planning.records import block_record
from remat.treat.treatments import apply_treatment, remove_treatment


class _Sink(torch.autograd.Function):
    """out -> a scalar; backward hands a fresh gradient to the block, owned by autograd."""

    @staticmethod
    def forward(ctx, out):
        ctx.meta = (out.shape, out.dtype, out.device)
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return torch.ones(shape, dtype=dtype, device=device)


def _block_cost(block, treatment, args, kwargs, *, meter, params, request, keep=None, tile_tokens=None) -> BlockCost:
    """``block`` under ``treatment`` (a tiled one in chunks of ``tile_tokens``; None: the default) on
    its captured ``args`` and ``kwargs``, read on ``meter``, as ``request`` asks (its ``backend``:
    compiled; its ``repeats``: timed chains on a GPU; its ``min_offload_bytes``: what ``offloadable``
    counts, ``params`` (storage ids) never); ``keep``: the block's ``keep`` cost, where measured."""
    backend, repeats = request.backend, request.repeats
    apply_treatment(block, block_record(treatment, tile_tokens=tile_tokens))
    stack = contextlib.ExitStack()  # a compiled call's graphs leave dynamo's cache with it
    try:
        call = block
        if backend is not None:  # compiled once per class x treatment; the first call compiles, unmeasured
            from remat.profiling._compiled import check_compiled, compile_block
            call, counter = stack.enter_context(compile_block(block, backend))
            meter.zero()
            _block_run(block, args, kwargs, meter, params, track=False, call=call)
            check_compiled(counter, f"{type(block).__name__} under {treatment!r}")
        try:
            marks, saved, input_saved, out_bytes = _chain(
                meter, lambda: _block_run(block, args, kwargs, meter, params, call=call), 1)
        except CheckpointError:
            # A saved-tensor hook makes autograd hand back a new alias of each saved input, so a
            # checkpointed sub-module called with one tensor three times (nn.MultiheadAttention's
            # ``query is key is value``) recomputes another path. Untracked, it runs; what it saves
            # is then taken from ``keep`` (its sub-module checkpoint saves that input too).
            if keep is None:
                raise
            marks, saved, input_saved, out_bytes = _chain(
                meter, lambda: _block_run(block, args, kwargs, meter, params, track=False, call=call), 1)
            input_saved = keep.saves_input
        if repeats > 1:  # on a GPU: bytes from a warm run, seconds from chains
            marks = meter.finish(_block_run(block, args, kwargs, meter, params, track=False, call=call)[0])
            # as many forwards in a row as half the memory the allocator can still give holds, up to repeats + 1
            free = available_bytes(torch.cuda.current_device())
            count = int(max(1, min(repeats + 1, 0.5 * free // max(marks[0][1], marks[2][1], 1))))
            fwd_s, bwd_s = _block_seconds(block, args, kwargs, count, call=call, rounds=ROUNDS)
        else:
            fwd_s, bwd_s = marks[0][2], marks[2][2]
    finally:
        stack.close()
        remove_treatment(block)
        block.zero_grad(set_to_none=True)
    (with_out, fwd_peak, _), (kept, _, _), (bwd_end, bwd_peak, _) = marks
    moved = [size for key, size in saved.items() if key not in params and size >= request.min_offload_bytes]
    offloadable = sum(moved)
    return BlockCost(fwd_peak=fwd_peak, kept=kept, out_alive=with_out - kept, out_bytes=out_bytes,
                     saves_input=input_saved, bwd_peak=bwd_peak, bwd_end=bwd_end, fwd_s=fwd_s, bwd_s=bwd_s,
                     offloadable=offloadable, host_bytes=pinned_bytes(moved))


def _block_run(block, args, kwargs, meter, params, track=True, call=None):
    """One forward and backward of ``block`` alone (through ``call``, its compiled call, if given);
    raw marks (see the meters) and what it saved."""
    call = block if call is None else call
    forget_state = _tensor_attributes_restored(block)  # a block that keeps state must not pass it to the next run
    hidden = _hidden_of(args, kwargs)
    # requires grad unless the block has no backward in the model (a frozen tower: _capture)
    x = hidden.detach().clone().requires_grad_(hidden.requires_grad)
    args, kwargs = _with_hidden(args, kwargs, x)
    x_key = id(x.untyped_storage())
    saved = {}
    input_saved = [False]

    def pack(t):
        storage = t.untyped_storage()
        if id(storage) == x_key:
            input_saved[0] = True
        else:
            saved[id(storage)] = storage.nbytes()
        return t.detach()  # not ``t``: a saved output with its grad_fn is a cycle gc cannot see

    # Garbage of earlier runs (reference cycles: a model's outputs held by a caught exception's
    # frames) is collected before the marks, never between them, where its frees would read as this
    # block's: a collection inside LLaVA's language block took 44 KB of vision states off its bytes kept.
    with _gc_paused():
        meter.begin()
        marks = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if track else contextlib.nullcontext():
            out = call(*args, **kwargs)
        forget_state()
        marks.append(meter.mark())                 # forward: peak, and kept + output
        first = out if isinstance(out, torch.Tensor) else out[0]
        out_bytes = _nbytes(first)
        sink = _Sink.apply(first) if first.requires_grad else None  # None: no backward (a frozen block)
        if sink is None:  # what it packed (a checkpoint's inputs) dies with the output: nothing is kept
            saved.clear()
            input_saved[0] = False
        del out, first
        marks.append(meter.mark())                 # kept for backward
        if sink is not None:
            sink.backward()
        del sink
        marks.append(meter.mark())                 # backward peak, grads left
    if input_saved[0]:
        saved[x_key] = _nbytes(x)
    del x
    block.zero_grad(set_to_none=True)
    return marks, saved, input_saved[0], out_bytes


# Timed chains per block x treatment after the warm one. One chain's median moves a host-bound
# ``selective`` block by several percent between two profiles (two plans for one budget); the
# median over all readings of a few chains, with the garbage collector held off while timing,
# is what a steady step shows.
ROUNDS = 3


def _block_seconds(block, args, kwargs, count: int, call=None, rounds: int = 1) -> tuple:
    """Effective forward and backward seconds of ``block`` on a GPU: ``count`` forwards in a
    row, then their backwards in reverse, as a step runs them; the median of every reading
    but each chain's first, over ``rounds`` timed chains.

    A first, untimed chain makes the caching allocator hold ``count`` runs' memory (a warm step
    allocates nothing; a cold ``cudaMalloc`` costs the host about a millisecond a block, which a
    first-time chain reads as a host-bound block). Python's garbage collector is held off while timing (one
    collection inside a chain reads as a slow, host-bound block; the readings are medians of
    steady runs, and a step's median is too).
    """
    _block_chain(block, args, kwargs, count, call)
    fwd, bwd = [], []
    with _gc_paused():
        for _ in range(max(1, rounds)):
            f, b = _block_chain(block, args, kwargs, count, call)
            fwd += f[1:] or f
            bwd += b[1:] or b
    return statistics.median(fwd), statistics.median(bwd)


def _block_chain(block, args, kwargs, count: int, call=None) -> tuple:
    """Per-run forward and backward seconds of one chain (see :func:`_block_seconds`)."""
    call = block if call is None else call
    forget_state = _tensor_attributes_restored(block)
    hidden = _hidden_of(args, kwargs)
    xs = [hidden.detach().clone().requires_grad_(hidden.requires_grad) for _ in range(count)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * count + 1)]
    sinks = []
    torch.cuda.synchronize()
    events[0].record()
    for j, x in enumerate(xs):
        a, kw = _with_hidden(args, kwargs, x)
        out = call(*a, **kw)
        forget_state()  # every run of the chain starts from the state the block had, as in a step
        first = out if isinstance(out, torch.Tensor) else out[0]
        sinks.append(_Sink.apply(first) if first.requires_grad else None)
        del out, first
        events[j + 1].record()
    for m, j in enumerate(reversed(range(count))):
        block.zero_grad(set_to_none=True)  # each backward makes fresh gradients, as in a step
        if sinks[j] is not None:
            sinks[j].backward()
        sinks[j] = None
        events[count + m + 1].record()
    torch.cuda.synchronize()
    block.zero_grad(set_to_none=True)
    seconds = [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(2 * count)]
    return seconds[:count], seconds[count:]
