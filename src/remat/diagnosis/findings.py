"""What every check of the doctor returns, and what they all read of the model.

A :class:`Finding` is one problem: which check found it, how bad (``error``, ``warning``,
``note``: :data:`SEVERITIES`, worst first), the fraction of the step at stake, and what, why and
the fix in words. Beside it, the readings of a setup that checks in several modules share: the
model inside a compile wrapper (:func:`unwrapped`), how it runs compiled
(:func:`compile_scope_of`), its applied remat plan (:func:`applied_plan`), whether Hugging
Face checkpointing is on in the model or in its ``TrainingArguments``, and the checkpointing a setup
runs outside remat as it is (:func:`checkpointing_of`: transformers' per-layer flags and
``every_n_layers``, its ``offload=True``, accelerate's FSDP2 checkpointing and its offload) and
whether Liger's kernels are asked for (:func:`liger_on`).

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


@dataclass(frozen=True)
class Checkpointing:
    """Checkpointing a setup turns on outside remat, read as it is (:func:`checkpointing_of`)."""

    source: str
    """Who does it, in words ("Hugging Face checkpointing", "accelerate's FSDP2 activation checkpointing")."""
    layers: Optional[tuple] = None
    """Read from the model: the names of the blocks whose flag is on (``every_n_layers`` done); None:
    from arguments, every ``every_n_layers``-th block (0, N, 2N ...)."""
    every_n_layers: int = 1
    offload: bool = False
    """The checkpoints' saved inputs go to pinned host memory through ``save_on_cpu`` (synchronous)."""
    preserves_rng: bool = True

    def checkpoints(self, index: int, name: str) -> bool:
        """Whether the block at ``index`` (named ``name``) is checkpointed."""
        if self.layers is not None:
            return any(name == layer or name.endswith("." + layer) or layer.endswith("." + name)
                       for layer in self.layers)
        return index % max(self.every_n_layers, 1) == 0

    @property
    def new_flags(self) -> bool:
        """Whether this uses more than all-or-nothing checkpointing (every_n_layers, offload, FSDP2's own)."""
        return self.every_n_layers != 1 or self.offload or "FSDP2" in self.source


def checkpointing_of(model: nn.Module, training_args=None, accelerate_config=None) -> Optional[Checkpointing]:
    """The checkpointing the setup runs outside remat, or None: Hugging Face's on the model (its per-layer
    flags, ``offload`` seen in its checkpoint function), else the one ``training_args`` will turn on
    (``activation_checkpointing_kwargs``' ``every_n_layers`` / ``offload``, transformers >= 5.16), else
    accelerate's FSDP2 activation checkpointing (``fsdp_activation_checkpointing``, with
    ``fsdp_activation_checkpointing_offload``: accelerate >= 1.15's ``offload_wrapper``)."""
    import os
    if hf_checkpointing_on(model):
        layers = [(name, m) for name, m in model.named_modules() if _is_layer(m)]
        on = tuple(name for name, m in layers if getattr(m, "gradient_checkpointing", False) is True)
        function = next((m.__dict__.get("_gradient_checkpointing_func") for _, m in layers
                         if m.__dict__.get("_gradient_checkpointing_func") is not None), None)
        keywords = dict(getattr(function, "keywords", {}) or {})
        every = _every_of(len(layers), [i for i, (name, _) in enumerate(layers) if name in on])
        return Checkpointing("Hugging Face checkpointing", layers=on if layers else None, every_n_layers=every,
                             offload=_saves_on_cpu(function), preserves_rng=keywords.get("preserve_rng_state", True)
                             is not False)
    if args_checkpointing(training_args):
        kwargs = {}
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            if isinstance(getattr(training_args, name, None), dict):
                kwargs = dict(getattr(training_args, name))
                break
        return Checkpointing("Hugging Face checkpointing (TrainingArguments)",
                             every_n_layers=int(kwargs.get("every_n_layers", 1) or 1), offload=bool(kwargs.get("offload")),
                             preserves_rng=kwargs.get("preserve_rng_state", True) is not False)
    fsdp = fsdp_checkpointing(training_args, accelerate_config)
    if fsdp is not None:
        version, offload = fsdp
        env = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "")
        offload = offload or _truthy(env)
        return Checkpointing(f"accelerate's FSDP{version} activation checkpointing", offload=offload and version == 2,
                             preserves_rng=version != 2)
    return None


def fsdp_checkpointing(training_args=None, accelerate_config=None) -> Optional[tuple]:
    """``(fsdp_version, offload)`` where FSDP's own activation checkpointing is on (TrainingArguments'
    ``fsdp_config`` or an accelerate config dict), else None."""
    found = None
    if training_args is not None and getattr(training_args, "fsdp", None):
        config = getattr(training_args, "fsdp_config", None) or {}
        if _truthy(config.get("activation_checkpointing")):
            found = (int(config.get("version", 2)), _truthy(config.get("activation_checkpointing_offload")))
    if isinstance(accelerate_config, dict):
        config = accelerate_config.get("fsdp_config") or {}
        if _truthy(config.get("fsdp_activation_checkpointing", config.get("activation_checkpointing"))):
            version = int(config.get("fsdp_version", config.get("version", 1)))
            offload = _truthy(config.get("fsdp_activation_checkpointing_offload",
                                         config.get("activation_checkpointing_offload")))
            found = (version, offload)
    return found


def liger_on(training_args) -> bool:
    """Whether ``TrainingArguments`` ask the Trainer to patch the model with Liger's kernels."""
    return bool(training_args is not None and getattr(training_args, "use_liger_kernel", False))


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _is_layer(module: nn.Module) -> bool:
    """transformers' repeated blocks (``GradientCheckpointingLayer``), which ``every_n_layers`` counts."""
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def _every_of(count: int, on: list) -> int:
    """N where the checkpointed layer indices ``on`` are exactly 0, N, 2N ... of ``count``; else 1."""
    for n in range(1, max(count, 1) + 1):
        if on == list(range(0, count, n)):
            return n
    return 1


def _saves_on_cpu(function) -> bool:
    """Whether a Hugging Face checkpoint function is transformers' ``offload=True`` one (``checkpoint``
    inside ``save_on_cpu``)."""
    inner = getattr(function, "func", function)
    code = getattr(inner, "__code__", None)
    return code is not None and "save_on_cpu" in code.co_names
