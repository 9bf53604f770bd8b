"""``remat.profile``: what each block costs under each treatment, in bytes and seconds.

How: one forward call captures the first block's inputs (hidden states, rotary tables,
mask). Then each *block class* (same module class, same parameter shapes) is run once per
treatment, alone, forward then backward, with a meter reading live bytes at the phase
boundaries: its forward peak, what it keeps for backward, its backward peak (recompute
included) and what it leaves (parameter gradients, the input gradient). The rest of the
model is measured by one more forward+backward per head mode in which every block is a
stub (``x.clone()``): embeddings, then the final norm, LM head and loss, and their backward.
:mod:`remat.simulator` puts the pieces together for any plan; a 70B model is 80 copies of
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
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
import types
import weakref
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .discovery import discover
from .treatments import apply_treatment, remove_treatment

MEASURED_TREATMENTS = ("keep", "full", "selective", "attention", "mlp")
DERIVED = {"offload": "keep", "full+offload": "full"}
OPTIMIZER_BYTES_PER_PARAM = {"none": 0, "adamw": 8, "adamw8bit": 2}
CHUNK_CANDIDATES = (1024, 2048, 4096, 8192)

# Rates per GPU: large bf16 matmul (TFLOP/s as measured, not the datasheet), fp32 matmul,
# HBM GB/s, pinned host copies GB/s. H100: DESIGN.md anchors (791 TF/s, 55/48/86 GB/s); H200 copies
# as measured by the offload bench (55/55/101 GB/s). A GPU profile measures its own copy rates.
GPUS = {
    "h100": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=3350.0, d2h_GBps=55.0, h2d_GBps=48.0,
                 duplex_GBps=86.0),
    "h200": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=4800.0, d2h_GBps=55.0, h2d_GBps=55.0,
                 duplex_GBps=101.0),
    "a100": dict(bf16_tflops=280.0, fp32_tflops=18.0, hbm_GBps=2039.0, d2h_GBps=25.0, h2d_GBps=24.0,
                 duplex_GBps=40.0),
    "cpu": dict(bf16_tflops=1.0, fp32_tflops=1.0, hbm_GBps=20.0, d2h_GBps=20.0, h2d_GBps=20.0,
                duplex_GBps=20.0),
}
# Roofline efficiencies and launch cost, calibrated once against the H100 anchors
# (eager 0.355 s, full checkpointing 0.434 s on the bench model).
MATMUL_EFFICIENCY = 0.9
ATTENTION_EFFICIENCY = 0.45
HBM_EFFICIENCY = 0.75
LAUNCH_S = 4e-6
_ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


@dataclass(frozen=True)
class Rates:
    """Device rates the time model uses (bytes/s, FLOP/s); ``measured`` when timed on a GPU."""

    name: str
    matmul_flops: float
    fp32_flops: float
    hbm_Bps: float
    d2h_Bps: float
    h2d_Bps: float
    duplex_Bps: float
    granularity: int = 512  # the CUDA caching allocator rounds every block to 512 bytes
    measured: bool = False


def rates_for(gpu: str) -> Rates:
    """The :data:`GPUS` rates for ``gpu``: a key (``"h100"``) or a device name (``"NVIDIA H100 80GB HBM3"``)."""
    name = str(gpu or "h100").lower()
    key = next((k for k in GPUS if k in name), None)
    if key is None:
        raise ValueError(f"unknown gpu {gpu!r}; expected one of {', '.join(GPUS)} "
                         "(rates for others: measure on the GPU itself with profile(model_on_cuda, ...))")
    g = GPUS[key]
    return Rates(key, g["bf16_tflops"] * 1e12, g["fp32_tflops"] * 1e12, g["hbm_GBps"] * 1e9,
                 g["d2h_GBps"] * 1e9, g["h2d_GBps"] * 1e9, g["duplex_GBps"] * 1e9,
                 granularity=1 if key == "cpu" else 512)


@dataclass(frozen=True)
class EngineModel:
    """What :mod:`remat.simulator` assumes of :class:`remat.offload.OffloadEngine` (its defaults).

    ``window_bytes``: the most GPU bytes of offloaded tensors the engine holds before the host
    waits for copies (its ``max_pending_bytes``); None: ``window_records`` times the largest
    block's offloaded bytes. ``issue_bytes``: copies queued on the copy stream at once (bytes
    still waiting beyond it when the backward starts are never moved). ``prefetch_blocks``:
    blocks fetched ahead in backward.
    """

    window_bytes: Optional[int] = None
    window_records: int = 1
    issue_bytes: int = 512 * 2**20
    prefetch_blocks: int = 1


@dataclass(frozen=True)
class BlockCost:
    """One block under one treatment, run alone. Bytes are new storages beyond its inputs."""

    fwd_peak: int           # peak during its forward
    kept: int               # alive after forward once the caller drops the output: saved for backward
    out_alive: int          # the output's bytes not already in ``kept``
    out_bytes: int          # the output tensor's bytes (its gradient has this size)
    saves_input: bool       # the input hidden state is saved (stays alive until backward)
    bwd_peak: int           # peak during backward, recompute included, counted from the same zero
    bwd_end: int            # alive after backward: parameter gradients + input gradient
    fwd_s: float
    bwd_s: float            # backward including recompute
    offloadable: int = 0    # saved bytes the offload engine would move (>= min bytes, no params)
    offload_bytes: int = 0  # bytes this treatment moves to the host and back


@dataclass(frozen=True)
class HeadCost:
    """Everything outside the blocks for one head mode, from a run with stubbed blocks.

    Bytes count from the start of the step (static excluded): ``pre_end`` is the live set
    when the first block starts (hidden states, rotary tables); the head's numbers are
    absolute in the same run, where blocks keep nothing.
    """

    mode: str
    chunk_tokens: Optional[int]
    pre_peak: int
    pre_end: int
    head_fwd_peak: int
    head_fwd_end: int
    head_bwd_peak: int
    head_bwd_end: int
    pre_bwd_peak: int
    pre_bwd_end: int
    pre_fwd_s: float
    head_fwd_s: float
    head_bwd_s: float
    pre_bwd_s: float


@dataclass(frozen=True)
class Profile:
    """The numbers :func:`remat.simulate` and :func:`remat.solve` need; see the module doc."""

    model: str
    block_names: tuple
    block_class: tuple       # per block, an index into ``classes``
    classes: tuple           # per class, {treatment: BlockCost}
    heads: tuple             # HeadCost per head option
    param_bytes: int
    buffer_bytes: int
    optimizer: str
    optimizer_bytes: int
    static_bytes: int        # what is allocated before a step: params, buffers, optimizer state, rest
    hidden_bytes: int
    batch: int
    seq: int
    dtype: str
    device: str              # "cuda" (measured) or "fake" (estimated)
    rates: Rates
    notes: dict = field(default_factory=dict)
    engine: EngineModel = EngineModel()

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def cost(self, index: int, treatment: str) -> BlockCost:
        costs = self.classes[self.block_class[index]]
        if treatment not in costs:
            raise ValueError(f"treatment {treatment!r} is not available for block {self.block_names[index]} "
                             f"(profiled: {', '.join(costs)})")
        return costs[treatment]

    def treatments(self, index: int = 0) -> tuple:
        return tuple(self.classes[self.block_class[index]])

    def head(self, mode: str = "plain", chunk_tokens: Optional[int] = None) -> HeadCost:
        options = [h for h in self.heads if h.mode == mode]
        if not options:
            raise ValueError(f"head mode {mode!r} was not profiled (profiled: "
                             f"{sorted({h.mode for h in self.heads})}); {self.notes.get('chunked', '')}")
        if mode == "chunked" and chunk_tokens is not None:
            # the profiled chunk closest to the one asked for
            return min(options, key=lambda h: abs(h.chunk_tokens - chunk_tokens))
        return options[0] if mode == "plain" else max(options, key=lambda h: h.chunk_tokens)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["classes"] = [{t: asdict(c) for t, c in costs.items()} for costs in self.classes]
        return data


# ---------------------------------------------------------------- meters

class _Tracker(TorchDispatchMode):
    """Live storage bytes and roofline seconds of every op run under it."""

    def __init__(self, rates: Rates):
        super().__init__()
        self.rates = rates
        self.live = {}
        self.current = 0
        self.peak = 0
        self.seconds = 0.0

    def _free(self, key, size, _ref):
        if self.live.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        seen = {id(t.untyped_storage()) for t in inputs}
        moved = sum(t.numel() * t.element_size() for t in inputs)
        kernel = func._schema.is_mutable
        g = self.rates.granularity
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in seen:
                continue  # a view or an in-place result: no new memory
            kernel = True
            moved += t.numel() * t.element_size()
            if key not in self.live:
                size = -(-storage.nbytes() // g) * g
                self.live[key] = weakref.ref(storage, partial(self._free, key, size))
                self.current += size
        self.peak = max(self.peak, self.current)
        if kernel:
            self.seconds += _op_seconds(func, args, kwargs, out, moved, self.rates)
        return out


def _op_seconds(func, args, kwargs, out, moved, rates) -> float:
    from torch.utils.flop_counter import flop_registry
    name = func.__name__
    packet = func._overloadpacket
    formula = flop_registry.get(packet)
    attention = any(a in name for a in _ATTENTION_OPS)
    if formula is None and attention:  # the CPU flash kernels have no formula: use CUDA flash's
        aten = torch.ops.aten
        formula = flop_registry.get(aten._scaled_dot_product_flash_attention_backward if "backward" in name
                                    else aten._scaled_dot_product_flash_attention)
    flops = 0.0
    if formula is not None:
        try:
            flops = float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments: bytes only
            flops = 0.0
    dtype = next((t.dtype for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), torch.float32)
    rate = rates.fp32_flops if dtype == torch.float32 else rates.matmul_flops
    if attention:
        causal = any(a is True for a in args[3:]) or kwargs.get("is_causal") is True
        flops *= 0.5 if causal else 1.0
        rate *= ATTENTION_EFFICIENCY
    else:
        rate *= MATMUL_EFFICIENCY
    return max(flops / rate, moved / (rates.hbm_Bps * HBM_EFFICIENCY)) + LAUNCH_S


class _TrackerMeter:
    """Marks on a :class:`_Tracker`: (current, peak, seconds) since the last mark."""

    def __init__(self, tracker: _Tracker):
        self.t = tracker
        self._seconds = tracker.seconds

    def zero(self):
        pass  # nothing is queued on a fake device

    def begin(self):
        self.t.peak = self.t.current
        self._base = self.t.current
        self._seconds = self.t.seconds

    def mark(self):
        reading = (self.t.current - self._base, self.t.peak - self._base, self.t.seconds - self._seconds)
        self.t.peak = self.t.current
        self._seconds = self.t.seconds
        return reading

    def finish(self, marks):
        return marks


class _CudaMeter:
    """Marks from the CUDA caching allocator's statistics and CUDA events."""

    def zero(self):
        torch.cuda.synchronize()

    def begin(self):
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._last = torch.cuda.Event(enable_timing=True)
        self._last.record()

    def mark(self):
        now = torch.cuda.memory_allocated() - self._base
        peak = torch.cuda.max_memory_allocated() - self._base
        torch.cuda.reset_peak_memory_stats()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        start, self._last = self._last, event
        return now, peak, (start, event)

    def finish(self, marks):
        torch.cuda.synchronize()
        return [(now, peak, a.elapsed_time(b) / 1e3) for now, peak, (a, b) in marks]


def _chain(meter, run, repeats):
    """``run()`` once to warm up, then ``repeats + 1`` times back to back (no synchronisation
    between them); the first of those is dropped. Returns the marks (now, peak, seconds) per
    phase: bytes from the last run, seconds the median; a fake run (``repeats`` 1) is its own.
    ``run`` returns (raw marks, extras...); the warm-up's extras are returned with the marks.
    """
    meter.zero()
    first = run()
    extras = tuple(first[1:])
    if repeats <= 1:
        return (meter.finish(first[0]),) + extras
    meter.finish(first[0])
    meter.zero()
    raw = [run()[0] for _ in range(repeats + 1)]
    timed = [meter.finish(r) for r in raw][1:]
    marks = [(now, peak, statistics.median(t[k][2] for t in timed)) for k, (now, peak, _) in enumerate(timed[-1])]
    return (marks,) + extras


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


# ---------------------------------------------------------------- profile

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


def _copy_rates(device, nbytes: int = 512 * 2**20, repeats: int = 5) -> tuple:
    """Pinned host copy rates (bytes/s) on ``device``: device to host, host to device.

    The fastest of ``repeats`` copies: interference only slows a copy down (one median read
    29.6 GB/s host-to-device where every other measurement read 55 on the same H200).
    """
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, gpu), (gpu, host)):
        dst.copy_(src, non_blocking=True)  # warm up
        seconds = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            seconds.append(a.elapsed_time(b) / 1e3)
        rates.append(nbytes / max(min(seconds), 1e-9))
    del gpu, host
    return tuple(rates)


def _known_gpu(name: str) -> bool:
    return any(key in name.lower() for key in GPUS)


def engine_model() -> EngineModel:
    """The offload engine's defaults as :class:`EngineModel` (see "Memory the engine adds" there)."""
    try:
        from . import offload
    except ImportError:
        return EngineModel()
    return EngineModel(window_bytes=None, window_records=int(offload.DEFAULT_WINDOW_RECORDS),
                       issue_bytes=int(offload._ISSUE_WINDOW), prefetch_blocks=1)


def _default_min_offload_bytes() -> int:
    try:
        from . import offload
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


def _signature(block: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    return (type(block), params)


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


@contextlib.contextmanager
def _cuda_attention(packed: bool):
    """Run SDPA as the CUDA kernels would, on fake CPU tensors.

    The CPU kernels differ in what they save (CPU flash expands grouped K/V heads; the
    math fallback materialises the attention matrix); the CUDA flash and memory-efficient
    ops have shape functions that run on fake tensors of any device, so a CPU-only
    profile sees the GPU's saved tensors: output, log-sum-exp and the inputs.
    Hugging Face cannot read fake position ids to see that a batch is not packed, and
    would build a [batch, 1, seq, seq] mask that the real run skips: unless the batch
    passes ``position_ids``, it is told there is no packing.
    """
    original = F.scaled_dot_product_attention
    masking = sys.modules.get("transformers.masking_utils")
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if find_packed is not None and not packed:
        masking.find_packed_sequence_indices = lambda *args, **kwargs: None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        aten = torch.ops.aten
        if attn_mask is None and query.shape[-1] <= 256 and query.shape[-1] == value.shape[-1]:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                             False, scale=scale)[0]
        if key.shape[-3] == query.shape[-3]:
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(~bias, float("-inf"))
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                 is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        if find_packed is not None:
            masking.find_packed_sequence_indices = find_packed


def _swap_to_fake(model: nn.Module, fake_mode):
    """Replace parameters and buffers by fake CPU tensors; returns the undo function."""
    saved = []
    memo = {}
    with fake_mode:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    key = id(value)
                    if key not in memo:  # tied weights stay tied
                        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
                        if kind == "_parameters":
                            fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                        memo[key] = fake
                    saved.append((table, name, value))
                    table[name] = memo[key]

    def undo():
        for table, name, value in saved:
            table[name] = value
    return undo


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


# ---------------------------------------------------------------- calibration (GPU only)

def _calibrate(model, batch, named, prof, say) -> Profile:
    """Scale the blocks' and the head's seconds to what they take inside a real step.

    Measured on an H200: a block ran 0-10% slower inside a whole step than alone, even
    back to back (likely sustained load: clocks, power), a systematic under-prediction of
    the step (v1: -4..-6% on the bench model). So one real step is run with the fastest
    uniform plan that fits in free memory (keep if it fits), with CUDA events at every
    block's forward and backward and around the head; the ratios in-step / profiled
    (median over blocks: forward, backward; head) scale every treatment's seconds. One
    ratio for all treatments: recompute-heavy ones come out a few percent high (llama-1b
    ``full`` +2.7%). Skipped (noted) when no uniform plan fits.
    """
    from .simulator import simulate
    device = next(model.parameters()).device
    free, _ = torch.cuda.mem_get_info(device)
    room = torch.cuda.memory_allocated(device) + 0.85 * free
    options = [t for t in MEASURED_TREATMENTS if t in prof.treatments(0)]
    fits = [(simulate(prof, t, head=h.mode, chunk_tokens=h.chunk_tokens), t, h) for t in options for h in prof.heads]
    fits = [f for f in fits if f[0].bound_bytes <= room]
    if not fits:
        return replace(prof, notes=dict(prof.notes, calibration="skipped: no uniform plan fits in free memory"))
    sim, treatment, head = min(fits, key=lambda f: f[0].step_s)
    say(f"calibrating on one step: {treatment}, head {head.mode}")
    for _, block in named:
        apply_treatment(block, treatment)
    if head.mode == "chunked":
        from .head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=head.chunk_tokens)
    try:
        _staged_step(model, batch, named)  # warm-up
        steps = [_staged_step(model, batch, named) for _ in range(2)]
    finally:
        for _, block in named:
            remove_treatment(block)
        if head.mode == "chunked":
            from .head import disable_chunked_head
            disable_chunked_head(model)
        model.zero_grad(set_to_none=True)
    costs = [prof.cost(i, treatment) for i in range(len(named))]
    fwd = statistics.median(s["fwd"][i] / costs[i].fwd_s for s in steps for i in range(len(costs)))
    bwd = statistics.median(s["bwd"][i] / costs[i].bwd_s for s in steps for i in range(len(costs)))
    hd = statistics.median(s["head"] for s in steps) / max(head.head_fwd_s + head.head_bwd_s, 1e-9)
    scale = lambda c: replace(c, fwd_s=c.fwd_s * fwd, bwd_s=c.bwd_s * bwd)  # noqa: E731
    classes = tuple({t: scale(c) for t, c in costs_.items()} for costs_ in prof.classes)
    heads = tuple(replace(h, head_fwd_s=h.head_fwd_s * hd, head_bwd_s=h.head_bwd_s * hd) for h in prof.heads)
    note = {"plan": f"{treatment}, head {head.mode}", "forward": round(fwd, 4), "backward": round(bwd, 4),
            "head": round(hd, 4), "step_s": round(statistics.median(s["step"] for s in steps), 5),
            "predicted_step_s": round(sim.step_s, 5)}
    return replace(prof, classes=classes, heads=heads, notes=dict(prof.notes, calibration=note))


def _staged_step(model, batch, named) -> dict:
    """One training step with CUDA events around each block's forward and backward and the head."""
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    n = len(named)
    start, end, grad_at = [None] * n, [None] * n, [None] * (n + 1)  # grad_at[i]: gradient reached block i's output
    handles = []

    def recorded():
        e = event()
        e.record()
        return e

    def pre(i, module, args, kwargs):
        start[i] = recorded()
        x = _hidden_of(args, kwargs)
        if i == 0 and x.requires_grad:
            x.register_hook(lambda g: grad_at.__setitem__(n, recorded()) or None)

    def post(i, module, args, kwargs, out):
        end[i] = recorded()
        y = out if isinstance(out, torch.Tensor) else out[0]
        if y.requires_grad:
            y.register_hook(lambda g: grad_at.__setitem__(i, recorded()) or None)

    for i, (_, block) in enumerate(named):
        handles.append(block.register_forward_pre_hook(partial(pre, i), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(post, i), with_kwargs=True))
    try:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        del loss
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
    finally:
        for handle in handles:
            handle.remove()
    ms = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
    # block i's backward: from the gradient reaching its output to it reaching its input
    # (the output of block i-1, or the first block's input)
    bwd = [ms(grad_at[i], grad_at[i - 1] if i else grad_at[n]) for i in range(n)]
    return {"fwd": [ms(start[i], end[i]) for i in range(n)], "bwd": bwd,
            "head": ms(end[n - 1], grad_at[n - 1]), "step": step}


def _finish(model, body, batch, rates, device, optimizer, optimizer_bytes, param_bytes, buffer_bytes,
            static) -> Profile:
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    classes, block_class, heads, hidden_bytes, notes, names = body
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Profile(type(model).__name__, names, block_class, classes, heads, param_bytes, buffer_bytes,
                   optimizer, optimizer_bytes, static, hidden_bytes, int(ids.shape[0]), int(ids.shape[1]),
                   dtype, device, rates, notes, engine_model())


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


def _head_cost(model, batch, named, templates, mode, chunk, meter, repeats) -> HeadCost:
    if mode == "chunked":
        from .head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=chunk)
        _trust_head_probe(model)
    try:
        (m,) = _chain(meter, lambda: (_stub_run(model, batch, named, templates, meter),), repeats)
    finally:
        if mode == "chunked":
            from .head import disable_chunked_head
            disable_chunked_head(model)
    (pre_end, pre_peak, _), _, (hf_end, hf_peak, _), (hb_end, hb_peak, _), _, (pb_end, pb_peak, _) = m
    t = [x[2] for x in m]
    # phases 1 and 4 are the stubs' own clone and its backward
    return HeadCost(mode, chunk, pre_peak, pre_end, hf_peak, hf_end, hb_peak, hb_end, pb_peak, pb_end,
                    t[0], t[2], t[3], t[5])


def _trust_head_probe(model):
    # remat.head checks the model's logit transform on a probe with real values, which fake
    # tensors do not have; a fake run only needs the memory and FLOPs, so skip that check.
    state = next((m.__dict__["_remat_head"] for m in model.modules() if "_remat_head" in m.__dict__), None)
    if state is not None and _is_fake(next(model.parameters())):
        class _Everything(set):
            def __contains__(self, key):
                return True
        state.verified = _Everything()


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


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


def progress_printer(stream=None, after_s: float = 2.0):
    """A ``progress=`` callback that prints to stderr once profiling has taken ``after_s``."""
    start = time.perf_counter()
    stream = stream or sys.stderr

    def say(message):
        if time.perf_counter() - start >= after_s:
            print(f"[remat {time.perf_counter() - start:5.1f}s] {message}", file=stream, flush=True)
    return say
