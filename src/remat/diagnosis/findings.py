"""What every check of the doctor returns, and what they all read of the model.

A :class:`Finding` is one problem: which check found it, how bad (``error``, ``warning``,
``note``: :data:`SEVERITIES`, worst first), the fraction of the step at stake, and what, why and
the fix in words. Beside it, the readings of a setup that checks in several modules share: the
model inside a compile wrapper (:func:`unwrapped`), how it runs compiled
(:func:`compile_scope_of`), its applied remat plan (:func:`applied_plan`), and whether Hugging
Face checkpointing is on in the model or in its ``TrainingArguments``.

A module of its own so that the checks (:mod:`~remat.diagnosis.compile_checks`,
:mod:`~remat.diagnosis.run_checks`) and the entry that runs them (:mod:`~remat.diagnosis.checkup`)
all import it, and no check imports the entry that calls it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

SEVERITIES = ("error", "warning", "note")


@dataclass(frozen=True)
class Finding:
    """One problem ``doctor`` found."""

    check: str
    """Which check found it (``no-grad``, ``keep-fits`` ...: see the module docstring)."""
    severity: str
    """``error`` (wrong results or a crash to come), ``warning`` (memory or time lost) or ``note``."""
    cost: float
    """The fraction of the step's time or memory at stake (0..1; 1.0 for wrong results)."""
    what: str
    """What was found, with the names involved."""
    why: str
    """Why it matters."""
    fix: str
    """What to change."""
    predicted_peak_bytes: Optional[int] = None
    """The predicted peak the finding is about (``does-not-fit``, ``keep-fits``, ``faster-plan``)."""
    budget_bytes: Optional[int] = None
    """The budget it was compared with."""

    def __str__(self):
        return f"[{self.severity}] {self.what}\n    why: {self.why}\n    fix: {self.fix}"


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``'s wrapper(s) (``OptimizedModule._orig_mod``), else ``model``."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) and type(model).__name__ == "OptimizedModule":
        model = model._orig_mod
    return model


def compile_scope_of(model: nn.Module) -> Optional[str]:
    """How ``model`` runs compiled, as plans name it: ``"model"`` (a ``torch.compile`` wrapper, or
    ``Module.compile()`` on the model itself), ``"blocks"`` (``Module.compile()`` on modules inside
    it only: per-block compile, the rest eager), None (eager)."""
    inner = unwrapped(model)
    if inner is not model or inner.__dict__.get("_compiled_call_impl") is not None:
        return "model"
    if any(m.__dict__.get("_compiled_call_impl") is not None for m in inner.modules()):
        return "blocks"
    return None


def applied_plan(model: nn.Module):
    """The remat plan applied to ``model`` (or the model a compile wrapper holds), or None."""
    from remat.api import current_plan
    return current_plan(unwrapped(model))


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether Hugging Face checkpointing is on in any module of ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def args_checkpointing(training_args) -> bool:
    """Whether ``training_args`` turn on Hugging Face checkpointing (either name of the switch)."""
    return bool(training_args is not None and (getattr(training_args, "activation_checkpointing", False)
                                               or getattr(training_args, "gradient_checkpointing", False)))
