"""One rank's share of a batch whose sequence is split over a context-parallel (CP) group.

    local = shard_sequence(batch, group)     # every rank holds the whole batch; each keeps its share
    with context_parallel(model, group):     # remat.parallel.attention
        loss = model(**local).loss           # this rank's share of the loss of the whole sequence
        loss.backward()

How: the sequence of ``S`` tokens is cut into ``world`` contiguous pieces of ``S / world`` tokens,
rank ``r`` keeping tokens ``[r * S / world, (r + 1) * S / world)`` of every tensor whose second
dimension is the sequence (``input_ids``, ``inputs_embeds``, ``token_type_ids`` ...). Three things
are done to the whole batch before it is cut, because after the cut no rank could do them:

- labels are shifted (a causal LM predicts token ``t + 1`` at position ``t``): ``shift_labels`` is
  ``labels[:, 1:]`` followed by ``-100``, cut like the ids, and passed as both ``labels`` and
  ``shift_labels`` (transformers' ``ForCausalLMLoss`` and remat's chunked head then use them as they
  are). Shifting each piece instead would drop the target of every piece's last token;
- ``num_items_in_batch`` is the number of targets in the whole sequence (not ``-100``), so each
  rank's loss is ``sum of its tokens' losses / num_items_in_batch``: its share, and the sum of the
  ranks' losses is the loss of the whole sequence (``torch.distributed.all_reduce`` it to print it).
  Gradients add up the same way: summed over the CP ranks (:func:`remat.parallel.reduce_gradients`
  for a model replicated on them; under FSDP2 over ``dp x cp`` ranks, which averages, back-propagate
  ``cp x`` the loss, as ``examples/train_long.py`` does);
- ``position_ids`` are the global positions of the rank's tokens, so rotary (or learned) position
  embeddings see where each token really is.

Contiguous, not load-balanced: torch's ``context_parallel`` by default deals each rank two pieces
(head and tail, so that every rank has the same share of causal attention's work); that hands a
Hugging Face model ``position_ids`` with a jump, which transformers reads as packed sequences and
answers with a block-diagonal 4-D mask that no CP attention can take. With contiguous pieces the
model builds no mask (SDPA's ``is_causal``), at the cost of balance: the last rank attends to the
whole sequence, the first to its own piece only, and the step waits for the last (the planner
charges the last rank's work: :mod:`remat.planning.context`).

Refused, before anything is touched (ValueError, naming what to do): a sequence not divisible by
the CP degree (pad it on the right with ``-100`` labels: causal attention makes padding at the end
exact), a padding mask (a 2-D ``attention_mask`` with zeros; one of all ones is dropped), a 4-D
mask, ``position_ids`` other than ``0 .. S-1`` (packed sequences), and with ``model=`` a model whose
attention does not run through ``torch.nn.functional.scaled_dot_product_attention``
(:func:`check_model`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from remat.parallel.groups import rank_and_world

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "inputs_embeds")
_LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")


def shard_sequence(batch: dict, group=None, *, model: Optional[nn.Module] = None) -> dict:
    """This rank's share of ``batch`` (a dict of a causal LM's inputs, the whole sequence, the same on
    every rank of ``group``): see the module doc. ``group``: the CP process group, a 1-D
    ``DeviceMesh``, or None for the default group. ``model``: also checked (:func:`check_model`)."""
    rank, world = rank_and_world(group)
    return shard_for(batch, rank, world, model=model)


def shard_for(batch: dict, rank: int, world: int, *, model: Optional[nn.Module] = None) -> dict:
    """:func:`shard_sequence` for rank ``rank`` of ``world`` without a process group (the planner
    profiles rank 0's share; tests build every rank's)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the context-parallel degree must be a whole number >= 1, got {world!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not one of the {world} context-parallel ranks")
    sequences, length = check_batch(batch, world)
    if model is not None:
        check_model(model)
    if world == 1:
        return dict(batch)
    s = length // world
    start, end = rank * s, (rank + 1) * s
    out = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids") + _LOSS_KEYS:
            continue  # checked above; rebuilt below
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            out[key] = value[:, start:end].contiguous()
        else:
            out[key] = value
    device = batch[_sequence_key(batch)].device
    out["position_ids"] = torch.arange(start, end, device=device).unsqueeze(0).expand(sequences, -1)
    shift = _shifted_labels(batch)
    if shift is not None:
        local = shift[:, start:end].contiguous()  # the loss views it flat
        out["labels"] = local
        out["shift_labels"] = local
        total = batch.get("num_items_in_batch")
        out["num_items_in_batch"] = total if total is not None else int((shift != IGNORE_INDEX).sum())
    return out


def check_batch(batch, world: int) -> tuple:
    """``(sequences, tokens)`` of a batch CP can cut into ``world`` pieces; ValueError otherwise."""
    if not isinstance(batch, dict):
        raise TypeError(f"context parallelism shards a dict batch of a causal LM's inputs (input_ids, labels ...), "
                        f"got {type(batch).__name__}")
    key = _sequence_key(batch)
    sequences, length = int(batch[key].shape[0]), int(batch[key].shape[1])
    if length % world:
        up = -(-length // world) * world
        raise ValueError(
            f"a sequence of {length} tokens cannot be split evenly over {world} context-parallel ranks: pad it on the "
            f"right to a multiple of {world} (e.g. {up} tokens) with labels -100 (under causal attention tokens "
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
    """Raise ValueError unless ``model``'s attention runs through ``scaled_dot_product_attention``:
    for a Hugging Face model, every config's ``attn_implementation`` must be ``"sdpa"`` (eager
    attention computes its softmax itself, flash-attention calls its own kernels: neither reaches
    the SDPA that CP replaces). A model without a config cannot be checked here;
    :func:`remat.parallel.attention.context_parallel` refuses it at the end of a forward that ran
    no SDPA."""
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
