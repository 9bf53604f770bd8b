"""What a profile holds: per-block and head costs, device rates, and the numbers behind them.

How: plain frozen dataclasses. :class:`Profile` is what :func:`remat.profile` returns and
what :func:`remat.simulate` and :func:`remat.solve` read: per block class a
:class:`BlockCost` for each treatment, a :class:`HeadCost` per head mode, the static bytes
and the :class:`Rates` the seconds were computed or measured with. :data:`GPUS` holds the
rates a fake (CPU-only) profile prices ops with; :class:`EngineModel` is what the
simulator assumes of the offload engine.

Why apart from the profiler: the simulator, the solver and the reports only need these
numbers, never the meters that fill them; importing this module imports neither torch nor
the measuring code (:func:`engine_model` reads :mod:`remat.offload.engine` when called).

Limits: the GPU rates are fixed anchors (measured once, not datasheet numbers); a profile
taken on a GPU replaces the copy rates by its own measurement and marks itself
``measured``. Bytes are what the meters read (see :mod:`remat.profiling.profiler`), not a model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

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
    """What :mod:`remat.planning.simulator` assumes of :class:`remat.offload.engine.OffloadEngine` (its defaults).

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


def engine_model() -> EngineModel:
    """The offload engine's defaults as :class:`EngineModel` (see "Memory the engine adds" there)."""
    try:
        from remat.offload import engine as offload
    except ImportError:
        return EngineModel()
    return EngineModel(window_bytes=None, window_records=int(offload.DEFAULT_WINDOW_RECORDS),
                       issue_bytes=int(offload._ISSUE_WINDOW), prefetch_blocks=1)


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
