"""The tiled autograd function: a token-wise sub-module run over the sequence a chunk of rows at a time.

:class:`_TiledFunction` (eager):

- forward: runs the sub-module on each chunk under ``no_grad`` into one output tensor and saves
  only its input;
- backward: recomputes each chunk with grad and asks autograd for the chunk's input gradient and
  its parameters' gradients (``torch.autograd.grad``), accumulating the weight gradients in fp32
  where a parameter is fp16 or bf16 (in its own dtype otherwise: fp64 stays fp64), and returns them
  as the function's own input gradients.

The parameter gradients go back through the outer graph, so autograd's ``AccumulateGrad`` runs
once per parameter per step, as without tiling: DDP's and FSDP2's gradient hooks, LoRA's frozen
weights (no gradient is computed for them) and gradient accumulation behave as usual. The
obvious alternative (DeepSpeed's TiledMLP, Unsloth) calls ``backward`` per chunk inside the
backward, which accumulates into ``.grad`` once per chunk in the parameter's dtype and fires
DDP's hooks once per chunk. Dropout is replayed exactly (:mod:`remat.treat.tile_replay`), hooked
records are joined (:mod:`remat.treat.tile_records`), an unread call in a recompute is skipped
(:mod:`remat.treat.tile_skip`).

Fake-tensor profiles: under :func:`sampled_chunks` the function runs its first chunk, one middle
chunk counted for all the middle ones, and its last: the same peaks and roofline seconds for a
fraction of the dispatched ops (a 131,072-token block in 2,048-token chunks runs 3 of its 64).

Compiled (:func:`compiled_chunks`): each chunk runs under a non-reentrant ``checkpoint``, which
dynamo turns into a checkpoint region of the graph, so the forward saves only the input. Dropout
then draws chunk by chunk, and the chunks' weight gradients are summed as the compiled graph sums
them; a sub-module with hooked records runs the eager function, a graph break.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from remat.treat.segments import autocast_as, autocast_state
from remat.treat.tile_records import Recorded
from remat.treat.tile_replay import Replay
from remat.treat.tile_skip import CURRENT_CALL

_SAMPLED = contextvars.ContextVar("remat_sampled_chunks", default=None)


@contextlib.contextmanager
def sampled_chunks(repeated):
    """Tiled calls inside run three chunks, the middle one under ``repeated(times)`` (a context
    manager under which each op counts ``times`` times), for fake-tensor profiles only: the
    chunks left out produce no values."""
    token = _SAMPLED.set(repeated)
    try:
        yield
    finally:
        _SAMPLED.reset(token)


def chunk_runs(rows: int, tokens: int, repeated) -> list:
    """``[(start, context)]``: every chunk, each counted once; with ``repeated`` (a fake profile) and
    more than three chunks, the first, the second counted for all the middle ones, and the last."""
    starts = list(range(0, rows, tokens))
    if repeated is None or len(starts) <= 3:
        return [(start, contextlib.nullcontext()) for start in starts]
    return [(starts[0], contextlib.nullcontext()), (starts[1], repeated(len(starts) - 2)),
            (starts[-1], contextlib.nullcontext())]


class _TiledFunction(torch.autograd.Function):
    """``run`` over chunks of ``tokens`` rows: saves only the input, recomputes per chunk in backward.
    Returns the output and the recorded outputs (:class:`~remat.treat.tile_records.Recorded`), concatenated over chunks;
    in a recompute that never reads the output, zeros (:class:`~remat.treat.tile_skip.CheckpointedCall`)."""

    @staticmethod
    def forward(ctx, run, tokens, recorded, hidden, *params):
        call = CURRENT_CALL.get()
        stand_in = call.stand_in(hidden) if call is not None and call.forwarded else None
        if stand_in is not None:
            ctx.save_for_backward(hidden)  # what the recompute is for; the output is not read
            return (stand_in,)
        rows = hidden.reshape(1, -1, hidden.shape[-1])
        ctx.run, ctx.tokens, ctx.params, ctx.recorded = run, tokens, params, recorded
        ctx.autocast = autocast_state(hidden.device.type)
        ctx.replay = Replay(rows.shape[1])
        ctx.save_for_backward(hidden)
        out = None
        ctx.repeated = None if recorded.hooked else _SAMPLED.get()  # records need every chunk's rows
        for start, counted in chunk_runs(rows.shape[1], tokens, ctx.repeated):
            with counted:
                with ctx.replay.chunk(start, min(start + tokens, rows.shape[1])):
                    piece = recorded.run(run, rows[:, start:start + tokens], first=start == 0)
                if out is None:  # made in the output's own shape: a view would refuse in-place
                    # writes after the function (Falcon adds the attention output into its MLP's)
                    out = piece.new_empty(*hidden.shape[:-1], *piece.shape[2:])
                out.view(1, rows.shape[1], *piece.shape[2:])[:, start:start + tokens] = piece
                del piece
        if call is not None and not call.forwarded:
            call.note(ctx, hidden, out, records=bool(recorded.hooked))
        return (out, *recorded.concatenated())

    @staticmethod
    def backward(ctx, grad, *record_grads):
        hidden, = ctx.saved_tensors
        rows = hidden.detach().reshape(1, -1, hidden.shape[-1])
        grad_rows = grad.reshape(1, rows.shape[1], -1)
        wants_input = ctx.needs_input_grad[3]
        params = [p for p, wanted in zip(ctx.params, ctx.needs_input_grad[4:]) if wanted]
        # fp16/bf16 weights sum their chunks' gradients in fp32; fp32 and fp64 in their own dtype
        sums = [torch.zeros_like(p, dtype=torch.float32) if p.dtype in (torch.float16, torch.bfloat16) else None
                for p in params]
        grads = [None] * len(params)
        grad_input = torch.empty_like(rows) if wants_input else None
        offsets = [0] * len(record_grads)  # the recorded outputs' rows consumed so far
        with torch.enable_grad(), autocast_as(ctx.autocast):
            for start, counted in chunk_runs(rows.shape[1], ctx.tokens, ctx.repeated):
                with counted:  # a fake profile's middle chunk counts for all the middle ones
                    end = min(start + ctx.tokens, rows.shape[1])
                    piece = rows[:, start:end].detach().requires_grad_(wants_input)
                    found, handles = ctx.recorded.capture()
                    try:
                        with ctx.replay.chunk(start, end):
                            outputs = [ctx.run(piece)]
                    finally:
                        for handle in handles:
                            handle.remove()
                    grad_outputs = [grad_rows[:, start:end]]
                    for index, (record, g) in enumerate(zip(found, record_grads)):
                        if g is not None:
                            outputs.append(record)
                            grad_outputs.append(g[offsets[index]:offsets[index] + record.shape[0]])
                        offsets[index] += record.shape[0]
                    inputs = ([piece] if wants_input else []) + params
                    found = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
                    if wants_input:
                        grad_input[:, start:end] = found[0]
                        found = found[1:]
                    for index, g in enumerate(found):
                        if g is None:
                            continue
                        if sums[index] is not None:
                            sums[index].add_(g)
                        elif grads[index] is None:
                            grads[index] = g
                        else:
                            grads[index].add_(g)
                    del outputs, found, piece
        grads = [s.to(p.dtype) if s is not None else g for s, g, p in zip(sums, grads, params)]
        wanted = iter(grads)
        param_grads = [next(wanted) if flag else None for flag in ctx.needs_input_grad[4:]]
        ctx.replay = ctx.recorded = None
        return (None, None, None, grad_input.view_as(hidden) if wants_input else None, *param_grads)


@torch.compiler.disable  # a dispatch mode, hooks and torch.autograd.grad in backward: eager only
def eager_chunks(module: nn.Module, run, tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """The eager chunk loop (:class:`_TiledFunction`): also the compiled path of a sub-module whose
    outputs the model records through hooks (MoE router logits), a graph break there."""
    params = [p for p in module.parameters() if p.requires_grad]
    recorded = Recorded(module)
    out, *records = _TiledFunction.apply(run, tokens, recorded, hidden, *params)
    recorded.hand_back(records)
    return out


def compiled_chunks(run, tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """The chunk loop as dynamo traces it: each chunk of ``tokens`` rows under a non-reentrant
    ``checkpoint`` (a checkpoint region of the graph: its intermediates are recomputed in
    backward, chunk by chunk, and only the input's rows are saved), the chunks' outputs
    concatenated. No Python state is read or written: the sizes are the graph's, the loop unrolls."""
    rows = hidden.reshape(1, -1, hidden.shape[-1])
    pieces = [checkpoint(run, rows[:, start:start + tokens], use_reentrant=False)
              for start in range(0, rows.shape[1], tokens)]
    out = torch.cat(pieces, dim=1)
    return out.view(*hidden.shape[:-1], *out.shape[2:])
