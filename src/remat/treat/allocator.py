"""The caching allocator's expandable segments, switched on while a model holds a remat plan.

What: :func:`hold` (called by :func:`remat.apply` for a model on a GPU) turns on PyTorch's
``expandable_segments`` allocator setting, and :func:`while_planning` does for the length of a
``remat.plan`` on the GPU (planning's own segments, left partly used by a small survivor such as a
cuBLAS workspace, must not strand memory the plan counts on); :func:`release` (``remat.remove``, or the model's
finalizer when it is deleted without it) puts the setting back as it was once no model holds it.
:func:`expandable_possible` says whether remat may turn it on here, and why not where it may not;
the planner asks it to decide how much a plan holds back for the allocator (``remat.planner``).

Why: a plan's prediction is what ``torch.cuda.max_memory_allocated`` measures, but a card runs out
of memory in what the caching allocator *reserves*. Without expandable segments the allocator keeps
fixed-size segments that a freed tensor leaves partly empty: an 8B model's 131,072-token plan,
right to the byte in allocated memory (73.5 GiB), reserved 94.2 GiB and ran out of memory on an
80 GB card; with expandable segments it reserved 77.2 GiB and trained. The setting takes effect for
the segments allocated after it, so switching it on when a plan is applied (before training
allocates its activations) is enough (measured: benchmarks/results/issue38). Modelling the
fragmentation instead would mean predicting the allocator's placement of every tensor of the
step; where the setting cannot be had, the planner holds back a share of the step's activation
bytes instead (``remat.planner.FRAGMENTATION_SHARE``).

Opting out: ``remat.apply(..., expandable_segments=False)``, or ``REMAT_EXPANDABLE_SEGMENTS=0`` in
the environment. A user's own ``expandable_segments:False`` in ``PYTORCH_CUDA_ALLOC_CONF`` (or
``PYTORCH_ALLOC_CONF``) is respected, as is an allocator backend other than PyTorch's native one.

Limits: process state (one setting for the whole process), changed only while some model holds a
plan and then put back; a torch without ``torch._C._accelerator_getAllocatorSettings`` (2.11 and
older) cannot say what the setting is now, so remat takes the environment variables' value as the
one it replaced.
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Optional

import torch
import torch.nn as nn

ENV_OPT_OUT = "REMAT_EXPANDABLE_SEGMENTS"

_holders: dict = {}          # id(model) -> weakref.finalize of a model that holds the setting
_state = {"before": None}    # the setting remat replaced (True/False), while some model holds it


def _configured() -> Optional[bool]:
    """``expandable_segments`` as the environment configures it (True/False), or None where unset."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return None


def _current() -> Optional[bool]:
    """The setting in force now, where this torch can say, else as configured."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            text = getter()
        except RuntimeError:
            text = ""
        for item in str(text).split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return _configured()


def _set(on: bool) -> None:
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


def expandable_possible() -> Optional[str]:
    """None where remat may turn expandable segments on in this process (or they are on already);
    else why not, in one sentence."""
    if os.environ.get(ENV_OPT_OUT, "").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_OPT_OUT}={os.environ[ENV_OPT_OUT]} opts out"
    if _configured() is False:
        return "PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:False, which remat leaves as it is"
    if getattr(torch.version, "hip", None) or sys.platform == "win32":
        return "this platform's allocator has no expandable segments (ROCm, Windows)"
    try:
        backend = torch.cuda.memory.get_allocator_backend() if torch.cuda.is_available() else "native"
    except (AttributeError, RuntimeError):   # a build without CUDA
        backend = "native"
    if backend != "native":
        return f"the CUDA allocator is {backend!r}, not PyTorch's native one"
    return None


class _Planning:
    """What holds the setting while a plan is made (weakly referenced, as a model is)."""


def holds(model: nn.Module) -> bool:
    """Whether ``model`` holds the setting (applied with it, not yet released)."""
    finalizer = _holders.get(id(model))
    return finalizer is not None and finalizer.peek() is not None and finalizer.peek()[0] is model


def hold(model: nn.Module) -> Optional[str]:
    """Expandable segments on while ``model`` lives or until :func:`release`; returns None where they
    are on, else why they are not (:func:`expandable_possible`). Idempotent per model."""
    why = expandable_possible()
    if why is not None:
        return why
    if not _holders:
        before = _current()
        if before is not True:
            _set(True)
        _state["before"] = bool(before)
    if not holds(model):
        _holders[id(model)] = weakref.finalize(model, _forget, id(model))
    return None


@contextlib.contextmanager
def while_planning():
    """Expandable segments on inside the block (where :func:`expandable_possible`), as they were after it
    unless a model came to hold them meanwhile; the cache is emptied at its end, so the segments
    planning made and no longer uses go back to the GPU."""
    token = _Planning()
    if expandable_possible() is None:
        hold(token)
    try:
        yield
    finally:
        release(token)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def release(model: nn.Module) -> None:
    """``model`` no longer holds the setting; it is put back as it was when no model holds it."""
    if holds(model):
        _holders[id(model)].detach()
        _forget(id(model))


def _forget(key: int) -> None:
    _holders.pop(key, None)
    if _holders or _state["before"] is None:
        return
    if _state["before"] is False:
        _set(False)
    _state["before"] = None
