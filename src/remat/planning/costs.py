"""What a profile holds: per-block and head costs, device rates, and the numbers behind them.

How: plain frozen dataclasses, built by keyword only. :class:`Profile` is what
:func:`remat.profile` returns and what :func:`remat.simulate` and :func:`remat.solve` read: per
block class a :class:`BlockCost` for each treatment (and, for the tiled treatments, one per chunk
size profiled: ``tiles``), a :class:`HeadCost` per head mode, the static bytes, the :class:`Rates` the seconds were computed or measured with, the
:class:`~remat.planning.offload_model.EngineModel` of the offload engine and, on several ranks,
the step's :class:`~remat.planning.comm.Collectives`. :data:`GPUS` holds the
rates a fake (CPU-only) profile prices ops with.

Why apart from the profiler: the simulator, the solver and the reports only need these
numbers, never the meters that fill them; this module imports neither torch nor the measuring
code, so a profile can be read, transformed and planned on any machine.

Limits: the GPU rates are fixed anchors (measured once, not datasheet numbers); a profile
taken on a GPU replaces the copy rates by its own measurement and marks itself ``measured``.
Bytes are what the meters read (see :mod:`remat.profiling.profiler`), not a model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

from remat.planning.comm import Collectives
from remat.planning.offload_model import EngineModel
from remat.planning.plans import DEFAULT_TILE_TOKENS, TABLE, TILED_TREATMENTS, variant

MEASURED_TREATMENTS = tuple(name for name, t in TABLE.items() if not t.offload)
"""The treatments a profile runs on each block class: all but the offloading ones."""
DERIVED = {name: variant(name, offload=False) for name, t in TABLE.items() if t.offload}
"""Each offloading treatment and the measured one it is priced from (``full+offload``: ``full``): the
same run, with what its offload moves read from the base's offloadable bytes."""
TILED_FROM_TOKENS = 16384
"""Tiled treatments are profiled from this many tokens a step on: below it one chunk of the
default size holds most of the sequence, and tiling saves nothing ``mlp`` does not."""
OPTIMIZER_STATES = {"none": (0, None), "adamw": (2, None), "adamw-fused": (2, None), "adamw-forloop": (2, None),
                    "adamw8bit": (2, 1)}
"""Per trainable parameter: the optimizer's state tensors and the bytes of one element of each
(None: the parameter's own, as ``torch.optim.AdamW``'s ``zeros_like`` states are: 8 bytes a
parameter in fp32, 4 in bf16; bitsandbytes' 8-bit states are 1 byte whatever the parameter).
The optimizers: ``adamw`` is ``torch.optim.AdamW()`` as it runs on a GPU by default (the foreach
implementation), ``adamw-fused`` ``AdamW(fused=True)`` (the Hugging Face Trainer's default
``adamw_torch_fused`` on torch >= 2.8), ``adamw-forloop`` ``AdamW(foreach=False)``, ``adamw8bit``
bitsandbytes' ``AdamW8bit``."""
OPTIMIZER_PASSES = {"none": (0, 0), "adamw": (20, 0), "adamw-fused": (7, 0), "adamw-forloop": (20, 0),
                    "adamw8bit": (3, 4)}
"""Bytes an optimizer step reads and writes per trainable parameter: ``(times the parameter's element
size, plus bytes)``. ``adamw`` and ``adamw-forloop``: ``torch.optim.AdamW``'s passes (decoupled
weight decay), one over whole tensors per op: ``mul_`` of the parameters (read, write), ``lerp_``
of the first moment (3), ``mul_`` (2) and ``addcmul_`` (3) of the second, ``sqrt`` into a
temporary (2), ``div_`` (2) and ``add_`` (2) of it, ``addcdiv_`` into the parameters (4): 20
element sizes (states, gradients and the temporary in the parameter's dtype). ``adamw-fused``: one
kernel reads the parameter, its gradient and both states and writes the parameter and the states
(7). ``adamw8bit``: bitsandbytes' one fused kernel: the parameter and its gradient read, the
parameter written, two 1-byte states read and written."""
OPTIMIZER_HBM_FRACTION = 0.8
"""The fraction of the datasheet HBM bandwidth an optimizer step's elementwise passes run at (not
fitted; the foreach kernels are bandwidth bound over large tensors)."""
OPTIMIZER_LAUNCHES = {"none": 0, "adamw": 8, "adamw-fused": 1, "adamw-forloop": 8, "adamw8bit": 1}
"""Kernel launches per parameter group of an optimizer step (the foreach ops above; the for-loop
variant launches them once per parameter, which :func:`optimizer_step_seconds` is not told)."""
OPTIMIZER_LAUNCH_S = 20e-6
"""Seconds per launch of an optimizer's kernels (a foreach op splits its tensor list into a few
launches), charged once per op: tens of microseconds against a step of tenths of seconds."""
CHUNK_CANDIDATES = (1024, 2048, 4096, 8192)
TILE_CANDIDATES = (2048, 4096, 8192, 16384)
"""Chunk sizes the tiled treatments are profiled at (those below the step's tokens; the solver
picks one per block). Not below 2048: the per-chunk costs are priced (a GPU profile measures them;
the fake roofline, :mod:`remat.profiling._meters`, charges each kernel its ``LAUNCH_S`` of 4 us,
calibrated against the H100 anchors, and the weight-gradient sum each chunk adds, a pass over the
weights' gradients, by its bytes: an 8B block's ``full+tiled`` backward at 32k tokens reads
170.6 ms in chunks of 8192, 180.1 in chunks of 2048), but the roofline takes a matmul's rate as
the same at any row count, and on a GPU a matmul of a few hundred rows runs well below it; from
2048 rows of a transformer's MLP the rate holds, so a choice among these cannot drift to a chunk
the roofline makes look free."""

# Rates per GPU: large bf16 matmul (TFLOP/s as measured, not the datasheet), fp32 matmul,
# HBM GB/s (the datasheet's; the FSDP2/DDP copies run at a fraction of it, remat.planning.sharding.Overheads),
# pinned host copies GB/s, collective bus bandwidth GB/s between the GPUs of one host
# (nccl-tests' "busbw"), and attention_tflops: causal flash attention forward and backward per head
# dimension. Where each figure was measured, and which are rough: docs/design/planning.md, "Rates,
# anchors and the bench model". A GPU profile measures its own copy rates; the bus rate of a live
# process group: remat.profiling._calibrate.bus_rate.
H100_ATTENTION = ((64, 450.0, 415.0), (128, 570.0, 530.0))
GPUS = {
    "h100": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=3350.0, d2h_GBps=55.0, h2d_GBps=48.0,
                 duplex_GBps=86.0, bus_GBps=330.0, attention_tflops=H100_ATTENTION),
    "h200": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=4800.0, d2h_GBps=55.0, h2d_GBps=55.0,
                 duplex_GBps=101.0, bus_GBps=330.0, attention_tflops=H100_ATTENTION),
    "a100": dict(bf16_tflops=280.0, fp32_tflops=18.0, hbm_GBps=2039.0, d2h_GBps=25.0, h2d_GBps=24.0,
                 duplex_GBps=40.0, bus_GBps=230.0),
    "cpu": dict(bf16_tflops=1.0, fp32_tflops=1.0, hbm_GBps=20.0, d2h_GBps=20.0, h2d_GBps=20.0,
                duplex_GBps=20.0, bus_GBps=5.0),
}
CARD_BYTES = {"h100": int(79.2 * 2**30), "h200": int(139.8 * 2**30), "a100": int(79.2 * 2**30)}
"""What ``torch.cuda.get_device_properties(0).total_memory`` reads on each card (an 80 GB H100 and A100;
the A100 also comes with 40 GB): the most a plan made with fake tensors for that card can use."""
DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "half": 2, "fp16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def optimizer_state_bytes(optimizer: str, params) -> int:
    """Bytes of ``optimizer``'s state for ``params``, ``(numel, element_size)`` of each trainable parameter."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    states, element = OPTIMIZER_STATES[optimizer]
    return sum(states * numel * (element or size) for numel, size in params)


def optimizer_temp_bytes(optimizer: str, params) -> int:
    """Bytes ``optimizer``'s step allocates above the parameters, their gradients and its states, at
    its peak, for ``params``: ``(numel, element_size)`` of each trainable parameter in the order the
    optimizer holds them.

    ``adamw`` (foreach): ``torch._foreach_sqrt`` of the second moments makes a temporary as large as
    the parameters of one (device, dtype) group, and the next group's is allocated before the last
    one's is released, so the peak is the largest sum of two consecutive groups (groups taken by
    element size, in order of first appearance). ``adamw-forloop``: ``exp_avg_sq.sqrt() / c`` makes
    two temporaries of one parameter's size while the previous parameter's result is still bound:
    the largest ``2 x size + previous size``. ``adamw-fused`` and ``adamw8bit`` update each tensor in
    one kernel: none (measured: benchmarks/results/issue38, tests/test_card.py).

    Raises ValueError for an optimizer not in :data:`OPTIMIZER_STATES`."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    if optimizer == "adamw":
        groups = {}
        for numel, size in params:
            groups[size] = groups.get(size, 0) + numel * size
        sizes = list(groups.values())
        return max([a + b for a, b in zip(sizes, sizes[1:])] + sizes + [0])
    if optimizer == "adamw-forloop":
        sizes = [numel * size for numel, size in params]
        return max((2 * b + a for a, b in zip([0] + sizes, sizes)), default=0)
    return 0


def optimizer_step_bytes(optimizer: str, params) -> int:
    """HBM bytes ``optimizer``'s step reads and writes for ``params``, ``(numel, element_size)`` of
    each trainable parameter (:data:`OPTIMIZER_PASSES`)."""
    if optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_PASSES)}, got {optimizer!r}")
    sizes, extra = OPTIMIZER_PASSES[optimizer]
    return sum(numel * (sizes * size + extra) for numel, size in params)


def optimizer_step_seconds(optimizer: str, step_bytes: float, rates: "Rates") -> float:
    """Seconds of an optimizer step that moves ``step_bytes`` (:func:`optimizer_step_bytes`) on a
    device of ``rates``: bandwidth bound, plus its launches; 0 without an optimizer."""
    if not step_bytes:
        return 0.0
    return step_bytes / (rates.hbm_Bps * OPTIMIZER_HBM_FRACTION) + OPTIMIZER_LAUNCHES[optimizer] * OPTIMIZER_LAUNCH_S


@dataclass(frozen=True, kw_only=True)
class Rates:
    """Device rates the time model uses (bytes/s, FLOP/s)."""

    name: str
    """The :data:`GPUS` key these rates came from (``"h100"``)."""
    matmul_flops: float
    """Large low-precision (bf16/fp16) matmuls, FLOP/s."""
    fp32_flops: float
    """fp32 matmuls, FLOP/s."""
    hbm_Bps: float
    """Device memory bandwidth, bytes/s."""
    d2h_Bps: float
    """Pinned device-to-host copies, bytes/s."""
    h2d_Bps: float
    """Pinned host-to-device copies, bytes/s."""
    duplex_Bps: float
    """Both directions at once, bytes/s in all."""
    bus_Bps: float = 330e9
    """Collective bus bandwidth between the GPUs (nccl-tests' busbw): a ring all-gather or
    reduce-scatter of ``B`` bytes in all takes ``B * (world - 1) / world / bus_Bps`` seconds."""
    granularity: int = 512
    """Bytes every allocation is rounded up to (the CUDA caching allocator's 512)."""
    measured: bool = False
    """The copy rates were timed on the GPU itself."""
    attention: tuple = ()
    """Causal-halved FLOP/s of fused attention, ``(head_dim, forward, backward)`` per head
    dimension measured, ascending; empty: a fixed fraction of :attr:`matmul_flops`."""

    def attention_flops(self, head_dim: int, backward: bool) -> Optional[float]:
        """FLOP/s fused attention reaches at ``head_dim``: linear between the head dimensions
        measured, the nearest one beyond them; None where none was measured."""
        if not self.attention:
            return None
        points = [(d, bwd if backward else fwd) for d, fwd, bwd in self.attention]
        if head_dim <= points[0][0]:
            return points[0][1]
        for (d0, r0), (d1, r1) in zip(points, points[1:]):
            if head_dim <= d1:
                return r0 + (r1 - r0) * (head_dim - d0) / (d1 - d0)
        return points[-1][1]


def rates_for(gpu: str) -> Rates:
    """The :data:`GPUS` rates for ``gpu``: a key (``"h100"``) or a device name (``"NVIDIA H100 80GB HBM3"``)."""
    name = str(gpu or "h100").lower()
    key = next((k for k in GPUS if k in name), None)
    if key is None:
        raise ValueError(f"unknown gpu {gpu!r}; expected one of {', '.join(GPUS)} "
                         "(rates for others: measure on the GPU itself with profile(model_on_cuda, ...))")
    g = GPUS[key]
    attention = tuple((d, fwd * 1e12, bwd * 1e12) for d, fwd, bwd in g.get("attention_tflops", ()))
    return Rates(name=key, matmul_flops=g["bf16_tflops"] * 1e12, fp32_flops=g["fp32_tflops"] * 1e12,
                 hbm_Bps=g["hbm_GBps"] * 1e9, d2h_Bps=g["d2h_GBps"] * 1e9, h2d_Bps=g["h2d_GBps"] * 1e9,
                 duplex_Bps=g["duplex_GBps"] * 1e9, bus_Bps=g["bus_GBps"] * 1e9,
                 granularity=1 if key == "cpu" else 512, attention=attention)


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype``: a name (``"bfloat16"``, ``"bf16"``) or a torch dtype."""
    name = str(dtype).replace("torch.", "").lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)} (or the torch dtype)")
    return DTYPE_BYTES[name]


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One block under one treatment, run alone. Bytes are new storages beyond its inputs."""

    fwd_peak: int
    """Peak during its forward."""
    kept: int
    """Alive after its forward once the caller drops the output: what it saved for backward."""
    out_alive: int
    """The output's bytes not already in ``kept``."""
    out_bytes: int
    """The output tensor's bytes (its gradient has this size)."""
    saves_input: bool
    """The input hidden state is saved (it stays alive until the block's backward)."""
    bwd_peak: int
    """Peak during its backward, recompute included, counted from the same zero."""
    bwd_end: int
    """Alive after its backward: parameter gradients and the input gradient."""
    fwd_s: float
    """Seconds of its forward."""
    bwd_s: float
    """Seconds of its backward, recompute included."""
    offloadable: int = 0
    """Saved bytes the offload engine would move (storages of at least its minimum size, no parameters)."""
    offload_bytes: int = 0
    """Bytes this treatment moves to the host and back (0 unless it offloads)."""
    host_bytes: int = 0
    """Pinned host bytes the offload engine holds for ``offloadable`` when this block offloads: its
    pool rounds each tensor up to a power of two (:func:`~remat.planning.offload_model.pinned_bytes`)."""
    grad_bytes: int = 0
    """Bytes of its trainable parameters' gradients, part of ``bwd_end``. A block called several
    times a step leaves them once (autograd sums the calls' gradients into one buffer): its other
    calls leave ``bwd_end - grad_bytes`` (:mod:`remat.planning.calls`)."""


@dataclass(frozen=True, kw_only=True)
class HeadCost:
    """Everything outside the blocks for one head mode, from a run with stubbed blocks.

    Bytes count from the start of the step (static excluded): ``pre_end`` is the live set
    when the first block starts (hidden states, rotary tables); the head's numbers are
    absolute in the same run, where blocks keep nothing.
    """

    mode: str
    """``"plain"`` or ``"chunked"``."""
    chunk_tokens: Optional[int]
    """Tokens per chunk of the chunked head (None for the plain one)."""
    pre_peak: int
    """Peak of the embeddings' forward."""
    pre_end: int
    """Alive when the first block starts."""
    head_fwd_peak: int
    """Peak of the head's and the loss's forward."""
    head_fwd_end: int
    """Alive after the loss."""
    head_bwd_peak: int
    """Peak of the head's backward."""
    head_bwd_end: int
    """Alive when the last block's backward starts."""
    pre_bwd_peak: int
    """Peak of the embeddings' backward."""
    pre_bwd_end: int
    """Alive at the end of the step."""
    pre_fwd_s: float
    """Seconds of the embeddings' forward."""
    head_fwd_s: float
    """Seconds of the head's and the loss's forward."""
    head_bwd_s: float
    """Seconds of their backward."""
    pre_bwd_s: float
    """Seconds of the embeddings' backward."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """The numbers :func:`remat.simulate` and :func:`remat.solve` need; see the module doc."""

    model: str
    """The model's class name."""
    block_names: tuple
    """Qualified names of the blocks, in forward order."""
    block_class: tuple
    """Per block, an index into ``classes``."""
    classes: tuple
    """Per block class, ``{treatment: BlockCost}``."""
    heads: tuple
    """A :class:`HeadCost` per head option profiled."""
    param_bytes: int
    """Bytes of the parameters."""
    buffer_bytes: int
    """Bytes of the buffers."""
    optimizer: str
    """The optimizer whose state is counted: a key of :data:`OPTIMIZER_STATES`."""
    optimizer_bytes: int
    """Bytes of its state."""
    optimizer_temp_bytes: int = 0
    """Bytes its step allocates above parameters, gradients and states (:func:`optimizer_temp_bytes`):
    the step's last phase, whose peak can be the step's."""
    static_bytes: int
    """Allocated before a step: parameters, buffers, optimizer state and anything else alive."""
    hidden_bytes: int
    """Bytes of one hidden state (a block's input)."""
    batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence."""
    dtype: str
    """The parameters' dtype (``"bfloat16"``)."""
    device: str
    """``"cuda"`` (measured) or ``"fake"`` (estimated)."""
    rates: Rates
    """The rates the seconds were measured or computed with."""
    notes: dict = field(default_factory=dict)
    """Free-form: profiling time, heads not profiled and why, calibration, FSDP world."""
    engine: EngineModel = EngineModel()
    """What the simulator and the solver assume of the offload engine."""
    comm: Optional[Collectives] = None
    """The collectives per step: FSDP2's (set by :func:`remat.planning.sharding.shard`) or DDP's
    (:func:`remat.planning.replication.replicate`); None on one GPU."""
    step_overhead_s: float = 0.0
    """Seconds a real step took beyond what its parts add up to (the in-step calibration's
    residual: launch gaps, the loss's glue, the step's own start and end), added to every plan's
    step; 0 when not calibrated."""
    host_limit: Optional[int] = None
    """Pinned host bytes the offload engine may hold (the pool's limit, by default 60% of the
    host's available memory); a plan that would need more offloads less (:mod:`remat.planning.solver`).
    None: no limit."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer's step after the backward (:func:`optimizer_step_seconds` of the
    rank's trainable parameters: ``1/world`` of them under FSDP2), added to every plan's step; 0
    with ``optimizer="none"`` (the bench protocol: forward and backward only)."""
    block_calls: tuple = ()
    """The step's block calls in the order its forward makes them, as indices into ``block_names``,
    where a block runs more than once a step (ALBERT calls its one layer group for every layer);
    empty: each block once, in order. See :mod:`remat.planning.calls`."""
    tiles: tuple = ()
    """Per block class, ``{chunk tokens: {treatment: BlockCost}}``: its tiled treatments measured at
    the chunk sizes of :data:`TILE_CANDIDATES` below the step's tokens other than
    :data:`~remat.planning.plans.DEFAULT_TILE_TOKENS`, whose costs are the tiled entries of
    ``classes``. A chunk changes a tiled block's transient peaks and its seconds (per-chunk launches
    and weight-gradient sums), not what it keeps or offloads: the tiled sub-modules save only their
    inputs. Empty (a profile made before chunk sizes were chosen, or one that tiles nothing): the
    default chunk only. Read through :meth:`cost` and :meth:`tile_sizes`."""
    class_kernels: tuple = ()
    """Per block class, the kernels its costs were measured with (``"stock"`` or ``"liger"``:
    :data:`~remat.planning.plans.KERNELS`); empty: the model's own modules everywhere."""
    kernel_variants: tuple = ()
    """Per block class, ``{kernel: class index}``: the same blocks measured with each kernel profiled
    (``remat.profile(..., kernels=("stock", "liger"))``; a class maps its own kernel to itself). Classes no
    block uses until :func:`remat.planning.kernels.with_kernels` chooses them; empty: one kernel each."""

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def cost(self, index: int, treatment: str, tile_tokens: Optional[int] = None) -> BlockCost:
        """Block ``index``'s cost under ``treatment``; for a tiled one, at the profiled chunk that stands
        for ``tile_tokens`` (:meth:`tile_size`; None: the default chunk)."""
        costs = self.classes[self.block_class[index]]
        if treatment not in costs:
            why = f": {self.notes[treatment]}" if isinstance(self.notes.get(treatment), str) else ""
            raise ValueError(f"treatment {treatment!r} is not available for block {self.block_names[index]} "
                             f"(profiled: {', '.join(costs)}){why}")
        size = self.tile_size(index, treatment, tile_tokens)
        if size is None or size == DEFAULT_TILE_TOKENS:
            return costs[treatment]
        return self.tiles[self.block_class[index]][size][treatment]

    def tile_sizes(self, index: int, treatment: str) -> tuple:
        """The chunk sizes block ``index``'s ``treatment`` was profiled at, largest first: () unless it is
        a tiled treatment the block can take; the default chunk alone in a profile without ``tiles``."""
        c = self.block_class[index]
        if treatment not in TILED_TREATMENTS or treatment not in self.classes[c]:
            return ()
        extra = self.tiles[c] if self.tiles else {}
        return tuple(sorted({DEFAULT_TILE_TOKENS, *(s for s, costs in extra.items() if treatment in costs)},
                            reverse=True))

    def tile_size(self, index: int, treatment: str, tile_tokens: Optional[int] = None) -> Optional[int]:
        """The profiled chunk size whose cost stands for a chunk of ``tile_tokens`` in block ``index``'s
        ``treatment``: that size where profiled, else the smallest profiled above it (its memory
        bounds the chunk's), else the largest; the default for None; None for a treatment that does
        not tile."""
        sizes = self.tile_sizes(index, treatment)
        if not sizes:
            return None
        if tile_tokens is None:
            return DEFAULT_TILE_TOKENS
        return min((s for s in sizes if s >= tile_tokens), default=sizes[0])

    def with_costs(self, change: Callable) -> "Profile":
        """This profile with each block cost, in ``classes`` and ``tiles`` alike, replaced by
        ``change(block class, treatment, cost)``; a cost for which it returns None is left out (what
        every transform of a profile's block costs goes through: sharding, calibration ...)."""
        def mapped(c, costs):
            out = {}
            for t, cost in costs.items():
                new = change(c, t, cost)
                if new is not None:
                    out[t] = new
            return out
        return replace(self, classes=tuple(mapped(c, costs) for c, costs in enumerate(self.classes)),
                       tiles=tuple({size: mapped(c, costs) for size, costs in sizes.items()}
                                   for c, sizes in enumerate(self.tiles)))

    def treatments(self, index: Optional[int] = None) -> tuple:
        """The treatments profiled for block ``index``; None: those of any block, in profile order
        (a hybrid model's blocks differ: a mamba block has no ``mlp`` where an attention block has)."""
        if index is not None:
            return tuple(self.classes[self.block_class[index]])
        return tuple(dict.fromkeys(t for costs in self.classes for t in costs))

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
        data["tiles"] = [{size: {t: asdict(c) for t, c in costs.items()} for size, costs in sizes.items()}
                         for sizes in self.tiles]
        return data


@dataclass(frozen=True, kw_only=True)
class ProfileBody:
    """What the block and head runs measured, before the model-wide numbers join them in a :class:`Profile`."""

    classes: tuple
    """Per block class, ``{treatment: BlockCost}``."""
    block_class: tuple
    """Per block, an index into ``classes``."""
    heads: tuple
    """A :class:`HeadCost` per head option profiled."""
    hidden_bytes: int
    """Bytes of one hidden state."""
    notes: dict
    """Heads not profiled and why, profiling seconds."""
    block_names: tuple
    """Qualified names of the blocks, in forward order."""
    block_calls: tuple = ()
    """Block indices of the step's calls, in order, where a block runs more than once (else empty)."""
    tiles: tuple = ()
    """Per block class, ``{chunk tokens: {treatment: BlockCost}}`` (:attr:`Profile.tiles`)."""
    class_kernels: tuple = ()
    """Per block class, the kernels it was measured with (:attr:`Profile.class_kernels`)."""
    kernel_variants: tuple = ()
    """Per block class, ``{kernel: class index}`` (:attr:`Profile.kernel_variants`)."""
