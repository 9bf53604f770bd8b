"""A plan resolved once into what each block gets: the records :mod:`remat.treat` applies.

Why: a treatment's name packs several decisions (``"full+offload+tiled"``: checkpoint the block,
send what the checkpoint keeps to the host, run its token-wise sub-modules a chunk at a time;
``"segment:3"``: one of the run of blocks numbered 3, recomputed together). Read where it is
applied, every consumer had to ask this package again what the name means (is it a treatment,
which segment, what is left once the tiling is taken off). Here a plan becomes one
:class:`BlockRecord` per block, in block order, with each decision a field, copied from the
treatment's row of :data:`~remat.planning.plans.TABLE`; ``remat.apply`` and the profiler hand
records down and :mod:`remat.treat` reads the fields, never the name.

Pure: names and numbers, as the rest of :mod:`remat.planning`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from remat.planning.plans import KERNELS, TABLE, TREATMENTS, Plan, segment_of


@dataclass(frozen=True)
class BlockRecord:
    """One block's treatment, every decision in it a field (a row of :data:`~remat.planning.plans.TABLE`,
    or a segment's place), built by keyword: :func:`block_record` fills them from the name."""

    treatment: str
    """As the plan names it (``"full+offload+tiled"``, ``"segment:3"``): what :func:`remat.api.treatments` reports."""
    name: str = ""
    """The block's name in the model (empty for a record made for one block alone)."""
    index: int = 0
    """The block's place among the model's blocks: the offload engine's key for it."""
    checkpoint: bool = False
    """Its forward runs under a checkpoint and is recomputed in backward (with :attr:`submodule`, that
    sub-module's; with :attr:`segment`, the segment's run of blocks as one)."""
    submodule: Optional[str] = None
    """The checkpoint wraps each sub-module of this kind (``attention``, ``mlp``), not the block."""
    keeps: Optional[str] = None
    """The checkpoint's op-level policy, the ops whose outputs it keeps: ``matmuls`` (``selective``),
    ``attention`` (``attn-saved``), or None (it keeps the inputs alone)."""
    offload: bool = False
    """Its saved tensors go to the host (the offload engine); with :attr:`checkpoint`, the checkpoint's inputs."""
    tiled: bool = False
    """Its token-wise sub-modules run a chunk of tokens at a time."""
    tile_tokens: Optional[int] = None
    """Tokens per chunk of a tiled block (None: the tiling's default)."""
    segment: Optional[int] = None
    """The number of the segment the block is in (the run of blocks checkpointed as one), or None."""
    position: int = 0
    """Its place in its segment."""
    segment_size: int = 0
    """Blocks in its segment."""
    kernel: str = "stock"
    """Which implementation its norms, gated MLP and rotary embedding run: ``stock`` (the model's own
    modules) or ``liger`` (:mod:`remat.treat.kernels`), as the plan's :meth:`~remat.planning.plans.Plan.kernel_of` says."""


def block_record(treatment, *, name: str = "", index: int = 0, tile_tokens: Optional[int] = None,
                 kernel: str = "stock") -> BlockRecord:
    """The record of one block treated as ``treatment`` (a segment's member alone: position 0 of 1), with
    ``kernel`` (one of :data:`~remat.planning.plans.KERNELS`); ValueError for a name that is no treatment
    or kernel.

    Example: ``block_record("full+offload")`` has ``checkpoint`` and ``offload`` set, the rest as ``keep``'s."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    number = segment_of(treatment)
    if number is not None:
        return BlockRecord(treatment=treatment, name=name, index=index, checkpoint=True, segment=number, segment_size=1,
                           kernel=kernel)
    row = TABLE.get(treatment) if isinstance(treatment, str) else None
    if row is None:
        raise ValueError(f"unknown treatment {treatment!r}; expected one of {', '.join(TREATMENTS)} "
                         "or 'segment:<i>'")
    return BlockRecord(treatment=treatment, name=name, index=index, checkpoint=row.checkpoint,
                       submodule=row.submodule, keeps=row.keeps, offload=row.offload, tiled=row.tiled,
                       tile_tokens=tile_tokens if row.tiled else None, kernel=kernel)


def block_records(plan: Plan, block_names) -> tuple:
    """One :class:`BlockRecord` per name of ``block_names``, in order (blocks the plan does not name
    are ``keep``), each segment's members numbered by position with the segment's size, each tiled
    block with its own chunk size (:meth:`Plan.tile_of`) and kernels (:meth:`Plan.kernel_of`)."""
    names = list(block_names)
    records = [block_record(plan.blocks.get(name, "keep"), name=name, index=index, tile_tokens=plan.tile_of(name),
                            kernel=plan.kernel_of(name))
               for index, name in enumerate(names)]
    members = {}
    for index, record in enumerate(records):
        if record.segment is not None:
            members.setdefault(record.segment, []).append(index)
    for indices in members.values():
        for position, index in enumerate(indices):
            records[index] = replace(records[index], position=position, segment_size=len(indices))
    return tuple(records)
