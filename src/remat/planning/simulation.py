"""What :func:`remat.planning.simulator.simulate` predicts for a plan: a :class:`Simulation`, and its timeline of :class:`Phase` s.

The records only: the peak (expected, and the bound whatever the offload copies' timing), the
step's seconds with the time lost to copies and collectives, and the phase by phase timeline
that reports, tables and plots read (:meth:`Simulation.stages`, :meth:`Simulation.peak_terms`).
How they are computed is :mod:`remat.planning.simulator`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional


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
    comm_s: float = 0.0    # time the GPU waited for collectives (FSDP2, DDP) before this phase
    overhead_s: float = 0.0  # collectives' copies, launches and contention charged in this phase


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """What :func:`simulate` predicts for one plan."""

    peak_bytes: int
    """Expected peak of the step (static included)."""
    step_s: float
    """Seconds of the step."""
    tokens_per_s: float
    """Tokens of the batch over ``step_s``."""
    peak_at: str
    """The phase where ``peak_bytes`` is reached."""
    static_bytes: int
    """Allocated before the step."""
    head: str
    """The head mode simulated."""
    chunk_tokens: Optional[int]
    """Its chunk size (chunked head), else None."""
    timeline: tuple = field(default=(), repr=False)
    """A :class:`Phase` per phase, in step order."""
    offload_bytes: int = 0
    """Bytes the offloaded blocks save for backward (moved or not)."""
    exposed_copy_s: float = 0.0
    """Step time lost waiting for copies."""
    bound_bytes: int = 0
    """Peak whatever the copy timing (>= ``peak_bytes``)."""
    bound_at: str = ""
    """The phase where ``bound_bytes`` is reached."""
    moved_bytes: int = 0
    """Bytes copied each way (expected)."""
    comm_s: float = 0.0
    """Seconds the collectives keep the link busy (FSDP2; 0 on one GPU)."""
    exposed_comm_s: float = 0.0
    """Step time spent waiting for collectives: not hidden behind compute."""
    comm_copy_s: float = 0.0
    """Seconds the compute stream spends copying into and out of the collectives' buffers."""
    comm_launch_s: float = 0.0
    """Seconds of the collectives' fixed cost per call (launch, hooks) on the compute stream."""
    comm_contention_s: float = 0.0
    """Seconds compute was slowed by collectives running beside it."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer's step, the last part of ``step_s`` (0 without an optimizer)."""

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
        head (loss forward and backward), backward (blocks and embeddings). A stage's seconds
        include the time its phases waited for collectives (``comm_s``, FSDP2 and DDP), the first
        one's too, and the collectives' overheads on the compute stream (``overhead_s``: copies,
        launches, contention)."""
        out = {}
        for stage, test in (("forward", lambda n: n.startswith("forward") and "head" not in n),
                            ("head", lambda n: "head" in n),
                            ("backward", lambda n: n.startswith("backward") and "head" not in n)):
            phases = [p for p in self.timeline if test(p.name)]
            if phases:
                out[stage] = {"seconds": phases[-1].end_s - (phases[0].start_s - phases[0].comm_s),
                              "peak_bytes": max(p.peak_bytes for p in phases),
                              "wait_s": sum(p.wait_s for p in phases),
                              "comm_s": sum(p.comm_s for p in phases),
                              "overhead_s": sum(p.overhead_s for p in phases)}
        return out
