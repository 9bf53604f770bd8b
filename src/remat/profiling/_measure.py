"""The profiling runs, in order: capture the blocks, each block configuration per treatment, then the head per mode.

How (:func:`_profile_body`, every setting read from one :class:`~remat.profiling._request.ProfileRequest`):
one forward without gradients (:mod:`remat.profiling._capture`) records every block's configuration and
output shape and keeps the inputs of the first block of each configuration. Each configuration then
runs alone per treatment (:mod:`remat.profiling._blocks`); the offload treatments (``DERIVED``) are not
run but derived from their base treatment, moving its offloadable bytes; on fake tensors, where
``keep``'s run dispatched no attention kernel (a mamba layer, eager attention), the ``attn-saved``
treatments are priced as their checkpoint without the policy (``full``, ``full+tiled``), whose run they
would repeat op for op (on a GPU every one is run); the tiled treatments run once
more at each other chunk size of ``tiles`` below the step's tokens (a chunk changes only what tiling
does). The rest of the model is one step per head mode and chunk option with every block a stub
(:mod:`remat.profiling._head`). What comes back is a :class:`~remat.planning.costs.ProfileBody`: the
costs per configuration, each block's configuration, the heads and, where a block runs more than once
a step, the calls in order (:mod:`remat.planning.calls`; each cost carries its gradient bytes for that).

Why a block at a time: blocks of one configuration cost the same, so a deep model costs one block per
configuration plus its head, and :mod:`remat.planning.simulator` assembles any plan from the pieces.
Blocks that differ only in configuration (Gemma-2's sliding-window and global layers, encoder and
decoder) are profiled apart.

Compiled (``backend`` given): the same runs through the block's compiled call and with the model
compiled around the stubs (``compile="blocks"``: the head eager; :mod:`remat.profiling._compiled`).
Offload is not derived then; a treatment other than ``keep`` that does not compile is left out
(``compile:<treatment>``, warned); each compiled measurement takes its graphs back out of dynamo's
cache (:mod:`remat.treat.dynamo_cache`), so the user's own compile starts without them.

Limits: treatments a block cannot take are left out of its costs; a head mode the model refuses is
noted and left out (none at all: a ``ValueError``); a missing loss (:class:`MissingLoss`) is raised,
never swallowed. Which error leaves what out, noted or warned, and which is raised, is one function's
table (:func:`refusal`), for the treatments, the head modes and the kernels alike.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils.checkpoint import CheckpointError

from remat.profiling._blocks import _block_cost
from remat.profiling._capture import _capture, _hidden_of, _nbytes
from remat.profiling._head import _chunk_options, _chunked_unavailable, _head_cost
from remat.profiling._request import ProfileRequest
from remat.planning.costs import DERIVED, MEASURED_TREATMENTS, TILED_FROM_TOKENS, ProfileBody
from remat.planning.plans import ATTENTION_SAVED, DEFAULT_TILE_TOKENS, TILED_TREATMENTS, variant
from remat.treat import patches
from remat.treat.kernels import TAG as KERNEL_TAG
from remat.treat.kernels import install_kernels, kernel_of, liger_parts, remove_kernels, selective_refused
from remat.treat.liger_head import liger_head_unavailable
from remat.treat.selective import saves_attention


_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake tensor raises where code reads its value (``.item()``, ``nonzero``)."""


class MissingLoss(TypeError):
    """The step's loss cannot be computed without a ``loss_fn``: raised, never swallowed."""


def _profile_body(model, batch, loss_fn, named, meter, request: ProfileRequest) -> ProfileBody:
    """Every block class per treatment, then the head per mode, as ``request`` asks (its ``backend``:
    measured compiled, see :mod:`remat.profiling._compiled`; its ``kernels``: each block class also
    with those kernels, the variants in the body's ``kernel_variants``), on ``meter``."""
    started = time.perf_counter()
    capture = _capture(model, batch, loss_fn, named)
    firsts, block_class = _block_classes(capture, len(named))
    notes = {}   # treatments and heads left out, and why; then the profile's own notes
    classes = _measure_classes(model, named, capture, firsts, block_class, meter=meter, request=request,
                               skipped=notes)
    if request.backend is not None:
        from remat.profiling._compiled import OFFLOAD_UNDER_COMPILE
        notes.update(compile=True, compile_scope=request.scope, compile_backend=request.backend,
                     offload=OFFLOAD_UNDER_COMPILE)
    heads = _head_costs(model, batch, loss_fn, named, capture, meter=meter, request=request, notes=notes)
    notes["profile_seconds"] = round(time.perf_counter() - started, 2)
    # a block called more than once a step (ALBERT's shared layer group): the calls, in order
    repeated = len(capture.calls) != len(named)
    return ProfileBody(classes=classes.costs, block_class=tuple(block_class), heads=heads,
                       hidden_bytes=_nbytes(_hidden_of(*capture.inputs[capture.order[0]])), notes=notes,
                       block_names=tuple(name for name, _ in named),
                       block_calls=tuple(capture.calls) if repeated else (),
                       tiles=classes.tiles if any(classes.tiles) else (),
                       class_kernels=classes.kernels if set(classes.kernels) != {"stock"} else (),
                       kernel_variants=classes.variants if request.kernels else ())


def _block_classes(capture, blocks: int) -> tuple:
    """``(firsts, block_class)``: the first block of each configuration the capture saw (its index),
    and each block's configuration (an index into ``firsts``)."""
    signatures, firsts, block_class = {}, [], []
    for index in range(blocks):
        sig = capture.signatures[index]
        if sig not in signatures:
            signatures[sig] = len(firsts)
            firsts.append(index)
        block_class.append(signatures[sig])
    return firsts, block_class


class _Classes(NamedTuple):
    """The block classes' costs, the classes the blocks use first, then one per extra kernel variant."""

    costs: tuple
    """Per class, ``{treatment: BlockCost}``."""
    tiles: tuple
    """Per class, ``{chunk tokens: {treatment: BlockCost}}``."""
    kernels: tuple
    """Per class, the kernels it was measured with."""
    variants: tuple
    """Per class, ``{kernel: class index}``."""


def _measure_classes(model, named, capture, firsts, block_class, *, meter, request, skipped) -> _Classes:
    """Every block class (its first block, on its captured inputs) per treatment, once per kernel the
    request asks (none: as the block is); ``skipped`` collects what was left out and why."""
    params = {id(p.untyped_storage()) for p in model.parameters()}  # never offloadable
    classes, tiled, class_kernels, variants, extra, stock = [], [], [], [], [], {}
    for c, index in enumerate(firsts):
        block = named[index][1]
        label = f"block class {c + 1}/{len(firsts)} ({type(block).__name__})"
        measured = _kernel_variants(block, capture.inputs[index], meter=meter, params=params, request=request,
                                    label=label, skipped=skipped, stock=stock, cls=c)
        first, *others = measured
        classes.append(measured[first][0])
        tiled.append(measured[first][1])
        class_kernels.append(first)
        variants.append({first: c})
        for kernel in others:
            variants[c][kernel] = len(firsts) + len(extra)
            extra.append((c, kernel) + measured[kernel])
    for c, kernel, costs, sizes in extra:   # the variant classes, after the classes the blocks use
        classes.append(costs)
        tiled.append(sizes)
        class_kernels.append(kernel)
        variants.append(variants[c])
    if stock:
        skipped["kernels_stock"] = {named[i][0]: stock[cls] for i, cls in enumerate(block_class) if cls in stock}
    return _Classes(costs=tuple(classes), tiles=tuple(tiled), kernels=tuple(class_kernels), variants=tuple(variants))


def _kernel_variants(block, inputs, *, meter, params, request, label, skipped, stock, cls) -> dict:
    """``{kernel: (costs, tiles)}`` of ``block`` with each kernel the request asks, the block's own
    first where it is among them; ``stock[cls]`` says why a kernel was not had (Liger serves none of
    the block's modules, or the block did not run with them)."""
    current = kernel_of(block)   # as the model is: Liger's where liger-kernel patched it
    measure = dict(meter=meter, params=params, request=request, skipped=skipped)
    measured = {}
    for kernel in request.kernels or (current,):
        if kernel == current:
            measured[kernel] = _class_costs(block, *inputs, label=label, **measure)
            continue
        if kernel == "stock":  # liger-kernel's own patch: remat does not take it off
            skipped["kernels"] = (f"{type(block).__name__} runs Liger's kernels put there by liger-kernel "
                                  f"({', '.join(liger_parts(block)[:3])}): planned over them, no stock variant")
            continue
        kept = install_kernels(block, kernel)
        try:
            if kept:
                stock[cls] = "; ".join(kept)
            if patches.patches(block, tag=KERNEL_TAG):   # else Liger serves nothing here
                costs = _kernel_costs(block, *inputs, label=f"{label} with {kernel} kernels", kernel=kernel, **measure)
                if isinstance(costs, str):   # the block did not run with these kernels: left out, said
                    stock[cls] = costs
                else:
                    measured[kernel] = costs
        finally:
            remove_kernels(block)
    if not measured:  # no kernel asked could be had: the block as it is
        measured[current] = _class_costs(block, *inputs, label=label, **measure)
    return measured


class Refusal(NamedTuple):
    """How a treatment, a head mode or a block's kernels that could not run are left out of a profile."""

    key: Optional[str]
    """The ``notes`` key the reason goes under; None: left out without a note (a treatment the block
    cannot take: no attention sub-module, say)."""
    note: str = ""
    """The reason, as the notes (or, for kernels, ``notes["kernels_stock"]``) say it."""
    warn: bool = False
    """Also warned: a compiled treatment that did not compile, a head mode the model refused."""
    release: bool = False
    """The run ran out of GPU memory: its frames' memory is freed before the next run."""


def refusal(error: BaseException, *, block=None, treatment: Optional[str] = None, mode: Optional[str] = None,
            kernel: Optional[str] = None, backend: Optional[str] = None) -> Optional[Refusal]:
    """How ``error`` leaves out what raised it, or None where it is the caller's to raise.

    One of: ``treatment`` of ``block`` (measured with ``kernel``'s modules installed, compiled with
    ``backend``): a ValueError (it cannot take the treatment: left out silently), a ``CheckpointError``
    (a recompute that did not repeat its forward), a RuntimeError under ``kernel`` or from torch's
    selective-checkpoint check of an in-place write into a kept output, a compile failure under
    ``backend``; never for ``keep``, which every block takes. A head ``mode``: out of GPU memory
    (noted, not warned: no plan within the budget can use it) or any other error but a missing loss.
    ``block``'s ``kernel`` alone (neither given): a RuntimeError or ValueError of the block running
    with them. Never an out-of-memory error of a block, a :class:`MissingLoss`, or a ``BaseException``
    that is not an ``Exception`` (Ctrl-C)."""
    if isinstance(error, MissingLoss) or not isinstance(error, Exception):
        return None
    if mode is not None:
        if isinstance(error, torch.OutOfMemoryError):  # more than the GPU gives planning (remat.plan: the budget)
            return Refusal(mode, f"{mode} head not profiled: its step needs more GPU memory than planning may take "
                                 f"here, so no plan within it can use it ({str(error).splitlines()[0][:160]})",
                           release=True)
        return Refusal(mode, f"{mode} head not profiled: {type(error).__name__}: {str(error)[:300]}", warn=True)
    name = type(block).__name__
    if treatment is None:
        if isinstance(error, (RuntimeError, ValueError)) and not isinstance(error, torch.OutOfMemoryError):
            return Refusal(None, f"{name} did not run with {kernel} kernels ({type(error).__name__}: "
                                 f"{str(error)[:200]}); its modules stay stock")
        return None
    if isinstance(error, ValueError):  # e.g. no attention sub-module to checkpoint, or selective's in-place
        return Refusal(None)           # guard (fake tensors included): not available here
    if isinstance(error, CheckpointError):  # a recompute that did not repeat its forward: left out, said
        if treatment == "keep":
            return None
        return Refusal(treatment, f"{treatment} not available for {name}: its recompute did not repeat its "
                                  f"forward ({str(error).splitlines()[0][:200]})")
    if isinstance(error, RuntimeError):
        # selective on a block that writes in place into a kept output where the guard did not stop it:
        # torch's own check stops the recompute; refused, as remat.apply refuses it on real tensors
        if kernel is not None and treatment != "keep" and not isinstance(error, torch.OutOfMemoryError):
            return Refusal(f"{kernel}:{treatment}", f"{type(error).__name__}: {str(error)[:200]}")
        if treatment != "selective" or "selective activation checkpoint" not in str(error):
            return None
        return Refusal("selective", "selective not available: the block writes in place into a kept "
                                    f"matmul output ({str(error)[:200]})")
    # a treatment that does not compile is left out of a compiled plan, said
    if backend is None or treatment == "keep" or not _compile_failure(error):
        return None
    return Refusal(f"compile:{treatment}", f"{type(error).__name__}: {str(error)[:300]}", warn=True)


def _class_costs(block, args, kwargs, *, meter, params, request, label, skipped, kernel=None) -> tuple:
    """``({treatment: BlockCost}, {chunk: {treatment: BlockCost}})`` of ``block`` on its captured inputs as it
    runs now (with ``kernel``'s modules installed: a treatment that fails under them is left out, noted as
    ``<kernel>:<treatment>``); ``skipped`` collects the treatments left out and why (:func:`refusal`)."""
    costs = {}
    hidden = _hidden_of(args, kwargs)
    rows = hidden.numel() // hidden.shape[-1]
    backend, say = request.backend, request.say
    # tiled: eager only (a graph break under compile), and only where a sequence is long enough to tile
    tiling = backend is None and rows >= TILED_FROM_TOKENS
    refused = selective_refused(block, kernel or "stock")
    measure = dict(meter=meter, params=params, request=request)
    without_attention = False  # keep's fake run dispatched no attention kernel (a GPU's runs are not watched)
    for treatment in MEASURED_TREATMENTS:
        if treatment in TILED_TREATMENTS and not tiling:
            continue
        if treatment == "selective" and refused:
            skipped[f"{kernel or 'kernels'}:selective"] = f"selective not available for {type(block).__name__}: {refused}"
            continue
        if treatment in ATTENTION_SAVED and without_attention and variant(treatment, keeps=None) in costs:
            # no attention kernel to keep: the run would be its checkpoint's without the policy, op for op
            costs[treatment] = costs[variant(treatment, keeps=None)]
            continue
        say(f"profiling {label}: {treatment}" + ("" if backend is None else " (compiling it: tens of seconds on a "
                                                                              "large block)"))
        try:
            costs[treatment] = _block_cost(block, treatment, args, kwargs, keep=costs.get("keep"), **measure)
            if treatment == "keep":
                ran = meter.ops_run()
                without_attention = ran is not None and not any(saves_attention(op) for op in ran)
        except Exception as error:
            why = refusal(error, block=block, treatment=treatment, kernel=kernel, backend=backend)
            if why is None:
                raise
            if why.key is not None:
                skipped[why.key] = why.note
            if why.warn:
                warnings.warn(f"remat: {type(block).__name__} under {treatment!r} did not compile "
                              f"({type(error).__name__}: {str(error)[:200]}); planning without it", stacklevel=6)
    sizes = _tile_costs(block, args, kwargs, costs, rows, label=label, **measure)
    if backend is None:  # no offload under compile: see _compiled.OFFLOAD_UNDER_COMPILE
        costs = _with_derived(costs)
        sizes = {size: _with_derived(measured) for size, measured in sizes.items()}
    grads = _grad_bytes(block, request.rates.granularity)
    return ({t: replace(cost, grad_bytes=grads) for t, cost in costs.items()},
            {size: {t: replace(cost, grad_bytes=grads) for t, cost in measured.items()} for size, measured in sizes.items()})


def _tile_costs(block, args, kwargs, costs, rows, *, meter, params, request, label) -> dict:
    """``{chunk: {treatment: BlockCost}}``: the tiled treatments that ran at the default chunk (in
    ``costs``), at each other chunk size the request asks below the step's ``rows`` tokens, largest first."""
    sizes = {}
    tiled = [t for t in MEASURED_TREATMENTS if t in TILED_TREATMENTS and t in costs]
    for size in sorted({int(s) for s in request.tile_candidates if s < rows and s != DEFAULT_TILE_TOKENS},
                       reverse=True):
        for treatment in tiled:
            request.say(f"profiling {label}: {treatment} in chunks of {size} tokens")
            sizes.setdefault(size, {})[treatment] = _block_cost(
                block, treatment, args, kwargs, meter=meter, params=params, request=request, keep=costs.get("keep"),
                tile_tokens=size)
    return sizes


def _with_derived(costs: dict) -> dict:
    """``costs`` with the offload treatments derived from their base (:data:`DERIVED`): the base's cost,
    moving its offloadable bytes."""
    costs = dict(costs)
    for derived, base in DERIVED.items():
        if base in costs:
            costs[derived] = replace(costs[base], offload_bytes=costs[base].offloadable)
    return costs


def _kernel_costs(block, args, kwargs, *, kernel, **measure):
    """:func:`_class_costs` of ``block`` running ``kernel``, or why it could not run with them (a string)."""
    try:
        costs = _class_costs(block, args, kwargs, kernel=kernel, **measure)
    except Exception as error:
        why = refusal(error, block=block, kernel=kernel)
        if why is None:
            raise
        return why.note
    if "keep" not in costs[0]:
        return f"{type(block).__name__} did not run with {kernel} kernels; its modules stay stock"
    return costs


def _head_costs(model, batch, loss_fn, named, capture, *, meter, request, notes) -> tuple:
    """A :class:`HeadCost` per head mode the request asks (the chunked head per chunk option); a mode
    the model cannot run is noted in ``notes`` (:func:`refusal`) and warned, unless no mode ran and a
    fake tensor's value was read, which is raised (the fake profile names the code that read it)."""
    hidden = _hidden_of(*capture.inputs[capture.order[0]])
    backend, scope = request.backend, request.scope
    heads, refused = [], []  # refused: (mode, error) of each head mode that could not be profiled
    for mode in request.head_modes:
        if mode in ("chunked", "liger"):
            reason = _chunked_unavailable(model) if mode == "chunked" else _liger_unavailable(model)
            if reason is not None:
                notes[mode] = reason
                continue
        options = _chunk_options(request.chunk_candidates, hidden) if mode == "chunked" else [None]
        for chunk in options:
            request.say(f"profiling embeddings and head: {mode}{'' if chunk is None else f' ({chunk} tokens)'}"
                        + ("" if backend is None or scope == "blocks" else ", compiled"))
            try:
                heads.append(_head_cost(model, batch, loss_fn, named, capture, mode=mode, chunk=chunk, meter=meter,
                                        repeats=request.repeats, backend=request.head_backend))
            except Exception as error:
                why = refusal(error, mode=mode)
                if why is None:
                    raise
                notes[mode] = why.note
                if why.release:
                    _release_after_oom()
                if why.warn:
                    refused.append((mode, error))
                break
    reads = [e for _, e in refused if isinstance(e, _VALUE_READS)]
    if not heads and reads:  # a value read (a hook's .item()): the fake-tensor profile names the code that read it,
        raise reads[0]       # where the message below would blame a loss_fn the caller may never have passed
    for mode, e in refused:
        warnings.warn(f"remat: the {mode} head could not be profiled ({type(e).__name__}: {str(e)[:300]}); "
                      "planning without it", stacklevel=4)
    if not heads:
        raise ValueError(f"remat could not profile {type(model).__name__}'s embeddings and head in any mode: "
                         + "; ".join(f"{k}: {v}" for k, v in notes.items() if k in request.head_modes)
                         + ". Check that loss_fn(model, batch) runs a training step's loss on this batch")
    return tuple(heads)


def _liger_unavailable(model):
    """Why the ``liger`` head mode cannot run on ``model``, as a note, or None."""
    why = liger_head_unavailable(model)
    return None if why is None else f"liger head not available: {why}"


def _release_after_oom() -> None:
    """The memory a step stopped by an out-of-memory error held (its frames' tensors): freed now."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _grad_bytes(block, granularity: int) -> int:
    """Bytes of ``block``'s trainable parameters' gradients, each rounded up as the meters round an
    allocation (a shared parameter once)."""
    grads = {id(p): p.numel() * p.element_size() for p in block.parameters() if p.requires_grad}
    return sum(-(-nbytes // granularity) * granularity for nbytes in grads.values())


def _compile_failure(error: BaseException) -> bool:
    """An error of dynamo or inductor (not an OOM, not the model's own error in eager code)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    from torch._dynamo.exc import TorchDynamoException  # (``import torch._dynamo.exc`` here made ``torch`` local)
    return isinstance(error, TorchDynamoException) or "Inductor" in type(error).__name__

