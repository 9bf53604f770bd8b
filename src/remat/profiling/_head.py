"""The rest of the model (embeddings, head and loss) per head mode: a step in which every block is a stub.

How (:func:`_head_cost`): every block's forward is replaced by a stub (:class:`_Stubs`, through
:mod:`remat.treat.patches`, tag ``"profile-stub"``, once for all runs of a mode and chunk) and the step
runs (:func:`_stub_run`) with six marks: embeddings, the stubs, head forward and backward, the stubs'
backward, the embeddings' backward. The ``chunked`` mode enables the chunked head (:mod:`remat.head`)
once per chunk option (:func:`_chunk_options`: none above the batch's tokens; a model it cannot serve
gets the reason from :func:`_chunked_unavailable`); the ``liger`` mode installs Liger's fused linear
cross-entropy as the loss (:func:`remat.treat.liger_head.install_liger_head`). Seconds are the median
of ``repeats + 1`` stubbed steps, the garbage collector held off (:func:`remat.profiling._meters._chain`).

A stub returns a fresh tensor of its block's real output shape and dtype that depends on its input
(``x + zero`` where the shape is kept, else ``x.sum() * 0 + zero`` expanded), so the next block (a CNN
stage, a UNet level) gets what it expects and gradients reach the embeddings; ``zero`` is a 0-d tensor
that requires grad, so the head is measured even when nothing before the blocks does (LoRA over frozen
embeddings). Forward hooks on a block's sub-modules (Hugging Face's router-logit recorder on MoE gates)
get a fresh output of the recorded shape, one entry per layer. A block called several times a step
(ALBERT: :mod:`remat.planning.calls`) is a stub at every call; under compile each stub is a
``torch.compiler.disable`` frame (:mod:`remat.profiling._compiled`).

Why stubs rather than the whole model: the blocks' costs come from their own runs
(:mod:`remat.profiling._blocks`); a step without them reads the embeddings' and the head's memory and
seconds alone, the loss computed as the user's ``loss_fn`` computes it.

Limits: the blocks must be called as the capture saw them (else a ``ValueError``); a block's tuple
output is its hidden state followed by None (but for what it handed back of its own inputs, a
transformers 4.x layer's KV cache), so a head that reads a block's other outputs does not see them.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map

from remat.profiling._capture import _hidden_of, _Like
from remat.profiling._meters import _chain
from remat.planning.costs import HeadCost
from remat.treat import patches
from remat.treat.liger_head import install_liger_head, remove_liger_head

STUB_TAG = "profile-stub"


def _chunked_unavailable(model):
    """Why the chunked head cannot run on ``model`` (no LM head, a loss it cannot reproduce), or None."""
    from remat.head import check_chunked_head
    try:
        check_chunked_head(model)
    except (TypeError, ValueError) as e:
        return f"chunked head not available: {str(e)[:300]}"
    return None


def _chunk_options(chunks, hidden) -> list:
    tokens = hidden.numel() // hidden.shape[-1]
    options = sorted({min(int(c), tokens) for c in chunks})
    return options or [tokens]


def _head_cost(model, batch, loss_fn, named, capture, *, mode, chunk, meter, repeats, backend=None) -> HeadCost:
    """The embeddings' and head's cost in ``mode`` (``chunk``: the chunked head's chunk tokens) on a step
    of stubbed blocks (:func:`_stub_run`), ``repeats`` runs after a warm one on ``meter``; ``backend``:
    the model compiled around the stubs."""
    if mode == "chunked":
        from remat.head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=chunk)
    elif mode == "liger":
        install_liger_head(model)
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
            from remat.head import disable_chunked_head
            disable_chunked_head(model)
        elif mode == "liger":
            remove_liger_head(model)
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
            from remat.treat.dynamo_cache import eager
            function = eager(_stub_forward)
        for index, (_, block) in enumerate(self.named):
            self.enter_context(patches.temporarily(block, "forward", function, tag=STUB_TAG, state=(self, index)))
        return self


class _StubRun:
    """One stubbed step's state: the marks, and what every block's stub returns (module doc)."""

    def __init__(self, capture, meter, zero):
        self.capture, self.meter, self.zero = capture, meter, zero
        self.calls = 0  # block calls so far: the marks go at the step's first and last
        self.marks, self.held = [], []

    def mark(self, *_):
        self.marks.append(self.meter.mark())

    def forward(self, index, args, kwargs):
        x = _hidden_of(args, kwargs)
        call, self.calls = self.calls, self.calls + 1
        if call == 0:
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
        if call == len(self.capture.calls) - 1:
            self.mark()
            y.register_hook(self.mark)                                    # head backward done
        return template.wrap(y, args, kwargs)


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
    if len(run.marks) != 6 or run.calls != len(capture.calls):
        raise ValueError(f"the stubbed step ran {len(run.marks)} of its 6 phases: its blocks were called "
                         f"{run.calls} times, where the capture forward called them {len(capture.calls)} times")
    return run.marks
