"""remat inside Axolotl: a plugin that takes over Axolotl's checkpointing, offload and tiling settings.

    plugins:
      - remat.integrations.axolotl.RematPlugin
    remat_budget: 40GiB          # one GPU's peak; left out on a GPU: 90% of what it can give
    # remat_spec: full           # or apply a fixed spec instead of planning
    # remat_plan: plan.json      # or a saved plan (`remat plan ... --out plan.json`)
    # remat_head: chunked        # fix the LM head mode (default: the planner chooses)
    # remat_options: {gpu: h100} # more keyword arguments of remat.plan

How it fits Axolotl's order of events (0.21, ``axolotl.integrations.base.BasePlugin``): ``register(cfg)``
runs on the YAML as written, before Axolotl validates it, switches off the settings that make Axolotl
recompute, offload or tile on its own (``gradient_checkpointing``, ``activation_offloading``,
``selective_checkpointing``, ``tiled_mlp``) with one message saying what was, and checks the ``remat_*``
keys, so a bad budget fails before a model is loaded; ``get_input_args()`` names :class:`RematArgs`
for Axolotl's schema; ``pre_model_load(cfg)`` switches off again what a validator turned back on;
``add_callbacks_pre_trainer(cfg, model)`` hands Axolotl a :class:`~remat.integrations.hf.RematCallback`,
which plans from the first training batch as Axolotl collated it, as in a Hugging Face Trainer.

Why at ``register``: it is the last point at which Axolotl's validators, its model loader, its
class-wide tiled-MLP monkeypatch and TRL's offloader can still be told not to switch on; remat's plan
then decides per block what to recompute, offload or tile (the same mechanisms, chosen by a memory
model instead of by hand), as the Trainer callback takes over ``gradient_checkpointing=True``.

Limits: one GPU's plan per rank as the callback makes it (FSDP2 and context parallelism as
:mod:`remat.integrations.hf` reads them from the Trainer's arguments; DeepSpeed is not planned for).
Axolotl's Liger plugin patches the model's forward with a fused loss; with it, keep ``remat_head``
unset or ``plain`` (remat's chunked head would sit under Liger's and never run). Each setting taken
over, value by value: docs/design/diagnosis.md.
"""
from __future__ import annotations

import sys
from typing import Literal, Optional, Union

from pydantic import BaseModel

from remat.integrations.hf import RematCallback

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as error:  # the module is Axolotl's plugin; nothing else imports it
    raise ImportError(f"remat.integrations.axolotl is a plugin for Axolotl, which does not import here ({error}); "
                      "pip install axolotl, or train with remat.integrations.hf.RematCallback") from error

# Axolotl's keys that make it recompute, offload or tile by itself, and the value that turns each off
TAKEN_OVER = {"gradient_checkpointing": False, "activation_offloading": False, "selective_checkpointing": None,
              "tiled_mlp": False, "tiled_mlp_num_shards": None}


class RematArgs(BaseModel):
    """The plugin's keys in Axolotl's YAML (merged into its config schema)."""

    remat_budget: Optional[Union[str, int]] = None
    """Peak memory of one GPU (``"40GiB"``, bytes); None on a GPU: 90% of what it can give."""
    remat_spec: Optional[str] = None
    """Apply this spec instead of planning (``full``, ``every:2``, ``full+tiled`` ...)."""
    remat_plan: Optional[str] = None
    """Apply this saved plan (JSON from ``remat plan --out``) instead of planning."""
    remat_head: Optional[Literal["plain", "chunked"]] = None
    """Fix the LM head mode (default: the planner chooses; with a spec, plain)."""
    remat_options: Optional[dict] = None
    """More keyword arguments of :func:`remat.plan` (``gpu``, ``treatments``, ``optimizer`` ...)."""


class RematPlugin(BasePlugin):
    """Axolotl plugin: remat plans what each block recomputes, offloads and tiles (module docstring)."""

    def __init__(self, say=None):
        super().__init__()
        self.say = say or (lambda message: print(message, file=sys.stderr))
        self.took_over = {}          # key -> the value the YAML gave it
        self.callback = None

    def get_input_args(self) -> str:
        return f"{__name__}.RematArgs"

    def register(self, cfg: dict):
        _callback_arguments(cfg)     # a bad remat_* key fails now, before anything is loaded
        self._take_over(cfg)

    def pre_model_load(self, cfg):
        self._take_over(cfg)

    def add_callbacks_pre_trainer(self, cfg, model) -> list:
        self._take_over(cfg)
        self.callback = RematCallback(**_callback_arguments(cfg), say=self.say)
        return [self.callback]

    def _take_over(self, cfg) -> None:
        found = {key: cfg.get(key) for key in TAKEN_OVER if cfg.get(key)}
        for key in found:
            cfg[key] = TAKEN_OVER[key]
        new = {k: v for k, v in found.items() if k not in self.took_over}
        if new:
            self.took_over.update(new)
            given = ", ".join(f"{k}: {v}" for k, v in new.items())
            self.say(f"remat: Axolotl's {given} taken over: remat's plan decides what each block recomputes, "
                     "offloads to the host and tiles (Axolotl's own would do it a second time)")


def _callback_arguments(cfg) -> dict:
    """``RematCallback`` keyword arguments from the ``remat_*`` keys; ValueError for a bad one."""
    from remat.planning.plans import Plan
    from remat.units import parse_budget
    budget, spec, plan = cfg.get("remat_budget"), cfg.get("remat_spec"), cfg.get("remat_plan")
    given = [f"remat_{name}" for name, value in (("budget", budget), ("spec", spec), ("plan", plan)) if value]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both say what remat does; keep one of them in the YAML")
    head = cfg.get("remat_head")
    if head not in (None, "plain", "chunked"):
        raise ValueError(f"remat_head must be plain or chunked, got {head!r}")
    options = cfg.get("remat_options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"remat_options must be a mapping of remat.plan keyword arguments, got {options!r}")
    arguments = dict(options, head=head)
    if budget:
        arguments["budget"] = parse_budget(budget)
    if spec:
        arguments["spec"] = spec
    if plan:
        arguments["spec"] = Plan.load(plan)
    return arguments
