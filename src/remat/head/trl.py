"""TRL's fused LM head, seen from remat's: which module it sits on, and whether remat's chunked head is under it.

TRL 1.x adds its own fused LM head after ``Trainer.__init__`` (``add_fused_lm_head``): an instance
``forward`` whose training path calls the backbone and computes log-probabilities in tiles, never
calling the model's ``forward`` nor its ``lm_head``. remat's chunked head under it never runs, so
the Trainer callback plans around it (:mod:`remat.integrations.hf`) and the doctor reports a
chunked head left under it (:mod:`remat.diagnosis`); both ask here.

How TRL's ``forward`` is told apart: by its code object (``_fused_forward`` in a file under a
``trl`` folder), looked for through ``functools.wraps`` wrappers (accelerate's autocast), since
TRL's own ``functools.wraps`` copies the model's ``__name__`` and ``__module__``. Where remat's
patch was installed over TRL's head, the ``forward`` it replaced is the one looked at.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.nn as nn

from remat.head.patching import has_chunked_head
from remat.treat import patches


def find_trl_head(model: nn.Module) -> Optional[nn.Module]:
    """The module whose ``forward`` TRL replaced with its fused LM head, or None.

    Args:
        model: the model a TRL trainer trains.

    Returns:
        That module, or None where TRL's fused head is not installed."""
    for module in model.modules():
        if _is_trl_fused(module.__dict__.get("forward")):
            return module
    for patch in patches.patches(model):  # remat's patch installed over TRL's head: what it replaced
        if patch.attribute == "forward" and _is_trl_fused(patch.previous):
            return patch.module
    return None


def _is_trl_fused(forward) -> bool:
    """TRL's fused ``forward``, possibly inside wrappers made with ``functools.wraps`` (accelerate's
    autocast). TRL's own ``functools.wraps`` copies the model's ``__name__`` and ``__module__``,
    so the code object is what tells."""
    func, seen = getattr(forward, "__func__", forward), 0
    while func is not None and seen < 8:
        code = getattr(func, "__code__", None)
        if code is not None and code.co_name == "_fused_forward" and os.sep + "trl" + os.sep in code.co_filename:
            return True
        func, seen = getattr(func, "__wrapped__", None), seen + 1
        func = getattr(func, "__func__", func)
    return False


def remat_head_bypassed(model: nn.Module) -> bool:
    """Whether remat's chunked head sits under TRL's fused head, which never calls it.

    Args:
        model: the model a TRL trainer trains.

    Returns:
        True when TRL's fused head holds remat's chunked head under it: remat's is then never called."""
    holder = find_trl_head(model)
    return holder is not None and has_chunked_head(holder)
