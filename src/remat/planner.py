"""``remat.plan`` and ``remat.auto``: profile, then solve, for a budget; ``auto`` also applies.

This module only joins :mod:`remat.profiling.profiler` (what each block costs), :mod:`remat.planning.solver`
(the fastest plan within the budget, checked by :mod:`remat.planning.simulator`) and
:func:`remat.apply`. The prediction rides along in ``plan.notes`` (peak, step time, what
sets the peak, GPU, batch shape) so that ``remat bench`` / ``doctor`` can put the
measurement beside it.

A model on the GPU is measured there (CUDA events, allocator statistics); any other
model -- on the CPU, or on the ``meta`` device without weights -- is profiled with fake
tensors and the rates of ``gpu`` (default h100), so a plan for an 80 GB card can be made
on a laptop. Offload treatments are only planned when :mod:`remat.offload.engine` imports and the
target is a GPU; the chunked head only when :mod:`remat.treat.head` can reproduce the model's loss.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from remat.planning.plans import OFFLOADING_TREATMENTS, Plan
from remat.planning.sharding import shard
from remat.planning.solver import solve
from remat.profiling.profiler import block_param_bytes
from remat.profiling.profiler import profile as _profile
from remat.units import parse_budget


def plan(model: nn.Module, batch, budget, *, loss_fn=None, gpu: Optional[str] = None, optimizer: str = "none",
         treatments: Optional[Sequence[str]] = None, heads: Optional[Sequence[str]] = None,
         blocks=None, fsdp_world: int = 1, device: Optional[str] = None, progress=None) -> Plan:
    """The fastest plan for ``model`` on ``batch`` whose predicted peak is within ``budget``.

    ``batch``: a tensor, a tuple/list or a dict of any keys, with the shapes of training
    (values do not matter). ``loss_fn(model, batch) -> scalar loss``: one training step's loss.
    Without it, a dict batch means a Hugging Face model, ``model(**batch).loss`` (``labels``
    default to ``input_ids``), a tensor of integer ids a causal LM trained on them
    (``labels=ids``); any other batch raises TypeError asking for ``loss_fn``. A model with no
    LM head plans with the plain head only. The model is left exactly as it was found (an
    applied plan, gradients, buffers, RNG ...; see :func:`remat.profile`). ``budget``: bytes or "24GiB".
    ``gpu``: rates to plan for when the model is not on a GPU (h100, h200, a100).
    ``optimizer``: "none" (the bench protocol: forward+backward only), "adamw" (two fp32
    states per trainable parameter) or "adamw8bit". Raises ValueError (``NoPlanFits``)
    naming the smallest achievable peak when nothing fits. ``fsdp_world``: plan for one of
    that many FSDP2 ranks (``fully_shard`` after ``remat.apply``; see :mod:`remat.planning.sharding`).
    ``device``: ``"fake"`` profiles a GPU model with fake tensors (no GPU memory used, roofline
    times); default: measured on the GPU when the model is there (see :func:`remat.profile`).
    """
    budget_bytes = parse_budget(budget)
    prof = _profile(model, batch, loss_fn=loss_fn, gpu=gpu, device=device, optimizer=optimizer, blocks=blocks,
                    progress=progress)
    if fsdp_world != 1:
        prof = shard(prof, fsdp_world, block_param_bytes(model, prof))
    return solve(prof, budget_bytes, treatments=_allowed(prof, treatments), heads=heads)


def auto(model: nn.Module, batch, budget, **kwargs) -> Plan:
    """:func:`plan`, then :func:`remat.apply` it to ``model``; returns the plan."""
    from remat.api import apply
    chosen = plan(model, batch, budget, **kwargs)
    apply(model, chosen, blocks=kwargs.get("blocks"))
    return chosen


def _allowed(prof, treatments) -> Optional[list]:
    available = list(prof.treatments(0))
    if treatments is not None:
        return list(treatments)
    if prof.rates.name == "cpu" or not offload_available():
        available = [t for t in available if t not in OFFLOADING_TREATMENTS]
    return available


def offload_available() -> bool:
    try:
        from remat.offload import engine  # noqa: F401
    except ImportError:
        return False
    return True
