"""``remat.simulate``: the peak memory and step time of one training step under a plan.

How: a pure walk over the profile (:mod:`remat.profiling.profiler`), phase by phase, in the order the
step runs: embeddings, each block's forward, the head's forward, the head's backward, each
block's backward in reverse, the embeddings' backward. It carries the live bytes from one
phase to the next and adds each phase's own peak on top:

- static: parameters, buffers, optimizer state (allocated before the step);
- forward of block i: what blocks 0..i-1 keep + the hidden state + block i's forward peak
  + the offloaded bytes the engine has not released yet;
- head: everything the blocks keep + the head's working set (logits, loss) + the same;
- backward of block i: what blocks 0..i-1 keep + gradients produced so far + block i's
  backward peak (its recompute included; its offloaded tensors are back) + the blocks
  prefetched for the backward after it + offloaded bytes of earlier blocks still on the GPU.

Block costs were measured alone, with their input and shared inputs (rotary tables) as
the zero; the head's in a step whose blocks keep nothing. The simulator rebases each on
the live set at that point, so the sum is exact for a sequential stack whatever mix of
treatments is chosen (every keep/full/selective/attention/mlp peak measured on an H200
matched to 0.0%).

Time: each phase takes its profiled seconds, which are effective times (measured in a
chain as a step runs them, or the roofline's), one after the other on the GPU; the host is
taken to run ahead of the GPU except where the offload engine makes it wait for copies,
and a phase whose data is still being copied waits for it.

Offload is a model of :class:`remat.offload.engine.OffloadEngine` (its docstring's "Memory the
engine adds"), with the copy rates of the profile's GPU:

- forward: a block's offloaded bytes are copied to the host on a side stream in the
  order they were saved (FIFO, at the device-to-host rate, not before the block computed
  them); the engine releases a copy's GPU memory at its next bookkeeping point (each
  offloaded block's end, and the start of the backward) once the copy has landed, and the
  host waits whenever more than ``window`` bytes are not released (which is what makes a
  forward of offloaded blocks bus bound). Copies still queued at the end of the forward
  (beyond the ``issue`` window) are never moved: they stay on the GPU until their block's
  backward.
- backward: a block's bytes come back (host-to-device, FIFO) when its backward starts,
  and ``prefetch`` blocks before it are fetched at the same time, so their copies overlap
  this block's backward; a block whose bytes have not arrived waits.

That gives an *expected* peak (``peak_bytes``: copies the engine has seen land by the time
the host reaches its next check are released), and a *bound* (``bound_bytes``) that holds
whatever the timing: the engine's own rule, :func:`remat.offload.engine.gpu_overhead_bytes`
(at most the window in forward and head; the prefetched block and the older part of the
forward's last window in backward). Without offload the two are equal. :mod:`remat.planning.solver`
keeps an upper bound of it (plus a margin) within the budget.

Limits: offload is modelled per block (a block's copies start when it starts and end no
earlier than its compute; the window is checked at the block's end, the engine checks it at
every saved tensor); as the host is taken to run ahead, the expected peak is usually the
bound, which is what an H200 measured (0.0-0.4% on three models, offload included). When
the window makes the host wait at every block, the GPU's queue drains and launch latency
shows; that is not charged (``full+offload`` ran 5-8% slower than predicted on two small
models). Optimizer steps and data loading are not in the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from remat.planning.plans import OFFLOADING_TREATMENTS, Plan


class Phase(NamedTuple):
    """One phase of the step, for tables and plots. Bytes are absolute (static included)."""

    name: str
    peak_bytes: int        # expected peak during the phase
    end_bytes: int         # live at its end
    start_s: float         # GPU clock
    end_s: float
    bound_bytes: int       # peak under the offload engine's window (== peak_bytes without offload)
    engine_bytes: int = 0  # offloaded bytes still on the GPU at the phase's peak (expected)
    wait_s: float = 0.0    # time the GPU or the host waited for copies in this phase
    carried_bytes: int = 0  # alive from earlier phases (static and engine bytes excluded)


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    step_s: float
    tokens_per_s: float
    peak_at: str
    static_bytes: int
    head: str
    chunk_tokens: Optional[int]
    timeline: tuple = field(default=(), repr=False)  # Phase per phase
    offload_bytes: int = 0        # bytes the offloaded blocks save for backward (moved or not)
    exposed_copy_s: float = 0.0   # step time lost waiting for copies
    bound_bytes: int = 0          # peak whatever the copy timing (>= peak_bytes)
    bound_at: str = ""
    moved_bytes: int = 0          # bytes copied each way (expected)

    def phases(self, kind: str = "all") -> list:
        """Phases whose name starts with ``forward`` / ``backward`` (``kind``), or all."""
        return [p for p in self.timeline if kind == "all" or p.name.startswith(kind)]

    def peak_terms(self) -> dict:
        """What the peak is made of: static, carried from earlier phases, the phase's own, engine."""
        top = next(p for p in self.timeline if p.name == self.peak_at)
        own = top.peak_bytes - self.static_bytes - top.carried_bytes - top.engine_bytes
        return {"static": self.static_bytes, "carried": top.carried_bytes, "phase": own, "engine": top.engine_bytes}

    def stages(self) -> dict:
        """Seconds and peak bytes of the step's three stages: forward (embeddings and blocks),
        head (loss forward and backward), backward (blocks and embeddings)."""
        out = {}
        for stage, test in (("forward", lambda n: n.startswith("forward") and "head" not in n),
                            ("head", lambda n: "head" in n),
                            ("backward", lambda n: n.startswith("backward") and "head" not in n)):
            phases = [p for p in self.timeline if test(p.name)]
            if phases:
                out[stage] = {"seconds": phases[-1].end_s - phases[0].start_s,
                              "peak_bytes": max(p.peak_bytes for p in phases),
                              "wait_s": sum(p.wait_s for p in phases)}
        return out


def block_treatments(profile, plan) -> list:
    """Treatments in block order from a Plan, a ``{name: treatment}`` mapping, a list or one name."""
    names = profile.block_names
    if isinstance(plan, str):
        return [plan] * len(names)
    if isinstance(plan, Plan):
        plan = plan.blocks
    if isinstance(plan, (list, tuple)):
        if len(plan) != len(names):
            raise ValueError(f"a plan as a list needs one treatment per block ({len(names)}), got {len(plan)}")
        return list(plan)
    if hasattr(plan, "get"):
        unknown = [n for n in plan if n not in names]
        if unknown:
            raise ValueError(f"plan names blocks the profile does not have: {unknown[:3]} "
                             f"(profiled blocks: {list(names[:3])} ...)")
        return [plan.get(name, "keep") for name in names]
    raise TypeError(f"plan must be a remat.Plan, a mapping, a list of treatments or a treatment name, "
                    f"got {type(plan).__name__}")


def offload_sizes(profile, treatments) -> list:
    """Bytes each block's treatment hands to the offload engine (0 for the others)."""
    return [profile.cost(i, t).offload_bytes if t in OFFLOADING_TREATMENTS else 0
            for i, t in enumerate(treatments)]


def window_bytes(profile, off) -> int:
    """The engine's window for a plan whose blocks offload ``off`` bytes (see the profile's engine)."""
    engine = profile.engine
    if engine.window_bytes is not None:
        return int(engine.window_bytes)
    return int(engine.window_records * max(off, default=0))


def engine_overhead(profile, off) -> dict:
    """The engine's bound per phase ("Memory the engine adds"): :func:`remat.offload.engine.gpu_overhead_bytes`."""
    if not any(off):
        n = len(off)
        return {"window": 0, "forward": [0] * n, "head": 0, "backward": [0] * n}
    try:
        from remat.offload.engine import gpu_overhead_bytes
    except ImportError as e:
        raise ValueError(f"a plan with offload treatments needs remat.offload.engine, which does not import: {e}") from e
    return gpu_overhead_bytes([int(o) for o in off], window_bytes(profile, off), profile.engine.prefetch_blocks)


class _Bus:
    """One copy direction: FIFO copies at a fixed rate; (bytes, start, end) per copy."""

    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = 0.0
        self.copies = []

    def copy(self, nbytes: int, ready: float, not_before: float = 0.0) -> float:
        start = max(self.free_at, ready)
        end = max(start + nbytes / self.rate, not_before)
        self.free_at = end
        self.copies.append((nbytes, start, end))
        return end

    def done_by(self, t: float) -> float:
        """Bytes whose copy has landed by ``t`` (linear within a copy)."""
        total = 0.0
        for nbytes, start, end in self.copies:
            if t >= end:
                total += nbytes
            elif t > start:
                total += nbytes * (t - start) / (end - start)
        return total

    def when_done(self, nbytes: float) -> float:
        """The time at which ``nbytes`` (counted from the first copy) have landed."""
        total = 0.0
        for size, start, end in self.copies:
            if total + size >= nbytes:
                return start + (end - start) * (nbytes - total) / size if size else end
            total += size
        return self.free_at


def simulate(profile, plan, *, head: Optional[str] = None, chunk_tokens: Optional[int] = None) -> Simulation:
    """Predicted peak bytes, step seconds and what sets the peak, for ``plan`` on ``profile``.

    ``head``/``chunk_tokens`` default to the plan's own (a Plan) or ``"plain"``.
    """
    treatments = block_treatments(profile, plan)
    if isinstance(plan, Plan):
        head = head or plan.head
        chunk_tokens = chunk_tokens or plan.chunk_tokens
    h = profile.head(head or "plain", chunk_tokens)
    costs = [profile.cost(i, t) for i, t in enumerate(treatments)]
    return _walk(profile, treatments, costs, h)


def _walk(profile, treatments, costs, h) -> Simulation:
    rates, engine, names = profile.rates, profile.engine, profile.block_names
    off = offload_sizes(profile, treatments)
    window = window_bytes(profile, off)
    overhead = engine_overhead(profile, off)
    static = profile.static_bytes
    timeline = []
    clock = {"host": 0.0, "gpu": 0.0}  # the host moves only when it waits for the engine's window

    def run(seconds, ready=0.0):
        """Run one phase once the GPU, the host and its data are ready; (start, waited for data)."""
        start = max(clock["gpu"], clock["host"], ready)
        waited = max(0.0, ready - max(clock["gpu"], clock["host"]))
        clock["gpu"] = start + seconds
        return start, waited

    def phase(name, peak, end, start, carried, bound=None, engine_bytes=0, wait=0.0):
        timeline.append(Phase(name, int(peak), int(end), start, clock["gpu"],
                              int(peak if bound is None else bound), int(engine_bytes), wait,
                              int(carried - static)))

    # ---- forward
    start, _ = run(h.pre_fwd_s)
    phase("forward: embeddings", static + h.pre_peak, static + h.pre_end, start, static)
    live = static + h.pre_end        # bytes on the GPU that the engine does not hold
    x_free = profile.hidden_bytes     # bytes freed when a block does not save its input
    d2h = _Bus(rates.d2h_Bps)
    packed, released = 0, 0.0         # offloaded bytes so far; released by the engine
    exposed = 0.0
    for i, c in enumerate(costs):
        held = packed - released
        bound = overhead["forward"][i]
        start, _ = run(c.fwd_s)
        wait = 0.0
        if off[i]:
            # ``offload`` saves over its whole forward, ``full+offload`` its input at the start
            d2h.copy(off[i], ready=start, not_before=clock["gpu"] if treatments[i] == "offload" else start)
            packed += off[i]
            if packed - d2h.done_by(clock["host"]) > window:   # the host waits for the oldest copies
                t = d2h.when_done(packed - window)
                wait = max(0.0, t - clock["gpu"])               # the GPU idles only once its queue ran dry
                clock["host"] = t
                clock["gpu"] = max(clock["gpu"], t)
            released = d2h.done_by(clock["host"])              # released at the block's end
        exposed += wait
        carried = live
        peak = live + c.fwd_peak
        live += c.kept + (0 if c.saves_input else -x_free) + c.out_alive - off[i]
        x_free = c.out_alive
        phase(f"forward of block {i} ({names[i]}, {treatments[i]})", peak + held, live + packed - released,
              start, carried, bound=peak + bound, engine_bytes=held, wait=wait)

    # ---- head: nothing is released until the backward starts
    held = packed - released
    bound = overhead["head"]
    extra = live - (static + h.pre_end)  # what the blocks keep beyond the stubbed run
    start, _ = run(h.head_fwd_s)
    top = static + extra + h.head_fwd_peak
    phase("forward: head and loss", top + held, static + extra + h.head_fwd_end + held, start, live,
          bound=top + bound, engine_bytes=held)
    start, _ = run(h.head_bwd_s)
    top = static + extra + h.head_bwd_peak
    phase("backward: head and loss", top + held, static + extra + h.head_bwd_end + held, start,
          static + extra + h.head_fwd_end, bound=top + bound, engine_bytes=held)

    # ---- backward
    # Bytes still queued at the end of the forward, newest first, beyond the ``issue_bytes``
    # being copied, were never issued: they stay on the GPU until their block's backward
    # (never moved). The first unpack releases the copies that landed (all, by then).
    never = [0.0] * len(costs)
    unissued = max(0.0, held - engine.issue_bytes)
    for j in reversed(range(len(costs))):
        never[j] = min(off[j], unissued)
        unissued -= never[j]
    h2d = _Bus(rates.h2d_Bps)
    arrives = {}       # offloaded block -> time its bytes are back on the GPU
    fetched = set()    # blocks fetched (their bytes on the GPU) and not yet done
    unpacked = False
    records = [j for j in range(len(costs)) if off[j]]
    moved = sum(o - n for o, n in zip(off, never))
    live = static + extra + h.head_bwd_end
    for i in reversed(range(len(costs))):
        c = costs[i]
        base = live - (c.kept + (profile.hidden_bytes if c.saves_input else 0) - off[i]) - c.out_bytes
        if off[i]:  # its first unpack makes it current: fetch it and the records before it
            unpacked = True
            earlier = [j for j in records if j < i][::-1][:engine.prefetch_blocks]
            begin = max(clock["gpu"], clock["host"])
            for j in [i] + earlier:
                if j not in fetched:
                    fetched.add(j)
                    arrives[j] = h2d.copy(off[j] - never[j], ready=begin) if off[j] > never[j] else begin
        start, wait = run(c.bwd_s, ready=arrives.get(i, 0.0))
        exposed += wait
        if unpacked:  # earlier blocks' bytes on the GPU: fetched ahead, or never moved
            held = sum(off[j] if j in fetched else never[j] for j in range(i))
        own = profile.hidden_bytes if c.saves_input else 0
        peak = base + c.bwd_peak + own
        what = "recompute + backward" if treatments[i] not in ("keep", "offload") else "backward"
        phase(f"backward of block {i} ({names[i]}, {treatments[i]}: {what})", peak + held, base + c.bwd_end + held,
              start, base + own, bound=peak + overhead["backward"][i], engine_bytes=held, wait=wait)
        fetched.discard(i)
        live = base + c.bwd_end
    # the stubbed run reached the embeddings' backward with ``head_bwd_end`` alive
    start, _ = run(h.pre_bwd_s)
    phase("backward: embeddings", live + h.pre_bwd_peak - h.head_bwd_end, live + h.pre_bwd_end - h.head_bwd_end,
          start, live - h.head_bwd_end)
    top = max(timeline, key=lambda p: p.peak_bytes)
    worst = max(timeline, key=lambda p: p.bound_bytes)
    step = clock["gpu"]
    return Simulation(top.peak_bytes, step, profile.tokens / step if step else 0.0, top.name, static,
                      h.mode, h.chunk_tokens, tuple(timeline), sum(off), exposed, worst.bound_bytes, worst.name,
                      int(moved))
