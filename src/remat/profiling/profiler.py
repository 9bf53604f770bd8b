"""``remat.profile``: what each block costs under each treatment, in bytes and seconds.

How: one forward without gradients captures each block's inputs and output shape
(:mod:`~remat.profiling._capture`). Each *block class* (same module class, parameter shapes,
attention configuration and input shape) then runs alone once per treatment, on the input its first
block really received, forward then backward, a meter reading live bytes at the phase boundaries
(:mod:`~remat.profiling._blocks`); the rest of the model is one step per head mode in which every
block is a stub (:mod:`~remat.profiling._head`). :mod:`remat.planning.simulator` assembles any plan
from those pieces: a 70B model is 80 copies of one block, profiled as one block plus its head. The
model comes back exactly as it was (:mod:`remat.profiling.snapshot`).

Two meters (:mod:`remat.profiling._meters`). Without a GPU (or ``device="fake"``) parameters and
inputs are ``FakeTensor``s (no memory, no weights; a ``meta`` model works: :mod:`~remat.profiling._fake`),
new storages are counted by a dispatch mode, and times are a roofline per op at the rates of the GPU
named by ``gpu``. On CUDA the allocator's own counters are read and times are *effective*: CUDA
events around runs queued back to back as a step queues them, scaled to in-step seconds by one real
step (``calibrate``: :mod:`~remat.profiling._calibrate`). From :data:`LONG_CONTEXT_TOKENS` tokens a
GPU model takes the fake path at the GPU's measured attention and copy rates (:func:`_profile_long`);
``compile=True`` measures compiled runs (:mod:`~remat.profiling._compiled`).

Why a block at a time, not the whole model per treatment (or the allocator's memory history): that
costs depth x treatments and needs the real model on a real GPU; blocks are exact for sequential stacks.

Limits: blocks of one class are assumed to cost the same (a configuration attribute not in
:data:`remat.profiling._capture.CONFIG_ATTRIBUTES` is not seen); offload costs are derived from the
saved storages, not measured; the optimizer's state and step are modelled
(:data:`~remat.planning.costs.OPTIMIZER_PASSES`). This module is the entry (:func:`profile`, the fake
and CUDA paths, the ``progress=`` printer); one call's settings are one frozen
:class:`~remat.profiling._request.ProfileRequest`. Timing and layout in full: docs/design/diagnosis.md.
"""
from __future__ import annotations

import inspect
import os
import sys
import time
import warnings
from dataclasses import replace
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.profiling._calibrate import _calibrate, _copy_rates
from remat.profiling._compiled import BACKEND as COMPILE_BACKEND
from remat.profiling._compiled import calibrate_compiled, compile_scope
from remat.profiling._liger import liger_stand_ins
from remat.profiling._fake import (ValuedFakeMode, _conversions_in_place, _cuda_attention,
                                  _swap_to_fake, _tensors_of_values, fake_attributes_restored, padded_mask)
from remat.profiling._measure import MissingLoss, _profile_body
from remat.profiling._meters import _CudaMeter, _Tracker, _TrackerMeter
from remat.profiling._request import ProfileRequest, _silent
from remat.profiling import reuse
from remat.planning.costs import (  # noqa: F401  (re-exported: remat.profiling.profiler is where these were defined)
    CHUNK_CANDIDATES, DERIVED, GPUS, MEASURED_TREATMENTS, OPTIMIZER_STATES, TILE_CANDIDATES, BlockCost,
    HeadCost, Profile, Rates, optimizer_state_bytes, optimizer_step_bytes, optimizer_step_seconds, optimizer_temp_bytes,
    rates_for,
)
from remat.planning.kernels import block_kernels, kernel_options
from remat.planning.offload_model import EngineModel
from remat.profiling.snapshot import preserved
from remat.treat import mask_skip, patches
from remat.treat.tiled import sampled_chunks
from remat.treat.discovery import discover
from remat.treat.kernels import kernels_installed, refuse_stock, require_liger


def profile(model: nn.Module, batch, *, loss_fn=None, gpu: Optional[str] = None, device: Optional[str] = None,
            blocks=None, optimizer: str = "none", head_modes=("plain", "chunked"),
            chunk_candidates=CHUNK_CANDIDATES, min_offload_bytes: Optional[int] = None,
            progress=None, calibrate: bool = True, compile=False, tile_candidates=TILE_CANDIDATES,
            kernels=None) -> Profile:
    """What each block of ``model`` costs under each treatment, and its head in each mode, training on ``batch``.

    The model comes back exactly as it was: remat patches (an applied plan, the chunked head) are
    taken off while profiling and put back, and parameters, gradients, buffers, training flags,
    ``requires_grad`` and the random states are restored (:mod:`remat.profiling.snapshot`).

    Args:
        model: the ``nn.Module`` to train; on a GPU it is measured there, elsewhere (the CPU, the
            ``meta`` device) profiled with fake tensors.
        batch: a tensor, a tuple/list or a dict of any keys, with the shapes of training.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, one training step's loss. Without it a dict
            batch is a Hugging Face model's, ``model(**batch).loss`` (labels default to ``input_ids``),
            and a tensor of integer ids ``model(input_ids=ids, labels=ids).loss``.
        gpu: the rates a fake profile prices ops at (h100, h200, a100, cpu; default h100; on a GPU,
            the GPU's own where it is one of those).
        device: ``"cuda"`` measures on the GPU (the model must be there), ``"fake"`` estimates with
            fake tensors at ``gpu``'s rates; default ``"cuda"`` for a model on a GPU, else ``"fake"``.
        blocks: which modules are the blocks (default: :func:`remat.treat.discovery.discover`'s).
        optimizer: the optimizer whose states and step are counted (``"none"``, ``"adamw"``, ...).
        head_modes: the head modes measured (``"plain"``, ``"chunked"``; ``"liger"`` is added with Liger's kernels).
        chunk_candidates: the chunked head's chunk sizes (none above the step's tokens).
        min_offload_bytes: the smallest saved tensor offload moves (default: the offload engine's).
        progress: ``progress(message)``, told each stage as it starts (:func:`progress_printer`).
        calibrate: on a GPU, one real step scales the profiled seconds to in-step ones
            (``notes["calibration"]`` holds its ratios).
        compile: ``True`` (or ``"model"``): the costs of the model as it runs after ``model.compile()``:
            every block class x treatment and head mode measured compiled (a compile each, tens of
            seconds on a large block; :mod:`remat.profiling._compiled`), offload left out
            (``notes["offload"]`` says why), dynamo's caches reset when done. ``"blocks"``: each block
            compiled alone and the rest eager, as FSDP2 trains compiled. ``notes["compile_scope"]`` says which.
        tile_candidates: the chunk sizes the tiled treatments are measured at besides the default
            (those below the step's tokens; tiled treatments are profiled from
            :data:`~remat.planning.costs.TILED_FROM_TOKENS` tokens a step): ``Profile.tiles``, among
            which the solver chooses per block.
        kernels: None (the blocks as they are: a model liger-kernel patched is measured with Liger's
            kernels, stood in for on fake tensors by :mod:`remat.profiling._liger`), ``"stock"``,
            ``"liger"`` or both (``("stock", "liger")``): every block class measured with each (Liger's
            fused norms, gated MLP and rotary embedding installed on its first block for those runs), the
            variants in ``Profile.kernel_variants``, and the head also in the mode ``"liger"`` where the
            model's family has it; blocks Liger cannot serve keep their modules (``notes["kernels_stock"]``).

    Returns:
        A :class:`~remat.planning.costs.Profile`: the costs per block class and head option, the
        static bytes, the rates, and ``notes`` (what was left out and why, how it was profiled).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; a batch whose loss cannot be told without ``loss_fn``.
        ValueError: an unknown ``optimizer`` or ``device``; a model without parameters; ``device="cuda"``
            for a model off the GPU; ``compile`` without a GPU (a fake profile cannot run compiled code);
            ``kernels="liger"`` without liger-kernel (``pip install remat[kernels]``) and ``"stock"`` alone
            on a model liger-kernel patched; a forward that reads tensor values a fake profile does not
            have; a model whose embeddings and head run in no head mode.

    Example:
        >>> prof = remat.profile(model, {"input_ids": ids})          # doctest: +SKIP
        >>> remat.plan(model, {"input_ids": ids}, "24GiB", profiled=prof)   # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.profile expects a torch.nn.Module as its first argument, got {type(model).__name__}; "
                        "call remat.profile(model, batch) with the model object")
    batch, loss_fn, device, request = _requested(
        model, batch, loss_fn=loss_fn, gpu=gpu, device=device, blocks=blocks, optimizer=optimizer,
        head_modes=head_modes, chunk_candidates=chunk_candidates, min_offload_bytes=min_offload_bytes,
        progress=progress, calibrate=calibrate, compile=compile, tile_candidates=tile_candidates, kernels=kernels)
    sequences, tokens = _batch_shape(batch)
    if device == "cuda" and not request.scope and sequences * tokens >= LONG_CONTEXT_TOKENS:
        return _profile_long(model, batch, loss_fn, request, blocks=blocks,
                             why=f"{sequences * tokens:,} tokens a step is long context (from {LONG_CONTEXT_TOKENS:,})")
    try:
        with preserved(model) as held, patches.suspended(model):
            named = discover(model, blocks).blocks(model)
            model.train()
            if device == "fake":
                key = reuse.key_of(model, batch, loss_fn, request, blocks)
                prof = reuse.kept(model, key, loss_fn)
                if prof is not None:
                    request.say("profile: the one a previous call measured on this model, batch and settings "
                                "(remat.caches.clear() measures again)")
                    return prof
                prof = _profile_fake(model, batch, loss_fn, named, request)
                reuse.keep(model, key, loss_fn, prof)
                return prof
            return _profile_cuda(model, batch, loss_fn, named, request, held_grad_bytes=held.held_grad_bytes)
    except torch.OutOfMemoryError as error:
        if device != "cuda" or request.scope:
            raise
        torch.cuda.empty_cache()
        return _profile_long(model, batch, loss_fn, request, blocks=blocks,
                             why=f"measuring ran out of GPU memory ({str(error)[:120]})")


def _requested(model, batch, *, loss_fn, gpu, device, blocks, optimizer, head_modes, chunk_candidates,
               min_offload_bytes, progress, calibrate, compile, tile_candidates, kernels) -> tuple:
    """``(batch, loss_fn, device, request)`` of a :func:`profile` call, its arguments checked (its errors
    but the first) and the machine's defaults resolved: the rates (on a GPU its copy rates, measured
    now), the offload engine's smallest tensor, the compile backend."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    kernels = kernel_options(kernels)
    if "liger" in kernels:
        require_liger("kernels='liger'")
        head_modes = tuple(head_modes) + (() if "liger" in head_modes else ("liger",))
    if kernels == ("stock",):
        refuse_stock(discover(model, blocks).blocks(model))
    batch, loss_fn = model_loss(batch, loss_fn)
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError(f"{type(model).__name__} has no parameters; remat profiles trainable models")
    device = device or ("cuda" if first.device.type == "cuda" else "fake")
    if device not in ("cuda", "fake"):
        raise ValueError(f"device must be 'cuda' or 'fake', got {device!r}")
    scope = compile_scope(compile)
    if scope and device == "fake":
        from remat.profiling._compiled import NEEDS_GPU
        where = "device='fake' was asked for" if first.device.type == "cuda" else f"the model is on {first.device}"
        raise ValueError(f"{NEEDS_GPU} ({where})")
    if device == "cuda":
        if first.device.type != "cuda":
            raise ValueError("device='cuda' measures on the GPU: move the model there first (model.cuda())")
        name = torch.cuda.get_device_name()
        d2h, h2d = _copy_rates(first.device)
        rates = replace(rates_for(gpu or (name if _known_gpu(name) else "h100")), measured=True, d2h_Bps=d2h,
                        h2d_Bps=h2d)
    else:
        rates = rates_for(gpu or "h100")
    request = ProfileRequest(
        rates=rates, optimizer=optimizer, head_modes=tuple(head_modes), chunk_candidates=tuple(chunk_candidates),
        tile_candidates=tuple(tile_candidates), kernels=tuple(kernels or ()), calibrate=calibrate, scope=scope,
        min_offload_bytes=_default_min_offload_bytes() if min_offload_bytes is None else min_offload_bytes,
        backend=COMPILE_BACKEND if scope else None, repeats=REPEATS if device == "cuda" else 1,
        say=progress or _silent)
    return batch, loss_fn, device, request


LONG_CONTEXT_TOKENS = 65536
"""From this many tokens a step on, a model on the GPU is profiled with fake tensors priced at
rates measured on that GPU (:func:`_profile_long`): a block measured alone there would hold a
step's inner-block memory several times over (keep, full, ... in turn) and take minutes."""


def _profile_long(model, batch, loss_fn, request, *, blocks, why: str) -> Profile:
    """A GPU model's profile with fake tensors, its attention priced at the rates this GPU reaches
    for the model's attention shapes at this length (:func:`measured_attention`) and its copies at
    their measured rates: the memory exactly as a fake profile counts it, planning in the time a
    fake profile takes, and no GPU memory used beyond one attention's inputs. ``notes["profiled"]``
    says so, with ``why``."""
    device = next(model.parameters()).device
    shapes = _attention_shapes(model)
    tokens = _batch_shape(batch)[1]
    request.say(f"profiling with fake tensors: {why}; timing attention on this GPU first")
    attention = measured_attention(device, shapes, tokens)
    request = replace(request, rates=replace(request.rates, attention=attention), repeats=1)
    with preserved(model) as held, patches.suspended(model):
        named = discover(model, blocks).blocks(model)
        model.train()
        prof = _profile_fake(model, batch, loss_fn, named, request)
        # what the step starts from is what the GPU holds now (the user's gradients set aside)
        static = torch.cuda.memory_allocated(device) - held.held_grad_bytes + prof.optimizer_bytes
    measured = ", ".join(f"head dim {d}: {f / 1e12:.0f}/{b / 1e12:.0f}" for d, f, b in attention)
    note = (f"with fake tensors on this GPU's rates: {why}; attention timed here at {min(tokens, ATTENTION_TOKENS):,} "
            f"tokens ({measured} TFLOP/s forward/backward, causal), pinned copies measured, other ops priced by "
            "the roofline; not calibrated on a real step")
    return replace(prof, device="cuda", static_bytes=static, notes=dict(prof.notes, profiled=note))


ATTENTION_TOKENS = 262144
"""The longest sequence :func:`measured_attention` times (its inputs and their gradients take a few
GiB there); flash attention's rate at a longer one is taken as this length's."""


def _attention_shapes(model) -> tuple:
    """``(heads, key_value_heads, head_dim)`` of the attention a model's configs describe (the
    text model's where a vision-language model has two); 32 heads of 128 where none says."""
    for module in model.modules():
        config = getattr(module, "config", None)
        config = getattr(config, "text_config", None) or config
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int) or heads <= 0:
            continue
        dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if isinstance(dim, int) and dim > 0 and isinstance(kv, int) and heads % kv == 0:
            return ((heads, kv, dim),)
    return ((32, 32, 128),)


def measured_attention(device, shapes, tokens: int) -> tuple:
    """``(head_dim, forward, backward)`` causal-halved FLOP/s that SDPA reaches on ``device`` for
    each ``(heads, key_value_heads, head_dim)`` of ``shapes``: one sequence of ``tokens`` tokens
    (at most :data:`ATTENTION_TOKENS`), bf16, after a warm-up at that length; flash attention's
    rate changes with the length (on an H100 at head dim 128, 621 TFLOP/s forward at 65k tokens,
    523 at 262k), so it is timed at the length planned for."""
    tokens = max(1, min(tokens, ATTENTION_TOKENS))
    rates = []
    for heads, kv, dim in shapes:
        def run(length, backward):
            # inputs that need gradients either way: SDPA picks its kernel by that (a forward of inputs
            # without them read 339 TFLOP/s where the training forward runs 620)
            q = torch.randn(1, heads, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, kv, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            if backward:
                out.backward(torch.ones_like(out))
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        run(tokens, True)  # at the length timed: a first call there stalled the host (37 TFLOP/s read at 65k)
        forward, both = run(tokens, False), run(tokens, True)
        flops = 2.0 * heads * tokens * tokens * (2 * dim) * 0.5
        rates.append((dim, flops / forward, 2.5 * flops / max(both - forward, 1e-9)))
    torch.cuda.empty_cache()
    return tuple(sorted(rates))


# Runs per timing on a GPU: a block's chain holds REPEATS + 1 forwards (memory permitting) and is
# timed ROUNDS times (remat.profiling._blocks); the stubbed head step runs REPEATS + 1 times.
# Fewer runs and one chain let the plan for one budget flip between two profiles of one model.
REPEATS = 5


def trainable_shapes(model: nn.Module) -> list:
    """``(numel, element_size)`` of each trainable parameter of ``model``, shared ones once."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return [(p.numel(), p.element_size()) for p in params]


def _known_gpu(name: str) -> bool:
    return any(key in name.lower() for key in GPUS)


def _default_min_offload_bytes() -> int:
    try:
        from remat.offload import DEFAULT_MIN_BYTES
        return int(DEFAULT_MIN_BYTES)
    except ImportError:
        return 2**20


def model_loss(batch, loss_fn=None) -> tuple:
    """``(batch, loss_fn)`` for one training step: ``loss_fn(model, batch)`` is its loss.

    Without ``loss_fn``, a dict is a Hugging Face batch (``model(**batch).loss``; ``labels``
    default to ``input_ids``) and a tensor of integer ids a causal LM's (``labels=ids``).
    """
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable loss_fn(model, batch) -> scalar loss, "
                            f"got {type(loss_fn).__name__}")
        return batch, loss_fn
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point() and not batch.is_complex():
        return {"input_ids": batch, "labels": batch}, hf_loss
    if isinstance(batch, dict):
        batch = dict(batch)
        if "input_ids" in batch:
            batch.setdefault("labels", batch["input_ids"])
        return batch, hf_loss
    raise TypeError(f"remat cannot tell how to compute a loss from a batch of type {type(batch).__name__}"
                    f"{' (' + str(batch.dtype).replace('torch.', '') + ')' if isinstance(batch, torch.Tensor) else ''}: "
                    "without loss_fn it expects a dict for a Hugging Face model (model(**batch).loss) or a "
                    "tensor of token ids; pass loss_fn=lambda model, batch: <scalar loss>, e.g. "
                    "loss_fn=lambda m, b: m(b).pow(2).mean()")


def hf_loss(model, batch):
    """The default loss of a dict batch: ``model(**batch).loss``."""
    out = model(**batch)
    loss = getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")
    if loss is None:
        raise MissingLoss(f"{type(model).__name__}(**batch) returned {type(out).__name__} without a loss "
                          f"(batch keys: {sorted(batch)}); add 'labels' to the batch or pass "
                          "loss_fn=lambda model, batch: <scalar loss>")
    return loss


def _batch_shape(batch) -> tuple:
    """(sequences, tokens per sequence) of a batch: ``input_ids``/``inputs_embeds`` where a dict
    has them, else the first tensor's first dimension, and its second for 2-d and 3-d tensors
    (tokens, or tokens x features); 1 for images and vectors."""
    if isinstance(batch, dict):
        for key in ("input_ids", "inputs_embeds"):
            if isinstance(batch.get(key), torch.Tensor) and batch[key].dim() >= 2:
                return int(batch[key].shape[0]), int(batch[key].shape[1])
    first = next((t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if first is None:
        return 1, 1
    return int(first.shape[0]), int(first.shape[1]) if first.dim() in (2, 3) else 1


def _to_fake(fake_mode, value):
    """A batch entry as the fake run sees it: integer data with its values (see
    :class:`ValuedFakeMode`), any other tensor as a fake of its shape."""
    if not isinstance(value, torch.Tensor):
        return value
    valued = fake_mode.valued(value)
    if valued is not None:
        return valued
    fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    return fake.requires_grad_(value.requires_grad) if value.is_floating_point() else fake


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _value_dependent_errors() -> tuple:
    """Fake-tensor errors of a forward that reads tensor values (``.item()``, ``nonzero``)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    return DataDependentOutputException, DynamicOutputShapeException


def _profile_fake(model, batch, loss_fn, named, request) -> Profile:
    """:func:`profile` with fake tensors (the model's parameters, buffers and batch swapped for fakes
    for the length of it) at the request's rates."""
    fake_mode = ValuedFakeMode()
    fake_mode.watch(model)
    param_bytes = _storage_bytes(model.parameters())
    buffer_bytes = _storage_bytes(model.buffers())
    padded = padded_mask(batch)  # read while the mask is still real
    restore = _swap_to_fake(model, fake_mode)
    restore_attributes = fake_attributes_restored(model)
    try:
        # Liger's Triton kernels never see a fake tensor: stand-ins of their shapes, saved bytes and costs
        with fake_mode, _tensors_of_values(fake_mode), _conversions_in_place(), liger_stand_ins():
            # the batch's integer tensors (ids, masks, image grids) keep their values: see ValuedFakeMode
            fbatch = tree_map(partial(_to_fake, fake_mode), batch)
            tracker = _Tracker(request.rates)
            with tracker, _cuda_attention(packed=isinstance(batch, dict) and "position_ids" in batch, padded=padded), \
                    sampled_chunks(tracker.repeated):  # identical fake chunks: three run, counted for all
                body = _profile_body(model, fbatch, loss_fn, named, _TrackerMeter(tracker), request)
    except _value_dependent_errors() as error:
        reader, hook = value_reader(error, model)
        if hook:
            raise ValueError(
                f"remat could not profile {type(model).__name__} with fake tensors: {reader} read a tensor's value "
                f"({str(error).strip()[:80]}: .item(), float(), bool() or an `if` on a tensor), and a fake-tensor "
                "profile has shapes, not values. Skip the read while remat plans: return from the hook first when "
                "`isinstance(tensor, torch._subclasses.FakeTensor)`, or profile on the GPU, where values are real (the "
                "model on CUDA; RematCallback and remat.Guard: profile_device='cuda', as they re-plan on fake tensors "
                "otherwise)") from error
        raise ValueError(
            f"remat could not profile {type(model).__name__} with fake tensors: its forward depends on tensor "
            f"values ({type(error).__name__}: {str(error).strip()[:200]}{', read at ' + reader if reader else ''}) "
            "that do not come from the batch's integer "
            "tensors, e.g. token routing in a transformers 4.x MoE or random layer drop, which a profile without "
            "data cannot follow. Profile on a GPU (remat.plan or remat.profile with the model and batch on CUDA), "
            "or use transformers >= 5, whose models run on fake tensors") from error
    finally:
        restore_attributes()
        restore()
    if fake_mode.reads:
        body = replace(body, notes=dict(body.notes, ran_for_real=ran_for_real(fake_mode.reads)))
    optimizer_bytes = optimizer_state_bytes(request.optimizer, trainable_shapes(model))
    return _finish(model, body, batch, request, device="fake", optimizer_bytes=optimizer_bytes,
                   param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                   static=param_bytes + buffer_bytes + optimizer_bytes)


def value_reader(error: BaseException, model: nn.Module) -> tuple:
    """``(where, hook)``: the code outside torch, transformers and remat that read a fake tensor's
    value, in words (``"the forward hook <lambda> on the model (LlamaForCausalLM; train.py:12:
    seen.append(out.loss.item()))"``, or ``"net.py:30 in forward (...)"``), and whether it is one of
    ``model``'s forward hooks; ``(None, False)`` where the read was inside those libraries."""
    import traceback
    remat_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # src/remat
    libraries = (os.path.dirname(torch.__file__) + os.sep, remat_dir + os.sep)
    transformers = sys.modules.get("transformers")
    if getattr(transformers, "__file__", None):
        libraries += (os.path.dirname(transformers.__file__) + os.sep,)
    frames = [(tb.tb_frame.f_code, summary) for tb, summary in
              zip(_tracebacks(error.__traceback__), traceback.extract_tb(error.__traceback__))]
    outside = [(code, s) for code, s in frames if not os.path.abspath(s.filename).startswith(libraries)]
    if not outside:
        return None, False
    code, where = outside[-1]
    line = f"{where.filename}:{where.lineno}" + (f": {where.line.strip()}" if where.line else "")
    for name, module in model.named_modules():
        for kind, hooks in (("forward hook", module._forward_hooks), ("forward pre-hook", module._forward_pre_hooks)):
            if any(getattr(hook, "__code__", None) is code for hook in hooks.values()):
                return f"the {kind} {code.co_name} on {name or 'the model'} ({type(module).__name__}; {line})", True
    said = f" ({where.line.strip()})" if where.line else ""
    return f"{where.filename}:{where.lineno} in {code.co_name}{said}", False


def _tracebacks(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def ran_for_real(reads: dict) -> str:
    """The profile's note on the steps a fake profile ran for real (:class:`ValuedFakeMode`'s reads)."""
    return ("steps that read tensor values ran for real, on the batch's integer tensors (token ids, masks, image "
            "grids) and what the model derived from them alone; everything else on fake tensors. Read in: "
            + "; ".join(reads))


def _profile_cuda(model, batch, loss_fn, named, request, *, held_grad_bytes: int = 0) -> Profile:
    """:func:`profile` measured on the GPU the model is on, then calibrated on one real step where the
    request asks; ``held_grad_bytes``: the user's gradients, set aside while profiling."""
    device = next(model.parameters()).device
    batch = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, batch)
    model.zero_grad(set_to_none=True)
    scope, say = request.scope, request.say
    if scope == "model":  # measured as it will run once applied and compiled: the mask skipped as in eager
        mask_skip.hold(model, [name for name, _ in named])
    body = _profile_body(model, batch, loss_fn, named, _CudaMeter(), request)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    optimizer_bytes = optimizer_state_bytes(request.optimizer, trainable_shapes(model))
    # the user's gradients, set aside while profiling, are not part of a step's static memory
    static = torch.cuda.memory_allocated(device) - held_grad_bytes + optimizer_bytes
    prof = _finish(model, body, batch, request, device="cuda", optimizer_bytes=optimizer_bytes,
                   param_bytes=_storage_bytes(model.parameters()), buffer_bytes=_storage_bytes(model.buffers()),
                   static=static)
    if not request.calibrate:
        return prof
    if prof.block_calls:  # the calibration's events are per block: a block called N times would read N calls as one
        return replace(prof, notes=dict(prof.notes, calibration="skipped: a block runs several times a step"))
    try:
        # the calibration step runs stock blocks and a stock head; Liger's fused loss takes its head ratio
        fused = tuple(h for h in prof.heads if h.mode == "liger")
        stock = replace(prof, heads=tuple(h for h in prof.heads if h.mode != "liger")) if fused else prof
        # ... its blocks with the kernels their classes were measured with (Liger's, for kernels="liger")
        with kernels_installed(named, block_kernels(prof)):
            if scope:
                return with_fused_heads(calibrate_compiled(model, batch, loss_fn, named, stock, say, request.backend,
                                                           scope), fused)
            return with_fused_heads(_calibrate(model, batch, loss_fn, named, stock, say), fused)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # the profile stands without it
        model.zero_grad(set_to_none=True)
        warnings.warn(f"remat: calibration on a real step failed ({type(e).__name__}: {str(e)[:200]}); the "
                      "profile's seconds are not scaled to in-step ones", stacklevel=3)
        return replace(prof, notes=dict(prof.notes, calibration=f"skipped: {type(e).__name__}: {str(e)[:200]}"))


def with_fused_heads(prof: Profile, fused: tuple) -> Profile:
    """``prof`` (calibrated without them) with Liger's ``fused`` head costs back, their seconds scaled by
    the calibration's head ratio (as every other head's)."""
    if not fused:
        return prof
    note = prof.notes.get("calibration")
    ratio = note.get("head", 1.0) if isinstance(note, dict) else 1.0
    return replace(prof, heads=prof.heads + tuple(replace(h, head_fwd_s=h.head_fwd_s * ratio,
                                                          head_bwd_s=h.head_bwd_s * ratio) for h in fused))


def _finish(model, body, batch, request, *, device, optimizer_bytes, param_bytes, buffer_bytes, static) -> Profile:
    """The :class:`Profile` of ``body`` (the block and head runs) with the model-wide numbers."""
    sequences, tokens = _batch_shape(batch)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    shapes = trainable_shapes(model)
    optimizer, rates = request.optimizer, request.rates
    step = optimizer_step_seconds(optimizer, optimizer_step_bytes(optimizer, shapes), rates)
    return Profile(model=type(model).__name__, block_names=body.block_names, block_class=body.block_class,
                   classes=body.classes, heads=body.heads, param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                   optimizer=optimizer, optimizer_bytes=optimizer_bytes, static_bytes=static,
                   optimizer_temp_bytes=optimizer_temp_bytes(optimizer, shapes),
                   hidden_bytes=body.hidden_bytes, batch=sequences, seq=tokens, dtype=dtype,
                   device=device, rates=rates, notes=body.notes, engine=engine_model(), optimizer_s=step,
                   block_calls=body.block_calls, tiles=body.tiles, class_kernels=body.class_kernels,
                   kernel_variants=body.kernel_variants)


def engine_model() -> EngineModel:
    """The offload engine's settings (its defaults) as the planner's :class:`EngineModel`."""
    try:
        import remat.offload as offload
    except ImportError:
        return EngineModel()
    prefetch = inspect.signature(offload.OffloadEngine).parameters["prefetch_blocks"].default
    return EngineModel(window_bytes=None, window_records=int(offload.DEFAULT_WINDOW_RECORDS),
                       issue_bytes=int(offload.ISSUE_WINDOW), prefetch_blocks=int(prefetch))


def block_param_bytes(model: nn.Module, profile: Profile) -> tuple:
    """Parameter bytes of one block of each block class in ``profile``, in class order
    (what :func:`remat.planning.sharding.shard` takes)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    first = {}
    for name, cls in zip(profile.block_names, profile.block_class):
        first.setdefault(cls, name)
    return tuple(sum(p.numel() * p.element_size() for p in modules[first[cls]].parameters())
                 for cls in range(len(profile.classes)))


def progress_printer(stream=None, after_s: float = 2.0):
    """A ``progress=`` callback that prints to stderr once profiling has taken ``after_s``."""
    start = time.perf_counter()
    stream = stream or sys.stderr

    def say(message):
        if time.perf_counter() - start >= after_s:
            print(f"[remat {time.perf_counter() - start:5.1f}s] {message}", file=stream, flush=True)
    return say
