"""The profiling request: every setting one ``remat.profile`` call measures with, built once, handed down.

How: :func:`remat.profiling.profiler.profile` checks its arguments, resolves the defaults that depend
on the machine (the GPU's rates and copy rates, the offload engine's smallest tensor, the compile
backend) and freezes them in one :class:`ProfileRequest`. Every run below it (the fake and CUDA paths,
the block classes per treatment, the head per mode, one block's run) takes the request instead of its
own list of settings, and reads the fields it needs. The long-context path changes one field (the
rates, with the attention measured on the GPU) with :func:`dataclasses.replace`.

Why a frozen record rather than keyword arguments at each level: ten to fourteen settings passed
through five signatures make an option an edit to all five (and to every test that calls one); here
an option is one field and the line that reads it. Frozen, so a run deep in the profile cannot
change what the runs after it measure.

Limits: what a run measures *on* (the model, its batch and loss, its blocks, the meter) is not a
setting and stays an argument; so do the notes a run writes (``skipped``), which are the profile's
output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from remat.planning.costs import CHUNK_CANDIDATES, TILE_CANDIDATES, Rates


def _silent(message: str) -> None:
    """The ``say`` of a profile asked for no progress."""


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What a profile measures and how (see the module doc)."""

    rates: Rates
    """The GPU's rates: a fake profile prices every op with them; a CUDA profile carries the measured
    copy rates with that GPU's others."""
    optimizer: str = "none"
    """The optimizer whose states and step are counted (:data:`~remat.planning.costs.OPTIMIZER_STATES`)."""
    head_modes: tuple = ("plain", "chunked")
    """The head modes measured, in order (``"liger"`` is added where Liger's kernels are asked)."""
    chunk_candidates: tuple = CHUNK_CANDIDATES
    """The chunked head's chunk sizes (none above the step's tokens: :func:`~remat.profiling._head._chunk_options`)."""
    tile_candidates: tuple = TILE_CANDIDATES
    """The chunk sizes the tiled treatments are measured at besides the default (those below the step's tokens)."""
    min_offload_bytes: int = 2**20
    """The smallest saved tensor the offload engine moves: what ``offloadable`` counts."""
    kernels: tuple = ()
    """The kernels each block class is measured with besides its own (``("stock", "liger")``; empty: as it is)."""
    calibrate: bool = True
    """On a GPU: one real step scales the profiled seconds to in-step ones."""
    scope: Optional[str] = None
    """The compile scope (``"model"``, ``"blocks"``), or None for eager."""
    backend: Optional[str] = None
    """The ``torch.compile`` backend the compiled runs use (with ``scope``), else None."""
    repeats: int = 1
    """Runs per timing after the warm one: 1 on fake tensors (a roofline needs one), more on a GPU."""
    say: Callable[[str], None] = _silent
    """Told each stage as it starts (the ``progress=`` callback)."""

    @property
    def head_backend(self) -> Optional[str]:
        """The backend the head's runs compile with: the blocks' under ``scope="model"``, None (eager)
        under ``"blocks"``, where only the blocks are compiled."""
        return self.backend if self.scope == "model" else None
