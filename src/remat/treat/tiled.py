"""Tiling along the sequence: a block's token-wise sub-modules hold one chunk of tokens at a time.

Checkpointing and offload act at block boundaries, so what a block holds *inside itself* while it
runs is the floor of any plan: at long sequences the MLP's intermediates (three tensors of
sequence x intermediate size), the norms' fp32 copies and the projections. A token-wise
sub-module (an MLP, a norm: every output row depends only on the same input row) can instead run
over the sequence a chunk of rows at a time; then its intermediates exist one chunk at a time, in
forward, in recompute and in backward.

This module is the apply side: :func:`install_tiling` patches each tiled sub-module's ``forward``
(through :mod:`remat.treat.patches`) with :func:`_tiled_forward`, which hands the call to the chunk
loop, eager or compiled. The parts, one job each:

- :mod:`remat.treat.tile_targets`: which sub-modules are token-wise, checked before any change;
- :mod:`remat.treat.tile_function`: the autograd function that runs the chunks and recomputes them
  in backward, and its compiled form;
- :mod:`remat.treat.tile_replay`: dropout drawn once over the sequence, exact under tiling;
- :mod:`remat.treat.tile_records`: outputs recorded through hooks (MoE router logits);
- :mod:`remat.treat.tile_skip`: a checkpoint's recompute skips tiled outputs nothing reads.

Composition: ``tiled`` leaves the rest of the block as it is (attention's saved tensors are
kept); ``full+tiled`` checkpoints the block, whose recompute then runs the tiled sub-modules
again (their forward, in chunks, saving only their inputs), and ``full+offload+tiled`` also moves
the checkpoint's input to host memory.

Limits: the sub-module must take one tensor (the hidden states) and return one tensor; a call
with more is refused when it runs (:class:`~remat.treat.refusals.StepRefusal`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from remat.treat import patches
from remat.treat.refusals import StepRefusal
from remat.treat.tile_function import compiled_chunks, eager_chunks, sampled_chunks
from remat.treat.tile_skip import CheckpointedCall
from remat.treat.tile_targets import DEFAULT_TILE_TOKENS, check_tile_tokens, check_tiling, tiled_targets

__all__ = ["DEFAULT_TILE_TOKENS", "CheckpointedCall", "check_tile_tokens", "check_tiling", "install_tiling",
           "remove_tiling", "sampled_chunks", "tile_tokens_of", "tiled_targets"]

_TAG = "tiled"


def install_tiling(block: nn.Module, tokens: Optional[int]) -> None:
    """Run ``block``'s token-wise sub-modules a chunk of ``tokens`` rows at a time (see the module doc)."""
    check_tile_tokens(tokens)
    check_tiling(block)
    for _, target in tiled_targets(block):
        if patches.patch_of(target, "forward", tag=_TAG) is None:  # shared by two blocks: once
            patches.install(target, "forward", _tiled_forward, tag=_TAG, bound=True,
                            state=tokens or DEFAULT_TILE_TOKENS)


def remove_tiling(block: nn.Module) -> None:
    patches.remove(block, tag=_TAG)


def tile_tokens_of(block: nn.Module) -> Optional[int]:
    """The chunk size ``block``'s tiled sub-modules run with, or None when it is not tiled."""
    found = [p.state for p in patches.patches(block, tag=_TAG)]
    return found[0] if found else None


def _tiled_forward(patch: patches.Patch, *args, **kwargs):
    module = patch.module
    if not torch.is_grad_enabled() or len(args) + len(kwargs) != 1:
        if torch.is_grad_enabled():
            raise StepRefusal(
                f"a tiled {type(module).__name__} must be called with the hidden states alone; it got "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments. Use 'full' or 'mlp' for "
                "this block instead of a tiled treatment.")
        return patch.call_previous(*args, **kwargs)
    hidden = args[0] if args else next(iter(kwargs.values()))
    key = None if args else next(iter(kwargs))
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError(f"a tiled {type(module).__name__} takes a [..., tokens, features] tensor; got "
                         f"{type(hidden).__name__}{getattr(hidden, 'shape', '')}")

    def run(chunk):
        out = patch.call_previous(chunk) if key is None else patch.call_previous(**{key: chunk})
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"a tiled {type(module).__name__} must return one tensor; it returned "
                             f"{type(out).__name__} (an MoE returning router logits?). Use 'full' or 'mlp' "
                             "for this block instead of a tiled treatment.")
        return out
    if torch.compiler.is_compiling() and not any(m._forward_hooks for m in module.modules()):
        return compiled_chunks(run, patch.state, hidden)
    return eager_chunks(module, run, patch.state, hidden)
