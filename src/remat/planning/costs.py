"""What a profile holds: per-block and head costs, device rates, and the numbers behind them.

How: plain frozen dataclasses, built by keyword only. :class:`Profile` is what
:func:`remat.profile` returns and what :func:`remat.simulate` and :func:`remat.solve` read: per
block class a :class:`BlockCost` for each treatment, a :class:`HeadCost` per head mode, the
static bytes, the :class:`Rates` the seconds were computed or measured with and the
:class:`~remat.planning.offload_model.EngineModel` of the offload engine. :data:`GPUS` holds the
rates a fake (CPU-only) profile prices ops with.

Why apart from the profiler: the simulator, the solver and the reports only need these
numbers, never the meters that fill them; this module imports neither torch nor the measuring
code, so a profile can be read, transformed and planned on any machine.

Limits: the GPU rates are fixed anchors (measured once, not datasheet numbers); a profile
taken on a GPU replaces the copy rates by its own measurement and marks itself ``measured``.
Bytes are what the meters read (see :mod:`remat.profiling.profiler`), not a model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from remat.planning.offload_model import EngineModel

MEASURED_TREATMENTS = ("keep", "full", "selective", "attention", "mlp")
DERIVED = {"offload": "keep", "full+offload": "full"}
OPTIMIZER_STATES = {"none": (0, None), "adamw": (2, None), "adamw8bit": (2, 1)}
"""Per trainable parameter: the optimizer's state tensors and the bytes of one element of each
(None: the parameter's own, as ``torch.optim.AdamW``'s ``zeros_like`` states are: 8 bytes a
parameter in fp32, 4 in bf16; bitsandbytes' 8-bit states are 1 byte whatever the parameter)."""
CHUNK_CANDIDATES = (1024, 2048, 4096, 8192)

# Rates per GPU: large bf16 matmul (TFLOP/s as measured, not the datasheet), fp32 matmul,
# HBM GB/s (the datasheet's; the FSDP2/DDP copies run at a fraction of it, remat.planning.sharding.Overheads),
# pinned host copies GB/s, collective bus bandwidth GB/s between the GPUs of one host
# (nccl-tests' "busbw"). H100: DESIGN.md anchors (791 TF/s, 55/48/86 GB/s); a 1 GiB NCCL all-reduce
# ran at 329 GB/s bus bandwidth on 2 x H100 (NVLink) and 355 on 4, so 330. H200 copies as measured by
# the offload bench (55/55/101 GB/s); its NVLink is the H100's, so the same bus figure (not measured).
# A100 (NVLink 3) and the CPU (gloo) bus figures are rough, not measured. A GPU profile measures its
# own copy rates; the bus rate of a live process group: remat.profiling._calibrate.bus_rate.
GPUS = {
    "h100": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=3350.0, d2h_GBps=55.0, h2d_GBps=48.0,
                 duplex_GBps=86.0, bus_GBps=330.0),
    "h200": dict(bf16_tflops=791.0, fp32_tflops=50.0, hbm_GBps=4800.0, d2h_GBps=55.0, h2d_GBps=55.0,
                 duplex_GBps=101.0, bus_GBps=330.0),
    "a100": dict(bf16_tflops=280.0, fp32_tflops=18.0, hbm_GBps=2039.0, d2h_GBps=25.0, h2d_GBps=24.0,
                 duplex_GBps=40.0, bus_GBps=230.0),
    "cpu": dict(bf16_tflops=1.0, fp32_tflops=1.0, hbm_GBps=20.0, d2h_GBps=20.0, h2d_GBps=20.0,
                duplex_GBps=20.0, bus_GBps=5.0),
}
DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "half": 2, "fp16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def optimizer_state_bytes(optimizer: str, params) -> int:
    """Bytes of ``optimizer``'s state for ``params``, ``(numel, element_size)`` of each trainable parameter."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    states, element = OPTIMIZER_STATES[optimizer]
    return sum(states * numel * (element or size) for numel, size in params)


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


def rates_for(gpu: str) -> Rates:
    """The :data:`GPUS` rates for ``gpu``: a key (``"h100"``) or a device name (``"NVIDIA H100 80GB HBM3"``)."""
    name = str(gpu or "h100").lower()
    key = next((k for k in GPUS if k in name), None)
    if key is None:
        raise ValueError(f"unknown gpu {gpu!r}; expected one of {', '.join(GPUS)} "
                         "(rates for others: measure on the GPU itself with profile(model_on_cuda, ...))")
    g = GPUS[key]
    return Rates(name=key, matmul_flops=g["bf16_tflops"] * 1e12, fp32_flops=g["fp32_tflops"] * 1e12,
                 hbm_Bps=g["hbm_GBps"] * 1e9, d2h_Bps=g["d2h_GBps"] * 1e9, h2d_Bps=g["h2d_GBps"] * 1e9,
                 duplex_Bps=g["duplex_GBps"] * 1e9, bus_Bps=g["bus_GBps"] * 1e9,
                 granularity=1 if key == "cpu" else 512)


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
class Collectives:
    """The collectives of one rank's training step (FSDP2 or DDP), as the time model charges them.

    Built by :func:`remat.planning.sharding.shard` (``kind="fsdp2"``) or
    :func:`remat.planning.replication.replicate` (``kind="ddp"``); :func:`remat.simulate` places
    them on one link beside the compute (see :mod:`remat.planning.simulator`). Sizes are the whole
    unsharded group's bytes; a ring all-gather or reduce-scatter moves ``(world - 1) / world`` of
    them over each GPU's link, an all-reduce twice that.

    Beside the link, three overheads land on the compute stream (fields below, all zero unless
    the builder sets them): copies into and out of the communication buffers at ``copy_Bps``, a
    fixed ``latency_s`` per collective, and compute slowed by ``contention`` while the link is busy.
    """

    world: int
    """Ranks in the group."""
    bus_Bps: float
    """Bus bandwidth of the link (nccl-tests' busbw), bytes/s."""
    gather_bytes: tuple
    """Per block: its parameters' bytes in the param dtype (one all-gather assembles them; 0 under DDP)."""
    reduce_bytes: tuple
    """Per block: FSDP2, its gradients' bytes in the reduce dtype (one reduce-scatter when its
    backward ends); DDP, the bytes of the buckets that fill during its backward (see ``buckets``)."""
    root_gather_bytes: int
    """The root's own parameters (embeddings, final norm, LM head): all-gathered once, before
    anything runs (FSDP2 never reshards the root after forward)."""
    root_reduce_bytes: int
    """Reduced after everything else: FSDP2, the root's gradients; DDP, the buckets that fill last."""
    reshard_after_forward: bool = True
    """Blocks are resharded after forward and all-gathered again for backward (FSDP2's default)."""
    bus_measured: bool = False
    """``bus_Bps`` was timed on the process group, not read from :data:`GPUS`."""
    kind: str = "fsdp2"
    """``"fsdp2"`` (all-gathers and reduce-scatters) or ``"ddp"`` (bucketed all-reduces)."""
    buckets: tuple = ()
    """DDP: per block, ``((fraction, bytes), ...)``: the all-reduces launched while its backward
    runs, each once that fraction of the backward has produced its bucket's last gradient."""
    copy_Bps: float = 0.0
    """Rate of the copies on the compute stream, bytes/s (read + write counted); 0: not charged."""
    contention: float = 0.0
    """Fraction by which compute slows while the link is busy beside it (NCCL's SMs and HBM traffic)."""
    latency_s: float = 0.0
    """Fixed seconds on the compute stream per collective (launch, and FSDP2's Python hooks)."""
    fwd_copy_bytes: tuple = ()
    """Per block: bytes copied on the compute stream in its forward (FSDP2: the all-gather's
    copy-in and copy-out)."""
    bwd_copy_bytes: tuple = ()
    """Per block: the same in its backward (FSDP2: the backward all-gather's copies and the
    reduce-scatter's copy-in; DDP: its gradients into the buckets)."""
    fwd_launches: tuple = ()
    """Per block: collectives launched in its forward (each costs ``latency_s``)."""
    bwd_launches: tuple = ()
    """Per block: collectives launched in its backward."""
    root_fwd_copy_bytes: int = 0
    """Copied with the root's all-gather, before anything runs."""
    root_bwd_copy_bytes: int = 0
    """Copied after the embeddings' backward, before the last reduction is launched."""
    root_fwd_launches: int = 0
    """Collectives launched before the first block (the root's all-gather)."""
    root_bwd_launches: int = 0
    """Collectives launched after the embeddings' backward."""
    final_copy_bytes: int = 0
    """Copied once every collective has ended (DDP: the reduced buckets back into the gradients)."""

    def seconds(self, nbytes: float) -> float:
        """Seconds of one all-gather or reduce-scatter of ``nbytes`` (the unsharded size)."""
        return nbytes * (self.world - 1) / self.world / self.bus_Bps if nbytes else 0.0

    def reduce_s(self, nbytes: float) -> float:
        """Seconds of one reduction of ``nbytes``: a reduce-scatter, or (DDP) an all-reduce, twice that."""
        return self.seconds(nbytes) * (2 if self.kind == "ddp" else 1)

    def copy_s(self, nbytes: float) -> float:
        """Seconds of copying ``nbytes`` (read + write) on the compute stream; 0 when not charged."""
        return nbytes / self.copy_Bps if nbytes and self.copy_Bps else 0.0

    def overhead_s(self, index: int) -> tuple:
        """(forward, backward) seconds block ``index`` adds to the compute stream: copies and launches."""
        def at(values):
            return values[index] if values else 0
        return (self.copy_s(at(self.fwd_copy_bytes)) + self.latency_s * at(self.fwd_launches),
                self.copy_s(at(self.bwd_copy_bytes)) + self.latency_s * at(self.bwd_launches))

    def root_overhead_s(self) -> tuple:
        """(before the first block, after the embeddings' backward, after every collective) seconds
        on the compute stream outside the blocks."""
        return (self.copy_s(self.root_fwd_copy_bytes) + self.latency_s * self.root_fwd_launches,
                self.copy_s(self.root_bwd_copy_bytes) + self.latency_s * self.root_bwd_launches,
                self.copy_s(self.final_copy_bytes))

    def window_s(self, link_s: float, compute_s: float, delay_s: float = 0.0) -> float:
        """Seconds beyond ``compute_s`` for a phase whose link work (``link_s``, on a link idle when
        the phase starts) runs beside it: compute slowed by ``contention`` while they overlap (from
        ``delay_s`` into the phase, when the work starts later), and then whatever of the link work
        is left. The delay shortens the overlap only: what ends after the phase is taken to have
        started early enough to be done by then (DDP's last bucket hides in the next backward)."""
        slowed = compute_s + self.contention * min(link_s, max(0.0, compute_s - delay_s))
        return max(link_s, slowed) - compute_s

    def total_s(self) -> float:
        """Seconds the link is busy in one step."""
        gathers = sum(self.gather_bytes) * (2 if self.reshard_after_forward else 1) + self.root_gather_bytes
        return self.seconds(gathers) + self.reduce_s(sum(self.reduce_bytes) + self.root_reduce_bytes)

    def block_exposed_s(self, index: int, fwd_s: float, bwd_s: float) -> float:
        """Seconds block ``index`` adds beyond its own forward and backward compute: its overheads on
        the compute stream (:meth:`overhead_s`) and, per :meth:`window_s`, the communication its
        compute slows for or fails to hide. FSDP2: the next block's all-gather runs during its
        forward, and during its backward the reduce-scatter of the block after it and (resharded)
        the all-gather of the block before it. DDP: its backward carries the all-reduces of the
        buckets that fill in it. Additive over blocks; :meth:`fixed_exposed_s` adds what no
        block's treatment changes. The sum is the simulator's when FSDP2 blocks are resharded after
        forward, and an upper bound when not (nothing waits in backward then, so a reduce-scatter's
        excess may hide later); for DDP an estimate (its all-reduces overlap it from when its first
        bucket fills, the later ones taken to follow at once; nothing waits for them before the end
        of the step): within about 1% of the simulator with several buckets a block."""
        n = len(self.gather_bytes)
        over_f, over_b = self.overhead_s(index)
        ahead = self.gather_bytes[index + 1] if index + 1 < n else 0
        behind = self.gather_bytes[index - 1] if index > 0 and self.reshard_after_forward else 0
        delay = 0.0
        if self.kind == "ddp":  # its buckets' all-reduces, from when the first one fills
            reduced = self.reduce_s(self.reduce_bytes[index])
            delay = self.buckets[index][0][0] * (bwd_s + over_b) if self.buckets and self.buckets[index] else 0.0
        else:
            reduced = self.reduce_s(self.reduce_bytes[index + 1]) if index + 1 < n else 0.0
        return (over_f + self.window_s(self.seconds(ahead), fwd_s + over_f)
                + over_b + self.window_s(reduced + self.seconds(behind), bwd_s + over_b, delay))

    def fixed_exposed_s(self, head) -> float:
        """The seconds outside the blocks' windows (``head``: a :class:`HeadCost`): the root's
        all-gather and its copies, the first block's all-gather beside the embeddings' forward, the
        last block's backward all-gather beside the head's backward, the first block's reduce-scatter
        beside the embeddings' backward and the root's copies, the last reduction (the root's
        reduce-scatter, DDP's last buckets) and the copies after it."""
        last = self.gather_bytes[-1] if self.gather_bytes and self.reshard_after_forward else 0
        first_gather = self.gather_bytes[0] if self.gather_bytes else 0
        first_reduce = self.reduce_bytes[0] if self.reduce_bytes and self.kind != "ddp" else 0
        before, after, final = self.root_overhead_s()
        return (self.seconds(self.root_gather_bytes) + before
                + self.window_s(self.seconds(first_gather), head.pre_fwd_s)
                + self.window_s(self.seconds(last), head.head_bwd_s)
                + after + self.window_s(self.reduce_s(first_reduce), head.pre_bwd_s + after)
                + self.reduce_s(self.root_reduce_bytes) + final)


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
