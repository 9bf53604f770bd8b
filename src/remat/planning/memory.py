"""The step's live bytes: one formula, shared by the simulator and the solver.

How: every phase's bytes are written as a sum whose only plan-wide part is what the blocks
before it keep. With ``K_i`` the bytes blocks ``0..i-1`` add to the live set during the
forward and ``L_i`` what blocks ``i+1..`` leave after their backward (parameter gradients, the
input gradient, less the input they free):

- forward of block ``i``: ``static + pre_end + K_i + forward_i``;
- the head's forward and backward: ``static + K_n + `` the head's own numbers (measured in a
  step whose blocks keep nothing, so they are absolute there);
- backward of block ``i``: ``static + head_bwd_end + K_i + L_i + backward_i``;
- the embeddings' backward: ``static + L_{-1} + pre_bwd_peak``;
- the optimizer's step: ``static + L_{-1} + pre_bwd_end + `` its temporaries (every gradient is
  alive; the states are in ``static``).

:func:`block_terms` gives a block's parts (``kept``, ``forward``, ``carried``, ``backward``,
``left``) from its :class:`~remat.planning.costs.BlockCost` and the block before it (whose output
is the input a block frees when it does not save it). :class:`LiveBytes` adds them up along one
plan, phase by phase, for :mod:`remat.planning.simulator` (exactly) and for the solver's check of
one plan; the solver's dynamic programme uses the same terms per (previous, current) treatment,
with ``K_i`` its state and ``L_i`` bounded by the largest leftover per block.

Why this decomposition rather than a running total: the dynamic programme can only carry
``K_i`` from block to block, so the simulator is written in the same terms, and a plan's
bytes agree between the two by construction rather than by a test of two copies.

Limits: bytes the offload engine holds for other blocks are not in these sums
(:mod:`remat.planning.offload_model` bounds them; the simulator adds what it expects); blocks
are a sequential stack, each block's input being the previous block's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class BlockTerms:
    """One block's parts of the step's live bytes (see the module doc); may be negative."""

    kept: int
    """Added to the live set by its forward: what it saves, its output's own bytes, less the
    input it frees when it does not save it and the bytes it hands to the offload engine."""
    forward: int
    """Its forward peak above the live set before it."""
    carried: int
    """Live at its backward's start above ``K_i + L_i``: its output's gradient replaces its
    output, its saved input is still there."""
    backward: int
    """Its backward's peak above ``K_i + L_i``, recompute included."""
    left: int
    """Live after its backward above ``K_i + L_i``: parameter gradients and the input
    gradient, less the input."""


def freed_input(previous, hidden_bytes: int) -> int:
    """Bytes freed when a block does not save its input: the previous block's output, or the
    embeddings' hidden state for the first block (``previous`` None)."""
    return hidden_bytes if previous is None else previous.out_alive


def input_bytes(previous, hidden_bytes: int) -> int:
    """The bytes of a block's input: the previous block's output (blocks may change shape: CNN
    stages, UNet levels), or the embeddings' hidden state for the first block."""
    return hidden_bytes if previous is None else previous.out_bytes


def block_terms(cost, freed: int, own_input_bytes: int, offloaded: int = 0) -> BlockTerms:
    """The parts of ``cost`` (a BlockCost) whose input (``own_input_bytes``, see
    :func:`input_bytes`), when not saved, frees ``freed`` bytes; ``offloaded``: the bytes its
    treatment hands to the offload engine."""
    own_input = own_input_bytes if cost.saves_input else 0
    frees = 0 if cost.saves_input else freed
    carried = cost.out_alive - cost.out_bytes - frees
    return BlockTerms(kept=cost.kept - frees + cost.out_alive - offloaded, forward=cost.fwd_peak,
                      carried=carried, backward=carried + cost.bwd_peak,
                      left=carried - own_input + cost.bwd_end)


@dataclass(frozen=True)
class Bytes:
    """One phase: bytes alive from earlier phases, its peak and what it leaves (static included)."""

    carried: int
    peak: int
    end: int


class LiveBytes:
    """The live set along one plan, phase by phase, from :class:`BlockTerms` (see the module doc).

    Call :meth:`forward` for each block in order, then :meth:`head_forward`,
    :meth:`head_backward`, :meth:`backward` for each block in reverse, then :meth:`embeddings`
    and :meth:`optimizer_step`. ``static``: bytes allocated before the step; ``head``: the
    HeadCost of the head mode; ``step_temp``: what the optimizer's step allocates above the
    parameters, gradients and states (``Profile.optimizer_temp_bytes``).
    """

    def __init__(self, static: int, head, step_temp: int = 0):
        self.static = static
        self.head = head
        self.step_temp = step_temp
        self.kept = 0          # K: added by the blocks whose forward ran
        self.before = []       # K_i per block
        self.left = 0          # L: left by the blocks whose backward ran

    def forward_base(self) -> int:
        """The forward phases' bytes besides ``K_i`` and the block's own."""
        return self.static + self.head.pre_end

    def backward_base(self) -> int:
        """The backward phases' bytes besides ``K_i + L_i`` and the block's own."""
        return self.static + self.head.head_bwd_end

    def head_peak(self) -> int:
        """The head's peak (forward or backward) besides ``K_n``."""
        return self.static + max(self.head.head_fwd_peak, self.head.head_bwd_peak)

    def forward(self, terms: BlockTerms) -> Bytes:
        carried = self.forward_base() + self.kept
        self.before.append(self.kept)
        self.kept += terms.kept
        return Bytes(carried, carried + terms.forward, carried + terms.kept)

    def embeddings_forward(self) -> Bytes:
        return Bytes(self.static, self.static + self.head.pre_peak, self.static + self.head.pre_end)

    def head_forward(self) -> Bytes:
        base = self.static + self.kept
        return Bytes(base + self.head.pre_end, base + self.head.head_fwd_peak, base + self.head.head_fwd_end)

    def head_backward(self) -> Bytes:
        base = self.static + self.kept
        return Bytes(base + self.head.head_fwd_end, base + self.head.head_bwd_peak, base + self.head.head_bwd_end)

    def backward(self, index: int, terms: BlockTerms) -> Bytes:
        base = self.backward_base() + self.before[index] + self.left
        self.left += terms.left
        return Bytes(base + terms.carried, base + terms.backward, base + terms.left)

    def embeddings(self) -> Bytes:
        base = self.static + self.left
        return Bytes(base, base + self.head.pre_bwd_peak, base + self.head.pre_bwd_end)

    def optimizer_step(self) -> Bytes:
        """The optimizer's step, after the backward: what the step left, plus its temporaries."""
        base = self.static + self.left + self.head.pre_bwd_end
        return Bytes(base, base + self.step_temp, base)


def plan_terms(profile, costs, offloaded: Optional[list] = None) -> list:
    """:class:`BlockTerms` of each block of a plan (``costs``: a BlockCost per block, in order)."""
    offloaded = offloaded or [0] * len(costs)
    out, previous = [], None
    for cost, off in zip(costs, offloaded):
        out.append(block_terms(cost, freed_input(previous, profile.hidden_bytes),
                               input_bytes(previous, profile.hidden_bytes), off))
        previous = cost
    return out
