"""``remat.profile``: what each block costs under each treatment, in bytes and seconds.

How: one forward call captures the first block's inputs (hidden states, rotary tables,
mask). Then each *block class* (same module class, same parameter shapes) is run once per
treatment, alone, forward then backward, with a meter reading live bytes at the phase
boundaries: its forward peak, what it keeps for backward, its backward peak (recompute
included) and what it leaves (parameter gradients, the input gradient). The rest of the
model is measured by one more forward+backward per head mode in which every block is a
stub (``x.clone()``): embeddings, then the final norm, LM head and loss, and their backward.
:mod:`remat.planning.simulator` puts the pieces together for any plan; a 70B model is 80 copies of
one block, so it is profiled as one block plus its head.

Two meters. Without a GPU (or with ``device="fake"``) parameters and inputs are replaced by
``FakeTensor``s (no memory, no weights needed; a model on the ``meta`` device works) and a
``TorchDispatchMode`` counts every new storage once, freed through a weak reference when
it dies; times are a roofline per op: FLOPs from ``torch.utils.flop_counter``'s formulas
over the matmul rate, bytes read and written over HBM bandwidth, whichever is larger,
plus a launch cost, with the rates of the GPU named by ``gpu`` (:data:`GPUS`). On a CUDA
model, the allocator's own ``memory_allocated``/``max_memory_allocated`` are read, so
internal workspaces and the real kernels are in the numbers. Times are *effective*: CUDA
events around runs queued back to back as a step queues them (a block: three forwards in
a row, then their three backwards; the head: three stubbed steps), the first one dropped,
so launch latency overlaps the work queued before it and only a host that cannot keep up
(a ``selective`` block's Python call per op on a small model) shows, as it does in a step.
Timing a lone, synchronised run instead over-predicted ``selective`` by 22-24% on an H200;
timing the GPU alone behind a sleep and the host apart, as two pipelined clocks, missed
by 10-30% (a host run from an idle GPU read 1-2 ms more per checkpointed block than a
step shows). A last real step (``calibrate``) scales the seconds to in-step ones, and the
pinned copy rates are measured. Saved-tensor hooks (warm-up run only) record which
storages a block saves, to tell whether it keeps its input and how many bytes the offload
engine would move.

Why not profile the whole model per treatment, or use ``torch.cuda.memory._record_memory_history``?
Whole-model runs cost depth x treatments and need the real model on a real GPU; the block
decomposition is exact for sequential block stacks and costs one block.

Limits: blocks of one class are assumed to cost the same (Gemma-2's alternating
sliding-window layers share one profile); offload costs are derived, not measured: the
bytes that ``offload`` moves are the saved storages of ``keep`` (``full`` for
``full+offload``) of at least ``min_offload_bytes``, excluding parameters; optimizer state is
counted as bytes per parameter, and its step's temporaries are not modelled.

Layout: this module is the entry (:func:`profile`, the fake and CUDA paths, the
``progress=`` printer). The numbers it returns are in :mod:`remat.planning.costs`; the meters in
:mod:`remat.profiling._meters`; the fake-tensor swap and CUDA-attention stand-in in
:mod:`remat.profiling._fake`; the block and head runs in :mod:`remat.profiling._measure`; the copy rates and
the in-step calibration in :mod:`remat.profiling._calibrate`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from remat.profiling._calibrate import _calibrate, _copy_rates
from remat.profiling._fake import _cuda_attention, _swap_to_fake
from remat.profiling._measure import _profile_body
from remat.profiling._meters import _CudaMeter, _Tracker, _TrackerMeter
from remat.planning.costs import (  # noqa: F401  (re-exported: remat.profiling.profiler is where these were defined)
    CHUNK_CANDIDATES, DERIVED, GPUS, MEASURED_TREATMENTS, OPTIMIZER_BYTES_PER_PARAM, BlockCost,
    EngineModel, HeadCost, Profile, Rates, engine_model, rates_for,
)
from remat.treat.discovery import discover


def profile(model: nn.Module, batch, *, gpu: Optional[str] = None, device: Optional[str] = None,
            blocks=None, optimizer: str = "none", head_modes=("plain", "chunked"),
            chunk_candidates=CHUNK_CANDIDATES, min_offload_bytes: Optional[int] = None,
            progress=None, calibrate: bool = True) -> Profile:
    """Profile ``model`` on ``batch`` (a dict of tensors with ``input_ids``, or input ids).

    ``calibrate`` (GPU only): run one real step to scale the profiled GPU seconds to
    in-step ones (see ``_calibrate``); its ratios are in ``notes["calibration"]``.

    ``device``: ``"cuda"`` measures on the GPU (the model must be there), ``"fake"``
    estimates with fake tensors and the rates of ``gpu`` (h100, h200, a100, cpu); default:
    ``"cuda"`` when the model's parameters are on a GPU, else ``"fake"``.
    """
    if optimizer not in OPTIMIZER_BYTES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES_PER_PARAM)}, got {optimizer!r}")
    batch = _as_batch(batch)
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError(f"{type(model).__name__} has no parameters; remat profiles trainable models")
    device = device or ("cuda" if first.device.type == "cuda" else "fake")
    if device not in ("cuda", "fake"):
        raise ValueError(f"device must be 'cuda' or 'fake', got {device!r}")
    if device == "cuda":
        if first.device.type != "cuda":
            raise ValueError("device='cuda' measures on the GPU: move the model there first (model.cuda())")
        name = torch.cuda.get_device_name()
        d2h, h2d = _copy_rates(first.device)
        rates = replace(rates_for(gpu or (name if _known_gpu(name) else "h100")), measured=True, d2h_Bps=d2h,
                        h2d_Bps=h2d)
    else:
        rates = rates_for(gpu or "h100")
    if min_offload_bytes is None:
        min_offload_bytes = _default_min_offload_bytes()
    say = progress or (lambda message: None)
    structure = discover(model, blocks)
    named = structure.blocks(model)
    was_training = model.training
    model.train()
    try:
        if device == "fake":
            return _profile_fake(model, batch, named, rates, optimizer, head_modes, chunk_candidates,
                                 min_offload_bytes, say)
        return _profile_cuda(model, batch, named, rates, optimizer, head_modes, chunk_candidates,
                             min_offload_bytes, say, calibrate)
    finally:
        model.train(was_training)


def _known_gpu(name: str) -> bool:
    return any(key in name.lower() for key in GPUS)


def _default_min_offload_bytes() -> int:
    try:
        from remat.offload import engine as offload
        return int(getattr(offload, "DEFAULT_MIN_BYTES", 2**20))
    except ImportError:
        return 2**20


def _as_batch(batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch, "labels": batch}
    if isinstance(batch, dict) and "input_ids" in batch or isinstance(batch, dict) and "inputs_embeds" in batch:
        batch = dict(batch)
        batch.setdefault("labels", batch.get("input_ids"))
        return batch
    raise TypeError(f"batch must be a tensor of input ids or a dict with 'input_ids' (and 'labels'), "
                    f"got {type(batch).__name__}")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _profile_fake(model, batch, named, rates, optimizer, head_modes, chunks, min_bytes, say) -> Profile:
    from torch._subclasses.fake_tensor import FakeTensorMode
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    param_bytes = _storage_bytes(model.parameters())
    buffer_bytes = _storage_bytes(model.buffers())
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    restore = _swap_to_fake(model, fake_mode)
    try:
        with fake_mode:
            fbatch = {k: (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
                          if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            tracker = _Tracker(rates)
            with tracker, _cuda_attention(packed="position_ids" in batch):
                meter = _TrackerMeter(tracker)
                body = _profile_body(model, fbatch, named, meter, rates, head_modes, chunks, min_bytes, say)
    finally:
        restore()
    optimizer_bytes = OPTIMIZER_BYTES_PER_PARAM[optimizer] * trainable
    return _finish(model, body, batch, rates, "fake", optimizer, optimizer_bytes, param_bytes,
                   buffer_bytes, param_bytes + buffer_bytes + optimizer_bytes)


def _profile_cuda(model, batch, named, rates, optimizer, head_modes, chunks, min_bytes, say,
                  calibrate=True) -> Profile:
    device = next(model.parameters()).device
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    meter = _CudaMeter()
    body = _profile_body(model, batch, named, meter, rates, head_modes, chunks, min_bytes, say, repeats=3)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    optimizer_bytes = OPTIMIZER_BYTES_PER_PARAM[optimizer] * trainable
    static = torch.cuda.memory_allocated(device) + optimizer_bytes
    prof = _finish(model, body, batch, rates, "cuda", optimizer, optimizer_bytes,
                   _storage_bytes(model.parameters()), _storage_bytes(model.buffers()), static)
    if not calibrate:
        return prof
    try:
        return _calibrate(model, batch, named, prof, say)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # e.g. frozen embeddings: no hooks fire
        model.zero_grad(set_to_none=True)
        return replace(prof, notes=dict(prof.notes, calibration=f"skipped: {type(e).__name__}: {str(e)[:200]}"))


def _finish(model, body, batch, rates, device, optimizer, optimizer_bytes, param_bytes, buffer_bytes,
            static) -> Profile:
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    classes, block_class, heads, hidden_bytes, notes, names = body
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Profile(type(model).__name__, names, block_class, classes, heads, param_bytes, buffer_bytes,
                   optimizer, optimizer_bytes, static, hidden_bytes, int(ids.shape[0]), int(ids.shape[1]),
                   dtype, device, rates, notes, engine_model())


def progress_printer(stream=None, after_s: float = 2.0):
    """A ``progress=`` callback that prints to stderr once profiling has taken ``after_s``."""
    start = time.perf_counter()
    stream = stream or sys.stderr

    def say(message):
        if time.perf_counter() - start >= after_s:
            print(f"[remat {time.perf_counter() - start:5.1f}s] {message}", file=stream, flush=True)
    return say
