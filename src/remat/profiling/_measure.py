"""The profiling runs, in order: capture the blocks, each block configuration per treatment, then the head per mode.

How (:func:`_profile_body`): one forward without gradients (:mod:`remat.profiling._capture`)
records every block's configuration and output shape, and keeps the inputs of the first
block of each configuration. Each configuration is then run alone per treatment
(:mod:`remat.profiling._blocks`); the offload treatments (``DERIVED``) are not run but derived
from their base treatment's cost, moving its offloadable bytes. The tiled treatments run once more
at each other chunk size of ``tiles`` below the step's tokens (:data:`~remat.planning.costs.TILE_CANDIDATES`:
the body's ``tiles``), the other treatments once: a chunk changes only what tiling does. The rest of the model is one
step per head mode and chunk option in which every block is a stub
(:mod:`remat.profiling._head`). What comes back is a :class:`~remat.planning.costs.ProfileBody`:
the costs per configuration, which configuration each block has, the heads and, where a block runs
more than once a step, the calls in order (:mod:`remat.planning.calls`; each cost carries its
block's gradient bytes for that).

Why a block at a time: blocks of one configuration cost the same, so a deep model costs one
block per configuration plus its head, and :mod:`remat.planning.simulator` assembles any
plan from the pieces instead of running the whole model per treatment. Blocks that differ
only in configuration (Gemma-2's sliding-window and global layers, encoder and decoder) are
profiled apart.

Compiled (``backend`` given, ``remat.plan(..., compile=True)``): the same runs through the
block's compiled call and with the model compiled around the stubs (``compile="blocks"``: the
head's runs eager, as the root runs when only the blocks are compiled); see
:mod:`remat.profiling._compiled`. Offload treatments are not derived then. A treatment other
than ``keep`` that does not compile is left out (noted as ``compile:<treatment>``, and
warned); each compiled measurement takes its graphs back out of dynamo's cache when it ends
(:mod:`remat.treat.dynamo_cache`), so the user's own compile starts without them and the user's
other compiled graphs stay.

Limits: treatments a block cannot take (no attention sub-module, say) are left out of its
costs; a head mode the model refuses is noted and left out, and a model whose embeddings
and head run in no mode is a ``ValueError``; a missing loss (:class:`MissingLoss`) is raised,
never swallowed.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils.checkpoint import CheckpointError

from remat.profiling._blocks import _block_cost
from remat.profiling._capture import _capture, _hidden_of, _nbytes
from remat.profiling._head import _chunk_options, _chunked_unavailable, _head_cost
from remat.planning.costs import DERIVED, MEASURED_TREATMENTS, TILE_CANDIDATES, TILED_FROM_TOKENS, ProfileBody
from remat.planning.plans import DEFAULT_TILE_TOKENS, TILED_TREATMENTS


_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake tensor raises where code reads its value (``.item()``, ``nonzero``)."""


class MissingLoss(TypeError):
    """The step's loss cannot be computed without a ``loss_fn``: raised, never swallowed."""


def _profile_body(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats=1,
                  backend=None, scope="model", tiles=TILE_CANDIDATES):
    """Every block class per treatment, then the head per mode; ``backend``: a ``torch.compile``
    backend name to measure compiled (see :mod:`remat.profiling._compiled`), else eager;
    ``scope``: with a backend, ``model`` measures the head compiled too, ``blocks`` only the blocks;
    ``tiles``: the chunk sizes the tiled treatments are measured at (those below the step's tokens)."""
    # each compiled measurement takes its graphs back out of dynamo's cache (profiling._compiled)
    return _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say,
                         repeats, backend, scope, tiles)


def _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats, backend,
                  scope, tiles=TILE_CANDIDATES):
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
    classes, tiled, skipped = [], [], {}
    for c, index in enumerate(firsts):
        block = named[index][1]
        args, kwargs = capture.inputs[index]
        costs = {}
        hidden = _hidden_of(args, kwargs)
        rows = hidden.numel() // hidden.shape[-1]
        # tiled: eager only (a graph break under compile), and only where a sequence is long enough to tile
        tiling = backend is None and rows >= TILED_FROM_TOKENS
        for treatment in MEASURED_TREATMENTS:
            if treatment in TILED_TREATMENTS and not tiling:
                continue
            say(f"profiling block class {c + 1}/{len(firsts)} ({type(block).__name__}): {treatment}"
                + ("" if backend is None else " (compiling it: tens of seconds on a large block)"))
            try:
                costs[treatment] = _block_cost(block, treatment, args, kwargs, meter, params, min_bytes, repeats,
                                               keep=costs.get("keep"), backend=backend)
            except ValueError:  # e.g. no attention sub-module to checkpoint, or selective's in-place
                continue        # guard (fake tensors included): not available here
            except CheckpointError as e:  # a recompute that did not repeat its forward: left out, said
                if treatment == "keep":
                    raise
                skipped[treatment] = (f"{treatment} not available for {type(block).__name__}: its recompute did not "
                                      f"repeat its forward ({str(e).splitlines()[0][:200]})")
                continue
            except RuntimeError as e:
                # selective on a block that writes in place into a kept output where the guard did
                # not stop it: torch's own check stops the recompute; refused, as remat.apply
                # refuses it on real tensors
                if treatment != "selective" or "selective activation checkpoint" not in str(e):
                    raise
                skipped["selective"] = ("selective not available: the block writes in place into a kept "
                                        f"matmul output ({str(e)[:200]})")
                continue
            except Exception as e:  # a treatment that does not compile is left out of a compiled plan, said
                if backend is None or treatment == "keep" or not _compile_failure(e):
                    raise
                skipped[f"compile:{treatment}"] = f"{type(e).__name__}: {str(e)[:300]}"
                warnings.warn(f"remat: {type(block).__name__} under {treatment!r} did not compile "
                              f"({type(e).__name__}: {str(e)[:200]}); planning without it", stacklevel=4)
        sizes = {}  # the tiled treatments that ran at the default chunk, at each other size
        for size in sorted({int(s) for s in tiles if s < rows and s != DEFAULT_TILE_TOKENS}, reverse=True):
            for treatment in (t for t in MEASURED_TREATMENTS if t in TILED_TREATMENTS and t in costs):
                say(f"profiling block class {c + 1}/{len(firsts)} ({type(block).__name__}): {treatment} "
                    f"in chunks of {size} tokens")
                sizes.setdefault(size, {})[treatment] = _block_cost(
                    block, treatment, args, kwargs, meter, params, min_bytes, repeats, keep=costs.get("keep"),
                    tile_tokens=size)
        for derived, base in DERIVED.items():
            if base in costs and backend is None:  # no offload under compile: see _compiled.OFFLOAD_UNDER_COMPILE
                costs[derived] = replace(costs[base], offload_bytes=costs[base].offloadable)
                for measured in sizes.values():
                    if base in measured:
                        measured[derived] = replace(measured[base], offload_bytes=measured[base].offloadable)
        grads = _grad_bytes(block, rates.granularity)
        classes.append({t: replace(cost, grad_bytes=grads) for t, cost in costs.items()})
        tiled.append({size: {t: replace(cost, grad_bytes=grads) for t, cost in measured.items()}
                      for size, measured in sizes.items()})
    hidden = _hidden_of(*capture.inputs[capture.order[0]])
    heads, notes = [], {}
    notes.update(skipped)
    if backend is not None:
        from remat.profiling._compiled import OFFLOAD_UNDER_COMPILE
        notes.update(compile=True, compile_scope=scope, compile_backend=backend, offload=OFFLOAD_UNDER_COMPILE)
    refused = []  # (mode, error) of each head mode that could not be profiled
    for mode in head_modes:
        if mode == "chunked":
            reason = _chunked_unavailable(model)
            if reason is not None:
                notes[mode] = reason
                continue
        options = [None] if mode == "plain" else _chunk_options(chunks, hidden)
        for chunk in options:
            say(f"profiling embeddings and head: {mode}{'' if chunk is None else f' ({chunk} tokens)'}"
                + ("" if backend is None or scope == "blocks" else ", compiled"))
            try:
                heads.append(_head_cost(model, batch, loss_fn, named, capture, mode, chunk, meter, repeats,
                                        backend if scope == "model" else None))
            except MissingLoss:
                raise
            except Exception as e:  # the head may refuse this model: say so, plan without it
                notes[mode] = f"{mode} head not profiled: {type(e).__name__}: {str(e)[:300]}"
                refused.append((mode, e))
                break
    reads = [e for _, e in refused if isinstance(e, _VALUE_READS)]
    if not heads and reads:  # a value read (a hook's .item()): the fake-tensor profile names the code that read it,
        raise reads[0]       # where the message below would blame a loss_fn the caller may never have passed
    for mode, e in refused:
        warnings.warn(f"remat: the {mode} head could not be profiled ({type(e).__name__}: {str(e)[:300]}); "
                      "planning without it", stacklevel=4)
    if not heads:
        raise ValueError(f"remat could not profile {type(model).__name__}'s embeddings and head in any mode: "
                         + "; ".join(f"{k}: {v}" for k, v in notes.items() if k in head_modes)
                         + ". Check that loss_fn(model, batch) runs a training step's loss on this batch")
    notes["profile_seconds"] = round(time.perf_counter() - started, 2)
    names = tuple(name for name, _ in named)
    # a block called more than once a step (ALBERT's shared layer group): the calls, in order
    repeated = len(capture.calls) != len(named)
    return ProfileBody(classes=tuple(classes), block_class=tuple(block_class), heads=tuple(heads),
                       hidden_bytes=_nbytes(hidden), notes=notes, block_names=names,
                       block_calls=tuple(capture.calls) if repeated else (), tiles=tuple(tiled) if any(tiled) else ())


def _grad_bytes(block, granularity: int) -> int:
    """Bytes of ``block``'s trainable parameters' gradients, each rounded up as the meters round an
    allocation (a shared parameter once)."""
    grads = {id(p): p.numel() * p.element_size() for p in block.parameters() if p.requires_grad}
    return sum(-(-nbytes // granularity) * granularity for nbytes in grads.values())


def _compile_failure(error: BaseException) -> bool:
    """An error of dynamo or inductor (not an OOM, not the model's own error in eager code)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    import torch._dynamo.exc
    return isinstance(error, torch._dynamo.exc.TorchDynamoException) or "Inductor" in type(error).__name__

