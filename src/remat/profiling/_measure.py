"""The profiling runs: each block class alone per treatment, and a step with stubbed blocks.

How: one forward, stopped at the last new block class, captures each class's first
inputs (:func:`_capture_inputs`). Each block class is then run alone per treatment
(:func:`_block_run`): a fresh input that requires grad, as inside a stack, a forward,
an autograd sink that hands back a fresh output gradient, a backward, with a meter mark
at each boundary (forward peak and kept + output; kept for backward; backward peak and
gradients left). Saved-tensor hooks on the warm-up run record which storages it saves:
whether it keeps its input, and the bytes the offload engine would move. On a GPU the
seconds come from :func:`_block_seconds` instead: several forwards in a row, then their
backwards, as a step queues them. The rest of the model is one step per head mode in
which every block is ``x.clone()`` (:func:`_stub_run`): six marks, embeddings, head
forward and backward, and the embeddings' backward.

Why a block at a time: blocks of one class cost the same, so a deep model costs one
block plus its head, and :mod:`remat.planning.simulator` assembles any plan from the pieces
instead of running the whole model per treatment.

Limits: a block must take its hidden state as the first floating-point positional
argument or as ``hidden_states``, and return a tensor or a tuple that starts with it;
treatments a block cannot take (no attention sub-module, say) are left out of its costs.
"""
from __future__ import annotations

import contextlib
import statistics
import time
import types
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.profiling._meters import _chain
from remat.planning.costs import DERIVED, MEASURED_TREATMENTS, BlockCost, HeadCost
from remat.treat.treatments import apply_treatment, remove_treatment


def _profile_body(model, batch, named, meter, rates, head_modes, chunks, min_bytes, say, repeats=1):
    started = time.perf_counter()
    signatures, firsts, block_class = {}, [], []
    for name, block in named:
        sig = _signature(block)
        if sig not in signatures:
            signatures[sig] = len(firsts)
            firsts.append(block)
        block_class.append(signatures[sig])
    captured = _capture_inputs(model, batch, firsts)
    params = {id(p.untyped_storage()) for p in model.parameters()}
    classes, templates = [], []
    for index, block in enumerate(firsts):
        args, kwargs = captured[index]
        costs = {}
        for treatment in MEASURED_TREATMENTS:
            say(f"profiling block class {index + 1}/{len(firsts)} ({type(block).__name__}): {treatment}")
            try:
                cost, template = _block_cost(block, treatment, args, kwargs, meter, params, min_bytes, repeats)
            except ValueError:  # e.g. no attention sub-module to checkpoint: not available here
                continue
            costs[treatment] = cost
        templates.append(template)
        for derived, base in DERIVED.items():
            if base in costs:
                costs[derived] = replace(costs[base], offload_bytes=costs[base].offloadable)
        classes.append(costs)
    hidden = _hidden_of(*captured[0])
    heads, notes = [], {}
    for mode in head_modes:
        options = [None] if mode == "plain" else _chunk_options(chunks, hidden)
        for chunk in options:
            say(f"profiling embeddings and head: {mode}{'' if chunk is None else f' ({chunk} tokens)'}")
            try:
                heads.append(_head_cost(model, batch, named, [templates[c] for c in block_class], mode,
                                        chunk, meter, repeats))
            except Exception as e:  # the chunked head may refuse a model, or be absent
                notes[mode] = f"{mode} head not profiled: {type(e).__name__}: {str(e)[:300]}"
                break
    notes["profile_seconds"] = round(time.perf_counter() - started, 2)
    names = tuple(name for name, _ in named)
    return tuple(classes), tuple(block_class), tuple(heads), _nbytes(hidden), notes, names


def _signature(block: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    return (type(block), params)


def _chunk_options(chunks, hidden) -> list:
    tokens = hidden.numel() // hidden.shape[-1]
    options = sorted({min(int(c), tokens) for c in chunks})
    return options or [tokens]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Captured(Exception):
    pass


def _capture_inputs(model, batch, firsts) -> list:
    """Args and kwargs of the first call of each block in ``firsts`` (stops the forward early)."""
    found = {}
    handles = []

    def hook(index, module, args, kwargs):
        if index not in found:
            found[index] = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))
            if len(found) == len(firsts):
                raise _Captured
        return None

    for index, block in enumerate(firsts):
        handles.append(block.register_forward_pre_hook(partial(hook, index), with_kwargs=True))
    try:
        model(**batch)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if len(found) != len(firsts):
        raise ValueError(f"{len(firsts) - len(found)} block(s) were never called in the model's forward; "
                         "pass blocks= with the modules the forward really runs")
    return [found[i] for i in range(len(firsts))]


def _hidden_of(args, kwargs) -> torch.Tensor:
    for value in args:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    value = kwargs.get("hidden_states")
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError("cannot tell which block input is the hidden state: expected a floating-point "
                     "tensor as the first positional argument or a 'hidden_states' keyword")


def _with_hidden(args, kwargs, new):
    old = _hidden_of(args, kwargs)
    args = tuple(new if a is old else a for a in args)
    kwargs = {k: (new if v is old else v) for k, v in kwargs.items()}
    return args, kwargs


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


def _block_cost(block, treatment, args, kwargs, meter, params, min_bytes, repeats):
    apply_treatment(block, treatment)
    try:
        marks, saved, input_saved, out_bytes, template = _chain(
            meter, lambda: _block_run(block, args, kwargs, meter, params), 1)
        if repeats > 1:  # on a GPU: bytes from a warm run, seconds from a chain
            marks = meter.finish(_block_run(block, args, kwargs, meter, params, track=False)[0])
            # as many forwards in a row as half the free memory holds, up to repeats + 1
            free, _ = torch.cuda.mem_get_info()
            count = int(max(1, min(repeats + 1, 0.5 * free // max(marks[0][1], marks[2][1], 1))))
            fwd_s, bwd_s = _block_seconds(block, args, kwargs, count)
        else:
            fwd_s, bwd_s = marks[0][2], marks[2][2]
    finally:
        remove_treatment(block)
        block.zero_grad(set_to_none=True)
    (with_out, fwd_peak, _), (kept, _, _), (bwd_end, bwd_peak, _) = marks
    offloadable = sum(size for key, size in saved.items() if key not in params and size >= min_bytes)
    cost = BlockCost(fwd_peak, kept, with_out - kept, out_bytes, input_saved, bwd_peak, bwd_end,
                     fwd_s, bwd_s, offloadable)
    return cost, template


def _block_run(block, args, kwargs, meter, params, track=True):
    """One forward and backward of ``block`` alone; raw marks (see the meters) and what it saved."""
    hidden = _hidden_of(args, kwargs)
    # Inside a stack every block's input requires grad (it comes from the block before).
    x = hidden.detach().clone().requires_grad_(True)
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
        return t

    meter.begin()
    marks = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if track else contextlib.nullcontext():
        out = block(*args, **kwargs)
    marks.append(meter.mark())                 # forward: peak, and kept + output
    template = _template(out)
    first = out if isinstance(out, torch.Tensor) else out[0]
    out_bytes = _nbytes(first)
    sink = _Sink.apply(first)
    del out, first
    marks.append(meter.mark())                 # kept for backward
    sink.backward()
    del sink
    marks.append(meter.mark())                 # backward peak, grads left
    if input_saved[0]:
        saved[x_key] = _nbytes(x)
    del x
    block.zero_grad(set_to_none=True)
    return marks, saved, input_saved[0], out_bytes, template


def _template(out):
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, (tuple, list)):
        return (type(out), len(out))
    raise TypeError(f"a block returned {type(out).__name__}; remat expects a tensor or a tuple whose first "
                    "element is the hidden state")


def _block_seconds(block, args, kwargs, count: int) -> tuple:
    """Effective forward and backward seconds of ``block`` on a GPU: ``count`` forwards in a
    row, then their backwards in reverse, as a step runs them; medians without the first.

    The chain runs twice and the second is timed: the first makes the caching allocator
    hold ``count`` runs' memory (a warm step allocates nothing; a cold ``cudaMalloc`` costs
    the host ~1 ms a block, which a first-time chain read as a host-bound block: +12.7% on
    qwen-1.5b ``keep``, whose chain was the first of its profile, on an H200).
    """
    _block_chain(block, args, kwargs, count)
    return _block_chain(block, args, kwargs, count)


def _block_chain(block, args, kwargs, count: int) -> tuple:
    hidden = _hidden_of(args, kwargs)
    xs = [hidden.detach().clone().requires_grad_(True) for _ in range(count)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * count + 1)]
    sinks = []
    torch.cuda.synchronize()
    events[0].record()
    for j, x in enumerate(xs):
        a, kw = _with_hidden(args, kwargs, x)
        out = block(*a, **kw)
        sinks.append(_Sink.apply(out if isinstance(out, torch.Tensor) else out[0]))
        del out
        events[j + 1].record()
    for m, j in enumerate(reversed(range(count))):
        block.zero_grad(set_to_none=True)  # each backward makes fresh gradients, as in a step
        sinks[j].backward()
        sinks[j] = None
        events[count + m + 1].record()
    torch.cuda.synchronize()
    block.zero_grad(set_to_none=True)
    seconds = [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(2 * count)]
    fwd, bwd = seconds[:count], seconds[count:]
    return statistics.median(fwd[1:] or fwd), statistics.median(bwd[1:] or bwd)


def _head_cost(model, batch, named, templates, mode, chunk, meter, repeats) -> HeadCost:
    if mode == "chunked":
        from remat.treat.head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=chunk)
    try:
        (m,) = _chain(meter, lambda: (_stub_run(model, batch, named, templates, meter),), repeats)
    finally:
        if mode == "chunked":
            from remat.treat.head import disable_chunked_head
            disable_chunked_head(model)
    (pre_end, pre_peak, _), _, (hf_end, hf_peak, _), (hb_end, hb_peak, _), _, (pb_end, pb_peak, _) = m
    t = [x[2] for x in m]
    # phases 1 and 4 are the stubs' own clone and its backward
    return HeadCost(mode, chunk, pre_peak, pre_end, hf_peak, hf_end, hb_peak, hb_end, pb_peak, pb_end,
                    t[0], t[2], t[3], t[5])


def _stub_run(model, batch, named, templates, meter):
    """A step in which every block is ``x.clone()``: measures embeddings, head and loss."""
    marks, held = [], []
    last = len(named) - 1

    def stub(index, self, *args, **kwargs):
        x = _hidden_of(args, kwargs)
        if index == 0:
            marks.append(meter.mark())                                   # embeddings done
            held.append([v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor) and v is not x])
            if x.requires_grad:
                x.register_hook(lambda g: marks.append(meter.mark()) or None)   # blocks' backward done
        y = x.clone()
        if index == last:
            marks.append(meter.mark())
            if y.requires_grad:
                y.register_hook(lambda g: marks.append(meter.mark()) or None)   # head backward done
        template = templates[index]
        return y if template is None else template[0]((y,) + (None,) * (template[1] - 1))

    saved = []
    for index, (_, block) in enumerate(named):
        saved.append((block, "forward" in block.__dict__, block.__dict__.get("forward")))
        block.__dict__["forward"] = types.MethodType(partial(stub, index), block)
    try:
        model.zero_grad(set_to_none=True)
        meter.begin()
        loss = model(**batch).loss
        marks.append(meter.mark())                                       # head forward done
        loss.backward()
        del loss
        marks.append(meter.mark())                                       # step done
        model.zero_grad(set_to_none=True)
    finally:
        for block, had, previous in saved:
            if had:
                block.__dict__["forward"] = previous
            else:
                block.__dict__.pop("forward", None)
    held.clear()
    if len(marks) != 6:
        raise ValueError("the embeddings or the blocks' input do not require grad (frozen embeddings?); "
                         f"the head profile expected 6 phase marks, got {len(marks)}")
    return marks
