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
from remat.treat import patches
from remat.treat.kernels import TAG as KERNEL_TAG
from remat.treat.kernels import install_kernels, kernel_of, liger_parts, remove_kernels, selective_refused
from remat.treat.liger_head import liger_head_unavailable


_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake tensor raises where code reads its value (``.item()``, ``nonzero``)."""


class MissingLoss(TypeError):
    """The step's loss cannot be computed without a ``loss_fn``: raised, never swallowed."""


def _profile_body(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats=1,
                  backend=None, scope="model", tiles=TILE_CANDIDATES, kernels=()):
    """Every block class per treatment, then the head per mode; ``backend``: a ``torch.compile``
    backend name to measure compiled (see :mod:`remat.profiling._compiled`), else eager;
    ``scope``: with a backend, ``model`` measures the head compiled too, ``blocks`` only the blocks;
    ``tiles``: the chunk sizes the tiled treatments are measured at (those below the step's tokens);
    ``kernels``: the kernels each block class is measured with besides its own (``"liger"``: remat
    installs Liger's on its first block for those runs; the variants are the body's ``kernel_variants``)."""
    # each compiled measurement takes its graphs back out of dynamo's cache (profiling._compiled)
    return _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say,
                         repeats, backend, scope, tiles, tuple(kernels or ()))


def _profile_runs(model, batch, loss_fn, named, meter, rates, head_modes, chunks, min_bytes, say, repeats, backend,
                  scope, tiles=TILE_CANDIDATES, kernels=()):
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
    classes, tiled, skipped, class_kernels, variants, extra, stock = [], [], {}, [], [], [], {}
    for c, index in enumerate(firsts):
        block = named[index][1]
        args, kwargs = capture.inputs[index]
        label = f"block class {c + 1}/{len(firsts)} ({type(block).__name__})"
        current = kernel_of(block)   # as the model is: Liger's where liger-kernel patched it
        measured = {}
        for kernel in kernels or (current,):
            if kernel == current:
                measured[kernel] = _class_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles,
                                                say, label, rates, skipped)
                continue
            if kernel == "stock":  # liger-kernel's own patch: remat does not take it off
                skipped["kernels"] = (f"{type(block).__name__} runs Liger's kernels put there by liger-kernel "
                                      f"({', '.join(liger_parts(block)[:3])}): planned over them, no stock variant")
                continue
            kept = install_kernels(block, kernel)
            try:
                if kept:
                    stock[c] = "; ".join(kept)
                if patches.patches(block, tag=KERNEL_TAG):   # else Liger serves nothing here
                    costs = _kernel_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles, say,
                                          f"{label} with {kernel} kernels", rates, skipped, kernel)
                    if isinstance(costs, str):   # the block did not run with these kernels: left out, said
                        stock[c] = costs
                    else:
                        measured[kernel] = costs
            finally:
                remove_kernels(block)
        if not measured:  # no kernel asked could be had: the block as it is
            measured[current] = _class_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles,
                                             say, label, rates, skipped)
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
    hidden = _hidden_of(*capture.inputs[capture.order[0]])
    heads, notes = [], {}
    notes.update(skipped)
    if backend is not None:
        from remat.profiling._compiled import OFFLOAD_UNDER_COMPILE
        notes.update(compile=True, compile_scope=scope, compile_backend=backend, offload=OFFLOAD_UNDER_COMPILE)
    refused = []  # (mode, error) of each head mode that could not be profiled
    for mode in head_modes:
        if mode in ("chunked", "liger"):
            reason = _chunked_unavailable(model) if mode == "chunked" else _liger_unavailable(model)
            if reason is not None:
                notes[mode] = reason
                continue
        options = _chunk_options(chunks, hidden) if mode == "chunked" else [None]
        for chunk in options:
            say(f"profiling embeddings and head: {mode}{'' if chunk is None else f' ({chunk} tokens)'}"
                + ("" if backend is None or scope == "blocks" else ", compiled"))
            try:
                heads.append(_head_cost(model, batch, loss_fn, named, capture, mode, chunk, meter, repeats,
                                        backend if scope == "model" else None))
            except MissingLoss:
                raise
            except torch.OutOfMemoryError as e:  # more than the GPU gives planning (remat.plan: the budget)
                notes[mode] = (f"{mode} head not profiled: its step needs more GPU memory than planning may take "
                               f"here, so no plan within it can use it ({str(e).splitlines()[0][:160]})")
                _release_after_oom()
                break
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
                       block_calls=tuple(capture.calls) if repeated else (), tiles=tuple(tiled) if any(tiled) else (),
                       class_kernels=tuple(class_kernels) if set(class_kernels) != {"stock"} else (),
                       kernel_variants=tuple(variants) if kernels else ())


def _class_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles, say, label, rates, skipped,
                 kernel=None):
    """``({treatment: BlockCost}, {chunk: {treatment: BlockCost}})`` of ``block`` on its captured inputs as it
    runs now (with ``kernel``'s modules installed: a treatment that fails under them is left out, noted as
    ``<kernel>:<treatment>``); ``skipped`` collects the treatments left out and why."""
    costs = {}
    hidden = _hidden_of(args, kwargs)
    rows = hidden.numel() // hidden.shape[-1]
    # tiled: eager only (a graph break under compile), and only where a sequence is long enough to tile
    tiling = backend is None and rows >= TILED_FROM_TOKENS
    refused = selective_refused(block, kernel or "stock")
    for treatment in MEASURED_TREATMENTS:
        if treatment in TILED_TREATMENTS and not tiling:
            continue
        if treatment == "selective" and refused:
            skipped[f"{kernel or 'kernels'}:selective"] = f"selective not available for {type(block).__name__}: {refused}"
            continue
        say(f"profiling {label}: {treatment}" + ("" if backend is None else " (compiling it: tens of seconds on a "
                                                                              "large block)"))
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
            if kernel is not None and treatment != "keep" and not isinstance(e, torch.OutOfMemoryError):
                skipped[f"{kernel}:{treatment}"] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
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
                          f"({type(e).__name__}: {str(e)[:200]}); planning without it", stacklevel=5)
    sizes = {}  # the tiled treatments that ran at the default chunk, at each other size
    for size in sorted({int(s) for s in tiles if s < rows and s != DEFAULT_TILE_TOKENS}, reverse=True):
        for treatment in (t for t in MEASURED_TREATMENTS if t in TILED_TREATMENTS and t in costs):
            say(f"profiling {label}: {treatment} in chunks of {size} tokens")
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
    return ({t: replace(cost, grad_bytes=grads) for t, cost in costs.items()},
            {size: {t: replace(cost, grad_bytes=grads) for t, cost in measured.items()} for size, measured in sizes.items()})


def _kernel_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles, say, label, rates, skipped,
                  kernel):
    """:func:`_class_costs` of ``block`` running ``kernel``, or why it could not run with them (a string)."""
    try:
        costs = _class_costs(block, args, kwargs, meter, params, min_bytes, repeats, backend, tiles, say, label, rates,
                             skipped, kernel=kernel)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError) as error:
        return (f"{type(block).__name__} did not run with {kernel} kernels ({type(error).__name__}: "
                f"{str(error)[:200]}); its modules stay stock")
    if "keep" not in costs[0]:
        return f"{type(block).__name__} did not run with {kernel} kernels; its modules stay stock"
    return costs


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
    import torch._dynamo.exc
    return isinstance(error, torch._dynamo.exc.TorchDynamoException) or "Inductor" in type(error).__name__

