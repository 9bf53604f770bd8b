"""What the Hugging Face Trainer's context parallelism tells :class:`remat.integrations.hf.RematCallback`.

Under accelerate's ``ParallelismConfig(cp_size=N)`` the Trainer hands the model one rank's share of
each sequence, cut in place by torch's ``context_parallel``, and FSDP2 shards the model over the
``dp_shard x cp`` ranks. The callback plans one rank of that mesh from: the sizes
(:func:`context_parallel_sizes`, read from ``TrainingArguments`` or from the accelerate state an
``Accelerator`` left, never created) and a stand-in for the whole sequences a share came from
(:func:`whole_sequences`), which :func:`remat.plan` cuts again (``cp_world``). Nothing here imports
accelerate or transformers.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch


def context_parallel_sizes(args) -> Optional[tuple]:
    """``(cp, fsdp_world)`` when the Trainer runs context parallelism, else None: from
    ``TrainingArguments.parallelism_config`` (transformers >= 4.57), else from the accelerate state
    an ``Accelerator`` built with a ``ParallelismConfig`` left (read, never created). ``cp``: its
    ``cp_size``; ``fsdp_world``: the ranks FSDP2 shards over, ``dp_shard_size x cp_size``
    (accelerate's ``dp_shard_cp`` mesh; HSDP replicas hold copies)."""
    config = getattr(args, "parallelism_config", None)
    if config is None:
        state = sys.modules.get("accelerate.state")
        shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
        config = shared.get("parallelism_config") if isinstance(shared, dict) else None
    cp = int(getattr(config, "cp_size", None) or 1)
    if cp <= 1:
        return None
    return cp, int(getattr(config, "dp_shard_size", None) or 1) * cp


def whole_sequences(batch: dict, cp: int) -> dict:
    """A stand-in for the whole sequences one of ``cp`` context-parallel shares came from: its
    ``input_ids`` (or ``inputs_embeds``) and ``labels``, ``cp`` times as long (values repeated: the
    planner reads shapes, cuts the stand-in again and charges the attention over the rest). What
    the Trainer adds for CP (``position_ids``, ``shift_labels``, the mask) is left out: the planner
    makes a share's own."""
    out = {}
    for key in ("input_ids", "inputs_embeds", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            out[key] = value.repeat(1, cp, *([1] * (value.dim() - 2)))
    if not out:
        raise ValueError(f"RematCallback under context parallelism plans a causal LM's batch (input_ids, labels), "
                         f"got keys {sorted(batch)}")
    return out


def sequence_length(batch) -> int:
    for key in ("input_ids", "inputs_embeds"):
        value = batch.get(key) if isinstance(batch, dict) else None
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return 0
