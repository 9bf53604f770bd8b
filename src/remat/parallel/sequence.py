"""One rank's share of a batch whose sequence is split over a context-parallel (CP) group.

    local = shard_sequence(batch, group)     # every rank holds the whole batch; each keeps its share
    with context_parallel(model, group):     # remat.parallel.attention
        loss = model(**local).loss           # this rank's share of the loss of the whole sequence
        loss.backward()

How: the sequence of ``S`` tokens is cut into ``2 x world`` chunks and rank ``r`` keeps chunks ``r``
and ``2 world - 1 - r`` (a head and a tail) of every tensor whose second dimension is the sequence:
the head-tail ("zigzag") layout of torch's ``context_parallel``, so that under causal attention
every rank attends to the same number of keys. ``balance=False`` cuts ``world`` contiguous pieces
instead (the last rank then does the most work). Every rank and ``context_parallel`` must use the
same layout (both default to the balanced one).

Done to the whole batch before it is cut, because after the cut no rank could do it:

- labels are shifted (``shift_labels``, cut like the ids, passed as ``labels`` and ``shift_labels``);
  shifting each piece instead would drop the target of every piece's last token;
- ``num_items_in_batch`` counts the whole sequence's targets, so the ranks' losses (and gradients)
  sum to the whole sequence's (:func:`remat.parallel.reduce_gradients` for a replicated model);
- ``position_ids`` are the global positions of the rank's tokens (:func:`positions`).

A balanced share's positions jump from head to tail, which transformers reads as packed sequences
and answers with a mask no CP attention can take; so it carries a 2-D ``attention_mask`` of ones,
transformers builds no mask, and the CP attention applies the causal mask of the permuted positions.

Refused before anything is touched (ValueError, naming what to do): a sequence not divisible by
``2 x world`` (or ``world``), a padding mask, a 4-D mask, packed ``position_ids``, and with
``model=`` a model whose attention is not SDPA (:func:`check_model`). More: ``docs/design/treatments.md``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from remat.parallel.groups import rank_and_world

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "inputs_embeds")
_LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")


def shard_sequence(batch: dict, group=None, *, model: Optional[nn.Module] = None, balance: bool = True) -> dict:
    """This rank's share of ``batch``, whose sequence is split over ``group`` (see the module doc).

    Args:
        batch: a dict of a causal LM's inputs for the whole sequence, the same on every rank.
        group: the CP process group, a 1-D ``DeviceMesh``, or None for the default group.
        model: also checked (:func:`check_model`), or None.
        balance: the head-tail layout (default) or contiguous pieces (False); pass the same to
            :func:`remat.parallel.context_parallel`.

    Returns:
        A new dict of the rank's share (at world 1, the batch's entries as given): its tokens, shifted
        labels (``labels`` and ``shift_labels``), the whole batch's ``num_items_in_batch``, the
        tokens' global ``position_ids``.

    Raises:
        TypeError: ``batch`` is not a dict.
        ValueError: what :func:`check_batch` or :func:`check_model` refuses."""
    rank, world = rank_and_world(group)
    return shard_for(batch, rank, world, model=model, balance=balance)


def shard_for(batch: dict, rank: int, world: int, *, model: Optional[nn.Module] = None, balance: bool = True) -> dict:
    """:func:`shard_sequence` for rank ``rank`` of ``world``, without a process group.

    The planner profiles rank 0's share; tests build every rank's.

    Args:
        batch, model, balance: as for :func:`shard_sequence`.
        rank: the rank whose share to cut; world: the CP degree.

    Returns:
        That rank's share, as :func:`shard_sequence` returns it.

    Raises:
        ValueError: ``world`` is not a whole number >= 1 or ``rank`` not one of its ranks; what
            :func:`shard_sequence` raises."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the context-parallel degree must be a whole number >= 1, got {world!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not one of the {world} context-parallel ranks")
    sequences, length = check_batch(batch, world, balance=balance)
    if model is not None:
        check_model(model)
    if world == 1:
        return dict(batch)
    spans = layout(rank, world, length, balance=balance)

    def cut(value):
        if len(spans) == 1:
            return value[:, spans[0][0]:spans[0][1]].contiguous()
        return torch.cat([value[:, start:end] for start, end in spans], dim=1)
    out = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids") + _LOSS_KEYS:
            continue  # checked above; rebuilt below
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            out[key] = cut(value)
        else:
            out[key] = value
    device = batch[_sequence_key(batch)].device
    out["position_ids"] = tag_layout(positions(rank, world, length, balance=balance, device=device)
                                     .unsqueeze(0).expand(sequences, -1), rank, world, balance)
    if balance:  # positions with a jump: without a mask transformers would take them for packed sequences
        out["attention_mask"] = torch.ones(sequences, length // world, dtype=torch.long, device=device)
    shift = _shifted_labels(batch)
    if shift is not None:
        local = cut(shift)  # contiguous: the loss views it flat
        out["labels"] = local
        out["shift_labels"] = local
        total = batch.get("num_items_in_batch")
        out["num_items_in_batch"] = total if total is not None else int((shift != IGNORE_INDEX).sum())
    return out


def layout(rank: int, world: int, length: int, *, balance: bool = True) -> list:
    """The ``(start, end)`` spans of the whole sequence of ``length`` tokens that rank ``rank`` of
    ``world`` holds, in the order it holds them: its head and tail chunk (``balance``), or its one
    contiguous piece."""
    if world == 1:
        return [(0, length)]
    if balance:
        c = length // (2 * world)
        return [(rank * c, (rank + 1) * c), ((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    s = length // world
    return [(rank * s, (rank + 1) * s)]


def positions(rank: int, world: int, length: int, *, balance: bool = True, device=None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in the order the rank holds them.

    Args:
        rank, world: the rank and the CP degree.
        length: tokens in the whole sequence.
        balance: the head-tail layout (default) or contiguous pieces.
        device: where to make the tensor.

    Returns:
        A 1-D tensor: the ``position_ids`` :func:`shard_for` hands the model, and what the CP attention
        builds its causal mask from."""
    return torch.cat([torch.arange(start, end, device=device)
                      for start, end in layout(rank, world, length, balance=balance)])


LAYOUT_TAG = "_remat_cp_layout"
"""The attribute :func:`shard_for` sets on the ``position_ids`` it makes: ``(rank, world, balance)``,
read by :func:`remat.parallel.context_parallel` to check that it splits attention the same way
without reading the tensor (no device sync)."""


def tag_layout(position_ids: torch.Tensor, rank: int, world: int, balance: bool) -> torch.Tensor:
    setattr(position_ids, LAYOUT_TAG, (rank, world, bool(balance)))
    return position_ids


def check_batch(batch, world: int, *, balance: bool = True) -> tuple:
    """Check that CP can cut ``batch`` into ``world`` shares (of two chunks each with ``balance``).

    Returns:
        ``(sequences, tokens)`` of the batch.

    Raises:
        TypeError: ``batch`` is not a dict of a causal LM's inputs.
        ValueError: a length that does not divide, a padding or 4-D mask, packed ``position_ids``,
            labels of another shape than the ids."""
    if not isinstance(batch, dict):
        raise TypeError(f"context parallelism shards a dict batch of a causal LM's inputs (input_ids, labels ...), "
                        f"got {type(batch).__name__}")
    key = _sequence_key(batch)
    sequences, length = int(batch[key].shape[0]), int(batch[key].shape[1])
    chunks = 2 * world if balance and world > 1 else world
    if length % chunks:
        up = -(-length // chunks) * chunks
        how = (f" balanced ({chunks} chunks of equal length, a head and a tail a rank; balance=False needs a multiple "
               f"of {world} only)" if chunks != world else "")
        raise ValueError(
            f"a sequence of {length} tokens cannot be split evenly over {world} context-parallel ranks{how}: pad it on "
            f"the right to a multiple of {chunks} (e.g. {up} tokens) with labels -100 (under causal attention tokens "
            "padded at the end change nothing before them), or change the CP degree")
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"context parallelism cannot shard a {shape} attention_mask: each rank's attention is causal over "
                "the whole sequence (SDPA's is_causal), which a 4-D or custom mask would replace; pass no mask, or a "
                "2-D mask of ones")
        if not bool((mask != 0).all()):
            raise ValueError(
                "context parallelism cannot shard a padding mask (attention_mask has zeros): ring attention runs "
                "SDPA with is_causal and no mask. Pack or trim the batch so that nothing is padded, or pad on the "
                "right with labels -100 and pass no attention_mask (causal attention never looks at later tokens)")
    positions = batch.get("position_ids")
    if positions is not None:
        expected = torch.arange(length, device=positions.device)
        if positions.shape[-1] != length or not bool((positions == expected).all()):
            raise ValueError(
                "context parallelism takes position_ids 0 .. S-1 only (or none): other positions mean packed "
                "sequences, for which transformers builds a block-diagonal mask CP attention cannot take; train on "
                "one sequence a row, or leave position_ids out")
    labels = batch.get("shift_labels", batch.get("labels"))
    if labels is not None and (not isinstance(labels, torch.Tensor) or tuple(labels.shape[:2]) != (sequences, length)):
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a tensor of the ids' shape {(sequences, length)} to be split with them, "
                         f"got {got}")
    return sequences, length


def check_model(model: nn.Module) -> None:
    """Refuse a model whose attention does not run through ``scaled_dot_product_attention``.

    For a Hugging Face model, every config's ``attn_implementation`` must be ``"sdpa"`` (eager
    attention computes its softmax itself, flash-attention calls its own kernels: neither reaches the
    SDPA that CP replaces). A model without a config cannot be checked here;
    :func:`remat.parallel.attention.context_parallel` refuses it at the end of a forward that ran no SDPA.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an attention implementation other than ``"sdpa"``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expects a torch.nn.Module, got {type(model).__name__}")
    for name, implementation in attention_implementations(model):
        if implementation != "sdpa":
            where = f" ({name})" if name else ""
            raise ValueError(
                f"context parallelism replaces torch.nn.functional.scaled_dot_product_attention, but "
                f"{type(model).__name__}{where} uses attn_implementation={implementation!r}, whose attention never "
                "calls it: load the model with attn_implementation=\"sdpa\" (from_pretrained(..., "
                "attn_implementation=\"sdpa\"), or model.set_attn_implementation(\"sdpa\"))")


def attention_implementations(model: nn.Module) -> list:
    """``(config name, attn_implementation)`` of every Hugging Face config in ``model`` (sub-configs
    such as ``text_config`` included); empty for a model without one."""
    config = getattr(model, "config", None)
    found, seen = [], set()

    def walk(cfg, name):
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "to_dict"):
            return
        seen.add(id(cfg))
        implementation = getattr(cfg, "_attn_implementation", None)
        if implementation is not None:
            found.append((name, implementation))
        for key in getattr(cfg, "sub_configs", {}) or {}:
            walk(getattr(cfg, key, None), key)
    walk(config, "")
    return found


def _sequence_key(batch: dict) -> str:
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return key
    raise ValueError(f"context parallelism needs input_ids (or inputs_embeds) of shape [batch, seq] in the batch, "
                     f"got keys {sorted(batch)}")


def _shifted_labels(batch: dict) -> Optional[torch.Tensor]:
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if labels is None:
        return None
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)
