"""remat inside a Lightning ``Trainer``: one callback.

    trainer = L.Trainer(..., callbacks=[RematCallback(budget="40GiB")])   # or spec="full", head="chunked"

How it fits Lightning's order of hooks (``Trainer.fit``): callbacks' ``setup`` ->
the module's ``setup`` -> ``configure_model`` -> the strategy wraps the model (DDP, FSDP) and
moves it to its device -> ``on_fit_start`` -> for each batch ``on_train_batch_start(batch)``.

- ``spec=`` is applied in ``setup("fit")``, before any strategy wraps or shards the model
  (remat goes before FSDP2 ``fully_shard`` and ``torch.compile``). A module that builds its
  network in ``configure_model`` has no blocks at ``setup``; the spec is then applied at
  ``on_fit_start``, which is fine for one device and DDP. Under FSDP with ``configure_model``,
  call ``remat.apply(self, spec)`` at the end of your ``configure_model`` instead (the
  documented hook), before Lightning shards it.
- ``budget=``: Lightning hands callbacks each batch (``on_train_batch_start``), already on
  the device, so the plan is made from the first real batch and made again before every
  batch with more tokens than any planned so far (elements of its largest tensor, as
  :class:`remat.Guard` counts them), with the head mode kept.
- On CUDA, after ``report_after_steps`` batches the measured peak
  (``torch.cuda.max_memory_allocated``) is printed beside the plan's prediction.

The loss the planner measures: ``loss_fn(module, batch)`` if given; else, for a dict batch,
``lm(**batch).loss`` of the Hugging Face causal LM inside the LightningModule (the first
submodule with a ``config`` and an output embedding). ``training_step`` itself is not used:
it may call ``self.log``, which Lightning only allows inside its loop.

Limits: the budget is for one device; planning on a GPU profiles the model for a few seconds
at the first batch and at each new longest one; an out-of-memory step is not redone (use
:class:`remat.Guard` in a manual-optimisation ``training_step`` for that).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
from lightning.pytorch import Callback


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RematCallback(Callback):
    """Applies or plans remat for a LightningModule; see the module docstring.

    ``budget``: peak memory of one device (``"24GiB"``; None on CUDA: 90% of what the device
    can give). ``spec``: apply this instead of planning. ``head``: ``"plain"``/``"chunked"``
    to fix the head mode. ``loss_fn(module, batch) -> loss`` for the planner. ``blocks``:
    which modules are the blocks (see :func:`remat.apply`). ``plan_options``: passed to
    :func:`remat.plan`.
    """

    def __init__(self, budget=None, spec=None, *, head: Optional[str] = None, loss_fn=None, blocks=None,
                 report_after_steps: int = 2, say: Optional[Callable[[str], None]] = None, **plan_options):
        from remat.units import parse_budget
        if budget is not None and spec is not None:
            raise ValueError("RematCallback takes a budget (plan from the batch) or a spec (apply as given), "
                             "not both; pass one of them")
        if head is not None and head not in ("plain", "chunked"):
            raise ValueError(f"head must be 'plain', 'chunked' or None (the planner chooses), got {head!r}")
        self.budget = None if budget is None else parse_budget(budget)
        self.spec = spec
        self.head = head
        self.loss_fn = loss_fn
        self.blocks = blocks
        self.report_after_steps = report_after_steps
        self.say = say or _print
        self.plan_options = plan_options
        self.plan = None
        self.planned_tokens = 0
        self.replans = 0
        self.measured_peak_bytes = None
        self._steps = 0

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and self.spec is not None and _has_blocks(pl_module, self.blocks):
            self._apply_spec(pl_module)

    def on_fit_start(self, trainer, pl_module):
        from remat.api import current_plan
        if self.spec is not None and current_plan(pl_module) is None:
            self._apply_spec(pl_module)   # built in configure_model: no blocks at setup

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.spec is not None:
            return
        from remat.guard import batch_tokens
        tokens = batch_tokens(batch)
        if tokens > self.planned_tokens:
            why = "the first batch" if self.planned_tokens == 0 else "a longer batch"
            self._plan(pl_module, batch, f"{why} ({tokens} tokens)")
            self.planned_tokens = tokens

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._steps += 1
        if self._steps != self.report_after_steps:
            return
        param = next(pl_module.parameters(), None)
        if param is None or param.device.type != "cuda":
            return
        from remat.units import format_size
        self.measured_peak_bytes = torch.cuda.max_memory_allocated(param.device)
        predicted = self.plan.notes.get("predicted_peak_bytes") if self.plan is not None else None
        self.say(f"remat: measured peak after {self._steps} batches: {format_size(self.measured_peak_bytes)}"
                 + (f" (predicted {format_size(predicted)})" if predicted else ""))

    def _apply_spec(self, module: nn.Module) -> None:
        from remat.api import apply, current_plan
        apply(module, self.spec, blocks=self.blocks, head=self.head or "plain")
        self.plan = current_plan(module)
        self.say(f"remat: applied {self.plan.summary()}")

    def _budget_bytes(self, module: nn.Module) -> int:
        if self.budget is not None:
            return self.budget
        param = next(module.parameters(), None)
        if param is None or param.device.type != "cuda":
            raise ValueError("RematCallback(budget=None) takes the GPU's free memory as the budget, but the module "
                             "is not on a GPU: pass budget='24GiB', or spec='full' to apply a treatment as it is")
        free, _ = torch.cuda.mem_get_info(param.device)
        return int((free + torch.cuda.memory_allocated(param.device)) * 0.9)

    def _plan(self, module: nn.Module, batch, why: str) -> None:
        from remat.api import apply, current_plan
        from remat.planner import plan as make_plan
        from remat.planning.solver import NoPlanFits
        from remat.units import format_size
        budget = self._budget_bytes(module)
        options = dict(self.plan_options, blocks=self.blocks, loss_fn=self.loss_fn or _default_loss(module, batch))
        previous = current_plan(module)
        if "heads" not in options and (self.head or previous is not None):
            options["heads"] = [self.head or previous.head]
        try:
            chosen = make_plan(module, batch, budget, **options)
        except NoPlanFits as e:
            if e.plan is None:
                raise
            chosen = e.plan
            self.say(f"remat: nothing fits {format_size(budget)}; using the smallest plan "
                     f"(predicted {format_size(e.smallest_peak)})")
        apply(module, chosen, blocks=self.blocks)
        self.plan = chosen
        self.replans += 1
        peak = chosen.notes.get("predicted_peak_bytes")
        self.say(f"remat: planned for {why} at {format_size(budget)}: {chosen.summary()}"
                 + (f", predicted peak {format_size(peak)}" if peak else ""))


def _has_blocks(module: nn.Module, blocks) -> bool:
    from remat.treat.discovery import discover
    try:
        discover(module, blocks)
    except (ValueError, TypeError):
        return False
    return True


def _default_loss(module: nn.Module, batch):
    if not isinstance(batch, dict):
        raise TypeError(f"RematCallback plans from the loss of a batch; a {type(batch).__name__} batch needs "
                        "loss_fn=lambda module, batch: ... (one training step's loss)")
    for name, sub in module.named_modules():
        if hasattr(sub, "config") and callable(getattr(type(sub), "get_output_embeddings", None)):
            path = name

            def loss(model, b, path=path):
                lm = model.get_submodule(path) if path else model
                return lm(**b).loss
            return loss
    raise TypeError(f"{type(module).__name__} holds no Hugging Face causal LM; pass "
                    "loss_fn=lambda module, batch: ... (one training step's loss) to RematCallback")
