"""The profiling runs: each block configuration alone per treatment, and a step with stubbed blocks.

How: one forward without gradients (:func:`_capture`) records, for every block, its
configuration (:func:`_signature`: class, parameter shapes, attention kind, input shape) and
the shape of its output, and keeps the inputs (args and kwargs, caches dropped) of the first
block of each configuration; it stops once every block has run. Each configuration is then
run alone per treatment (:func:`_block_run`): a fresh input that requires grad, as inside a
stack, a forward, an autograd sink that hands back a fresh output gradient, a backward, with a
meter mark at each boundary (forward peak and kept + output; kept for backward; backward
peak and gradients left). Saved-tensor hooks on the warm-up run record which storages it
saves: whether it keeps its input, and the bytes the offload engine would move. On a GPU the
seconds come from :func:`_block_seconds` instead: several forwards in a row, then their
backwards, as a step queues them. The rest of the model is one step per head mode in which
every block is a stub (:func:`_stub_run`): six marks, embeddings, head forward and backward,
and the embeddings' backward.

A stub returns a fresh tensor of its block's real output shape and dtype that depends on
its input, so the next block (a CNN stage, a UNet level) gets what it expects and gradients
reach the embeddings: ``x + zero`` where the shape is kept (one new hidden state, as
``x.clone()``), else ``(x.sum() * 0 + zero)`` expanded and materialised. ``zero`` is a 0-d
tensor that requires grad, made before the first mark, so the head is measured even when
nothing before the blocks requires grad (LoRA over frozen embeddings, a plain model fed a
plain tensor). Sub-modules inside a block whose outputs other code collects through forward
hooks (Hugging Face's router-logit recorder on MoE gates) have those hooks called with a
fresh output of the recorded shape, so the model's auxiliary loss sees one entry per layer.
Stubs are installed through :mod:`remat.treat.patches` (tag ``"profile-stub"``) and removed
after each run.

Why a block at a time: blocks of one configuration cost the same, so a deep model costs one
block per configuration plus its head, and :mod:`remat.planning.simulator` assembles any
plan from the pieces instead of running the whole model per treatment. Blocks that differ
only in configuration (Gemma-2's sliding-window and global layers, encoder and decoder) are
profiled apart.

Compiled (``backend`` given, ``remat.plan(..., compile=True)``): the same runs through the
block's compiled call and with the model compiled around the stubs; see
:mod:`remat.profiling._compiled`. Offload treatments are not derived then.

Stable times (issue 11: one budget got two plans from two profiles an hour apart, the
``selective`` block's host-side time being the unstable term): a block's seconds are the
median of every reading of ``ROUNDS`` timed chains (not of one chain), the head's the median
of ``repeats + 1`` stubbed steps, with Python's garbage collector held off while timing.

Limits: a block must take its hidden state as the first floating-point positional argument
or as ``hidden_states``, and return a tensor or a tuple that starts with it (the other
elements are None in the stub run); treatments a block cannot take (no attention
sub-module, say) are left out of its costs.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import CheckpointError

from remat.profiling._meters import _chain, _gc_paused
from remat.planning.costs import DERIVED, MEASURED_TREATMENTS, BlockCost, HeadCost, ProfileBody
from remat.treat import patches
from remat.treat.treatments import apply_treatment, remove_treatment

STUB_TAG = "profile-stub"
# attributes that make two blocks of one class with the same parameters cost differently
CONFIG_ATTRIBUTES = ("attention_type", "layer_type", "is_sliding", "sliding_window", "is_decoder",
                     "is_causal", "has_relative_attention_bias")


class MissingLoss(TypeError):
    """The step's loss cannot be computed without a ``loss_fn``: raised, never swallowed."""


def _profile_body(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats=1,
                  backend=None):
    """Every block class per treatment, then the head per mode; ``backend``: a ``torch.compile``
    backend name to measure everything compiled (see :mod:`remat.profiling._compiled`), else eager."""
    try:
        return _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say,
                             repeats, backend)
    finally:
        if backend is not None:  # the user's own compile must not meet the profile's cache entries
            import torch._dynamo
            torch._dynamo.reset()


def _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats, backend):
    started = time.perf_counter()
    capture = _capture(model, batch, loss_fn, named)
    signatures, firsts, block_class = {}, [], []
    for index in range(len(named)):
        sig = capture.signatures[index]
        if sig not in signatures:
            signatures[sig] = len(firsts)
            firsts.append(index)
        block_class.append(signatures[sig])
    params = {id(p.untyped_storage()) for p in model.parameters()}
    classes, skipped = [], {}
    for c, index in enumerate(firsts):
        block = named[index][1]
        args, kwargs = capture.inputs[index]
        costs = {}
        for treatment in MEASURED_TREATMENTS:
            say(f"profiling block class {c + 1}/{len(firsts)} ({type(block).__name__}): {treatment}"
                + ("" if backend is None else " (compiling it: tens of seconds on a large block)"))
            try:
                costs[treatment] = _block_cost(block, treatment, args, kwargs, meter, params, min_bytes, repeats,
                                               keep=costs.get("keep"), backend=backend)
            except ValueError:  # e.g. no attention sub-module to checkpoint: not available here
                continue
            except Exception as e:  # a treatment that does not compile is left out of a compiled plan, said
                if backend is None or treatment == "keep" or not _compile_failure(e):
                    raise
                skipped[f"compile:{treatment}"] = f"{type(e).__name__}: {str(e)[:300]}"
                warnings.warn(f"remat: {type(block).__name__} under {treatment!r} did not compile "
                              f"({type(e).__name__}: {str(e)[:200]}); planning without it", stacklevel=4)
        for derived, base in DERIVED.items():
            if base in costs and backend is None:  # no offload under compile: see _compiled.OFFLOAD_UNDER_COMPILE
                costs[derived] = replace(costs[base], offload_bytes=costs[base].offloadable)
        classes.append(costs)
    hidden = _hidden_of(*capture.inputs[capture.order[0]])
    heads, notes = [], {}
    if backend is not None:
        from remat.profiling._compiled import OFFLOAD_UNDER_COMPILE
        notes.update(compile=True, compile_backend=backend, offload=OFFLOAD_UNDER_COMPILE, **skipped)
    for mode in head_modes:
        if mode == "chunked":
            reason = _chunked_unavailable(model)
            if reason is not None:
                notes[mode] = reason
                continue
        options = [None] if mode == "plain" else _chunk_options(chunks, hidden)
        for chunk in options:
            say(f"profiling embeddings and head: {mode}{'' if chunk is None else f' ({chunk} tokens)'}"
                + ("" if backend is None else ", compiled"))
            try:
                heads.append(_head_cost(model, batch, loss_fn, named, capture, mode, chunk, meter, repeats, backend))
            except MissingLoss:
                raise
            except Exception as e:  # the head may refuse this model: say so, plan without it
                notes[mode] = f"{mode} head not profiled: {type(e).__name__}: {str(e)[:300]}"
                warnings.warn(f"remat: the {mode} head could not be profiled ({type(e).__name__}: "
                              f"{str(e)[:300]}); planning without it", stacklevel=4)
                break
    if not heads:
        raise ValueError(f"remat could not profile {type(model).__name__}'s embeddings and head in any mode: "
                         + "; ".join(f"{k}: {v}" for k, v in notes.items())
                         + ". Check that loss_fn(model, batch) runs a training step's loss on this batch")
    notes["profile_seconds"] = round(time.perf_counter() - started, 2)
    names = tuple(name for name, _ in named)
    return ProfileBody(classes=tuple(classes), block_class=tuple(block_class), heads=tuple(heads),
                       hidden_bytes=_nbytes(hidden), notes=notes, block_names=names)


def _compile_failure(error: BaseException) -> bool:
    """An error of dynamo or inductor (not an OOM, not the model's own error in eager code)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    import torch._dynamo.exc
    return isinstance(error, torch._dynamo.exc.TorchDynamoException) or "Inductor" in type(error).__name__


def _chunked_unavailable(model):
    """Why the chunked head cannot run on ``model`` (no LM head, a loss it cannot reproduce), or None."""
    from remat.treat.head import check_chunked_head
    try:
        check_chunked_head(model)
    except (TypeError, ValueError) as e:
        return f"chunked head not available: {str(e)[:300]}"
    return None


def _signature(block: nn.Module, hidden=None) -> tuple:
    """What makes two blocks cost the same: class, parameters, the configuration attributes of
    the block and its direct children (sliding-window or global attention ...) and the shape and
    dtype of its input."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    config = []
    for prefix, module in [("", block)] + [(f"{n}.", m) for n, m in block.named_children()]:
        for attribute in CONFIG_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if value is not None and isinstance(value, (bool, int, float, str)):
                config.append((prefix + attribute, value))
    shape = None if hidden is None else (tuple(hidden.shape), hidden.dtype)
    return (type(block), params, tuple(config), shape)


def _chunk_options(chunks, hidden) -> list:
    tokens = hidden.numel() // hidden.shape[-1]
    options = sorted({min(int(c), tokens) for c in chunks})
    return options or [tokens]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Captured(Exception):
    pass


@dataclass(frozen=True)
class _Template:
    """A block's (or sub-module's) output: the first tensor's shape, dtype and device, and the
    container it came in (None: a bare tensor; else the tuple type and its length)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    container: type = None
    length: int = 1

    @staticmethod
    def of(out) -> "_Template":
        if isinstance(out, torch.Tensor):
            return _Template(tuple(out.shape), out.dtype, out.device)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            return _Template(tuple(out[0].shape), out[0].dtype, out[0].device, type(out), len(out))
        raise TypeError(f"a block returned {type(out).__name__}; remat expects a tensor or a tuple whose first "
                        "element is the hidden state")

    def wrap(self, y):
        return y if self.container is None else self.container((y,) + (None,) * (self.length - 1))


@dataclass(frozen=True)
class _Like:
    """A tensor's shape, dtype and device (a pytree leaf, unlike a tuple)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Capture:
    """What the capture forward saw, per block index."""

    signatures: list   # per block: _signature(...)
    inputs: dict       # block index -> (args, kwargs), for the first block of each signature only
    outputs: list      # per block: _Template of its output
    replays: list      # per block: [(sub-module, its output's structure)] to replay in stubs
    order: list        # block indices in the order the forward called them


def _capture(model, batch, loss_fn, named) -> _Capture:
    """One forward without gradients, stopped once every block has run (see the module doc)."""
    n = len(named)
    signatures, outputs, replays = [None] * n, [None] * n, [None] * n
    inputs, seen, order, sub_outputs = {}, set(), [], {}
    handles = []

    def pre(index, module, args, kwargs):
        if signatures[index] is None:
            sig = _signature(module, _hidden_of(args, kwargs))
            signatures[index] = sig
            if sig not in seen:
                seen.add(sig)
                inputs[index] = _without_cache(*tree_map(
                    lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs)))
            order.append(index)

    def post(index, module, args, kwargs, out):
        if outputs[index] is None:
            outputs[index] = _Template.of(out)
            if all(o is not None for o in outputs):
                raise _Captured

    def sub_post(module, args, out):
        sub_outputs.setdefault(id(module), tree_map(
            lambda v: _Like(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v, out))

    try:
        for index, (_, block) in enumerate(named):
            handles.append(block.register_forward_pre_hook(partial(pre, index), with_kwargs=True))
            handles.append(block.register_forward_hook(partial(post, index), with_kwargs=True))
            for sub in block.modules():
                if sub is not block:
                    handles.append(sub.register_forward_hook(sub_post))
        with torch.no_grad():
            loss_fn(model, batch)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [named[i][0] for i in range(n) if outputs[i] is None]
    if missing:
        raise ValueError(f"{len(missing)} block(s) were never called in the model's forward ({missing[:3]}); "
                         "pass blocks= with the modules the forward really runs")
    for index, (_, block) in enumerate(named):
        replays[index] = [(sub, sub_outputs[id(sub)]) for sub in block.modules()
                          if sub is not block and sub._forward_hooks and id(sub) in sub_outputs]
    return _Capture(signatures=signatures, inputs=inputs, outputs=outputs, replays=replays, order=order)


def _without_cache(args, kwargs):
    """A block's captured inputs without a live KV cache: run again and again, a cache object
    would grow with every run and carry the graph of the last one (``Trying to backward through
    the graph a second time`` on any model built with ``use_cache=True``, the config default)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    if not isinstance(cache, type):
        return args, kwargs
    args = tuple(None if isinstance(v, cache) else v for v in args)
    kwargs = {k: (None if isinstance(v, cache) else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache") is True:
        kwargs["use_cache"] = False
    return args, kwargs


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


def _block_cost(block, treatment, args, kwargs, meter, params, min_bytes, repeats, keep=None,
                backend=None) -> BlockCost:
    apply_treatment(block, treatment)
    try:
        call = block
        if backend is not None:  # compiled once per class x treatment; the first call compiles, unmeasured
            from remat.profiling._compiled import check_compiled, compile_block
            call, counter = compile_block(block, backend)
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
            # as many forwards in a row as half the free memory holds, up to repeats + 1
            free, _ = torch.cuda.mem_get_info()
            count = int(max(1, min(repeats + 1, 0.5 * free // max(marks[0][1], marks[2][1], 1))))
            fwd_s, bwd_s = _block_seconds(block, args, kwargs, count, call=call, rounds=ROUNDS)
        else:
            fwd_s, bwd_s = marks[0][2], marks[2][2]
    finally:
        remove_treatment(block)
        block.zero_grad(set_to_none=True)
    (with_out, fwd_peak, _), (kept, _, _), (bwd_end, bwd_peak, _) = marks
    offloadable = sum(size for key, size in saved.items() if key not in params and size >= min_bytes)
    return BlockCost(fwd_peak=fwd_peak, kept=kept, out_alive=with_out - kept, out_bytes=out_bytes,
                     saves_input=input_saved, bwd_peak=bwd_peak, bwd_end=bwd_end, fwd_s=fwd_s, bwd_s=bwd_s,
                     offloadable=offloadable)


def _block_run(block, args, kwargs, meter, params, track=True, call=None):
    """One forward and backward of ``block`` alone (through ``call``, its compiled call, if given);
    raw marks (see the meters) and what it saved."""
    call = block if call is None else call
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
        out = call(*args, **kwargs)
    marks.append(meter.mark())                 # forward: peak, and kept + output
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
    return marks, saved, input_saved[0], out_bytes


# Timed chains per block x treatment after the warm one. One chain's median moved a host-bound
# ``selective`` block by several percent between two profiles on one H100 (two plans chosen
# for one budget, issue 11); the median over all readings of a few chains, with the garbage
# collector held off while timing, is what a steady step shows.
ROUNDS = 3


def _block_seconds(block, args, kwargs, count: int, call=None, rounds: int = 1) -> tuple:
    """Effective forward and backward seconds of ``block`` on a GPU: ``count`` forwards in a
    row, then their backwards in reverse, as a step runs them; the median of every reading
    but each chain's first, over ``rounds`` timed chains.

    A first, untimed chain makes the caching allocator hold ``count`` runs' memory (a warm step
    allocates nothing; a cold ``cudaMalloc`` costs the host ~1 ms a block, which a first-time
    chain read as a host-bound block: +12.7% on qwen-1.5b ``keep``, whose chain was the first
    of its profile, on an H200). Python's garbage collector is held off while timing (one
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
    hidden = _hidden_of(args, kwargs)
    xs = [hidden.detach().clone().requires_grad_(True) for _ in range(count)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * count + 1)]
    sinks = []
    torch.cuda.synchronize()
    events[0].record()
    for j, x in enumerate(xs):
        a, kw = _with_hidden(args, kwargs, x)
        out = call(*a, **kw)
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
    return seconds[:count], seconds[count:]


def _head_cost(model, batch, loss_fn, named, capture, mode, chunk, meter, repeats, backend=None) -> HeadCost:
    if mode == "chunked":
        from remat.treat.head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=chunk)
    try:
        with contextlib.ExitStack() as stack:
            # installed once for all runs: a compiled model would recompile for new stubs at every run
            stubs = stack.enter_context(_Stubs(named, compiled=backend is not None))
            if backend is not None:  # the model compiled as Module.compile() does; the first run compiles
                from remat.profiling._compiled import check_compiled, compiled_model
                counter = stack.enter_context(compiled_model(model, backend))
            (m,) = _chain(meter, lambda: (_stub_run(model, batch, loss_fn, capture, meter, stubs),), repeats)
            if backend is not None:
                check_compiled(counter, f"the {mode} head")
    finally:
        if mode == "chunked":
            from remat.treat.head import disable_chunked_head
            disable_chunked_head(model)
    # marks: (end, peak, seconds) per phase; phases 1 and 4 are the stubs' own work and its backward
    (pre_end, pre_peak, pre_s), _, (hf_end, hf_peak, hf_s), (hb_end, hb_peak, hb_s), _, (pb_end, pb_peak, pb_s) = m
    return HeadCost(mode=mode, chunk_tokens=chunk, pre_peak=pre_peak, pre_end=pre_end, head_fwd_peak=hf_peak,
                    head_fwd_end=hf_end, head_bwd_peak=hb_peak, head_bwd_end=hb_end, pre_bwd_peak=pb_peak,
                    pre_bwd_end=pb_end, pre_fwd_s=pre_s, head_fwd_s=hf_s, head_bwd_s=hb_s, pre_bwd_s=pb_s)


class _Stubs(contextlib.ExitStack):
    """Every block's forward replaced by a stub for the ``with`` block; ``run`` is the step it serves.

    Under a compiled model each stub is a ``torch.compiler.disable`` frame: the graph breaks
    there, the meter reads between the embeddings' and the head's compiled graphs."""

    def __init__(self, named, compiled=False):
        super().__init__()
        self.named, self.compiled, self.run = named, compiled, None

    def __enter__(self):
        super().__enter__()
        function = _stub_forward
        if self.compiled:
            from remat.profiling._compiled import eager
            function = eager(_stub_forward)
        for index, (_, block) in enumerate(self.named):
            self.enter_context(patches.temporarily(block, "forward", function, tag=STUB_TAG, state=(self, index)))
        return self


class _StubRun:
    """One stubbed step's state: the marks, and what every block's stub returns (module doc)."""

    def __init__(self, capture, meter, zero):
        self.capture, self.meter, self.zero = capture, meter, zero
        self.first, self.last = capture.order[0], capture.order[-1]
        self.marks, self.held = [], []

    def mark(self, *_):
        self.marks.append(self.meter.mark())

    def forward(self, index, args, kwargs):
        x = _hidden_of(args, kwargs)
        if index == self.first:
            self.mark()                                                   # embeddings done
            self.held.append([v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor) and v is not x])
            if x.requires_grad:
                x.register_hook(self.mark)                                # blocks' backward done
        template = self.capture.outputs[index]
        if tuple(x.shape) == template.shape and x.dtype == template.dtype:
            y = x + self.zero                                             # one new hidden state, as x.clone()
        else:
            y = (x.sum() * 0 + self.zero).to(template.dtype).expand(template.shape).contiguous()
        for sub, structure in self.capture.replays[index]:
            _replay(sub, x, structure)
        if index == self.last:
            self.mark()
            y.register_hook(self.mark)                                    # head backward done
        return template.wrap(y)


def _stub_forward(patch, *args, **kwargs):
    stubs, index = patch.state
    return stubs.run.forward(index, args, kwargs)


def _replay(sub, x, structure):
    """Call ``sub``'s forward hooks with a fresh output of the recorded structure (the block's
    stub skipped ``sub``, but whoever hooked it collects its outputs)."""
    out = tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=v.device) if isinstance(v, _Like) else v,
                   structure)
    for key, hook in list(sub._forward_hooks.items()):
        if key in sub._forward_hooks_with_kwargs:
            hook(sub, (x,), {}, out)
        else:
            hook(sub, (x,), out)


def _stub_run(model, batch, loss_fn, capture, meter, stubs):
    """A step in which every block is a stub (``stubs``, installed): measures embeddings, head and loss."""
    hidden = _hidden_of(*capture.inputs[capture.order[0]])
    zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=True)
    zero.grad = torch.zeros_like(zero)  # accumulated in place: no new storage during the step
    run = stubs.run = _StubRun(capture, meter, zero)
    try:
        model.zero_grad(set_to_none=True)
        meter.begin()
        loss = loss_fn(model, batch)
        run.mark()                                                        # head forward done
        loss.backward()
        del loss
        if len(run.marks) == 4:  # the first block's input needs no gradient: nothing before the blocks to run
            run.mark()
        run.mark()                                                        # step done
        model.zero_grad(set_to_none=True)
    finally:
        stubs.run = None
    run.held.clear()
    if len(run.marks) != 6:
        raise ValueError(f"the stubbed step ran {len(run.marks)} of its 6 phases: a block was not called, or "
                         "called more than once per step")
    return run.marks
