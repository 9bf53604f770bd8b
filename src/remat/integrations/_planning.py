"""What remat's training-loop callbacks share: plan from real batches, re-plan on a longer one.

The Hugging Face and the Lightning ``RematCallback`` differ only in when their framework hands
them the model and the batch; what they do with them lives here once, in :class:`BatchPlanner`,
which both inherit beside their framework's callback base:

- the constructor's checks (a budget *or* a spec, a known head mode, the budget parsed);
- the state a user reads afterwards (``plan``, ``planned_tokens``, ``replans``,
  ``measured_peak_bytes``);
- planning: :meth:`BatchPlanner.plan_if_longer` plans before the first batch and before every
  batch with more tokens than any planned so far (:func:`remat.guard.batch_tokens`, the rule
  :class:`remat.Guard` uses), keeping the head mode so the loss is computed the same way; when
  nothing fits the budget the callback stops with :class:`remat.NoPlanFits`, as :func:`remat.plan`
  does (after an out-of-memory step, at the budget remat lowered itself, the smallest plan is
  used instead); planning itself stays within the budget as the guard's does
  (:func:`remat.guard.plan_and_apply`); a plan applied before training is replaced, with a message;
- applying a ``spec`` as given, and reporting the measured CUDA peak beside the prediction.

A callback changes one small method: :meth:`BatchPlanner._options` (what the planner needs
beyond ``plan_options``: the optimizer state, a loss function, the blocks) and
:meth:`BatchPlanner._planning_budget` (the Trainer callback fixes the free-memory budget once,
at ``on_train_begin``); the Hugging Face one also wraps :meth:`BatchPlanner._plan` under context
parallelism (it plans for the whole sequences a rank's share came from).

How it differs from :class:`remat.Guard`: the guard is bound to one model when it is made and
wraps the step itself, so it can redo a step that ran out of memory; a callback only sees the
model when its framework hands it over and never owns the step, so it cannot by itself (the
Hugging Face one can when :func:`remat.integrations.hf.guard_trainer` hands it the Trainer's
``training_step``). No framework is imported here.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn as nn

from remat.guard import batch_tokens, check_profile_device, free_memory_budget  # the rules remat.Guard uses


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class BatchPlanner:
    """Plans ``remat`` for a model from the batches a training loop runs (module docstring).

    ``budget``: peak memory of one device (bytes or ``"24GiB"``); None on CUDA: 90% of what the
    device can give. ``spec``: apply this instead of planning. ``head``: ``"plain"`` or
    ``"chunked"`` to fix the head mode (default: the planner chooses; with ``spec``, plain).
    ``report_after_steps``: when to report the measured peak (CUDA). ``profile_device``: where
    plans are profiled, as :class:`remat.Guard` does it (``"auto"``: the first measured on the
    GPU within the budget, later ones on fake tensors; ``"fake"``; ``"cuda"``). ``say``: where messages go
    (default: stderr). ``plan_options``: passed to :func:`remat.plan`.
    """

    def __init__(self, budget=None, spec=None, *, head: Optional[str] = None, report_after_steps: int = 2,
                 profile_device: str = "auto", say: Optional[Callable[[str], None]] = None,
                 plan_options: Optional[dict] = None):
        from remat.units import parse_budget
        check_profile_device(profile_device)
        if budget is not None and spec is not None:
            raise ValueError("RematCallback takes a budget (plan from the batch) or a spec (apply as given), "
                             "not both; pass one of them")
        if head is not None and head not in ("plain", "chunked"):
            raise ValueError(f"head must be 'plain', 'chunked' or None (the planner chooses), got {head!r}")
        self.budget = None if budget is None else parse_budget(budget)
        self.spec = spec
        self.head = head
        self.profile_device = profile_device
        self.report_after_steps = report_after_steps
        self.say = say or _print
        self.plan_options = dict(plan_options or {})
        self.plan = None              # the plan applied last
        self.planned_tokens = 0       # the most tokens of any batch planned for so far
        self.replans = 0
        self.measured_peak_bytes = None

    # -- what a callback may change --------------------------------------------------------
    def _options(self, module: nn.Module, batch) -> dict:
        """Keyword arguments for :func:`remat.plan` beyond the head mode."""
        return dict(self.plan_options)

    def _planning_budget(self, module: nn.Module) -> int:
        """The budget one plan is made for: the given one, else what the GPU can give now."""
        return self.resolve_budget(module)

    # -- shared ----------------------------------------------------------------------------
    def resolve_budget(self, module: nn.Module) -> int:
        if self.budget is not None:
            return self.budget
        return free_memory_budget(module, "RematCallback", "pass budget='24GiB' to plan for a device, or spec='full' "
                                                            "to apply a treatment as it is")

    def plan_if_longer(self, module: nn.Module, batch, tokens: Optional[int] = None) -> bool:
        """Plans for ``batch`` if it holds more tokens than any planned so far; True if it did."""
        tokens = batch_tokens(batch) if tokens is None else tokens
        if tokens <= self.planned_tokens:
            return False
        why = "the first batch" if self.planned_tokens == 0 else "a longer batch"
        self._plan(module, batch, f"{why} ({tokens} tokens)", refuse=not getattr(self, "recovered", 0))
        self.planned_tokens = tokens
        return True

    def _plan(self, module: nn.Module, batch, why: str, refuse: bool = True) -> None:
        """Plan and apply for ``batch``. ``refuse``: a budget nothing fits raises, as remat.plan does
        (False only where remat lowered the budget itself, after an out-of-memory step)."""
        from remat.api import current_plan
        from remat.guard import plan_and_apply
        from remat.units import format_size
        budget = self._planning_budget(module)
        options = self._options(module, batch)
        previous = current_plan(module)
        if "heads" not in options:
            if self.head is not None:
                options["heads"] = [self.head]
            elif previous is not None:
                options["heads"] = [previous.head]   # the loss is computed the same way after a re-plan
        chosen = plan_and_apply(module, batch, budget, options, profile_device=self.profile_device,
                                first=self.replans == 0, say=self.say, refuse="RematCallback" if refuse else None)
        if previous is not None and self.plan is None:
            self.say(f"remat: the plan applied before training ({previous.summary()}) is replaced by the "
                     "callback's, made from the batches that run")
        self.plan = chosen
        self.replans += 1
        peak = chosen.notes.get("predicted_peak_bytes")
        self.say(f"remat: planned for {why} at {format_size(budget)}: {chosen.summary()}"
                 + (f", predicted peak {format_size(peak)}" if peak else ""))

    def _apply_spec(self, module: nn.Module, blocks=None) -> None:
        from remat.api import apply, current_plan
        apply(module, self.spec, blocks=blocks, head=self.head or "plain")
        self.plan = current_plan(module)
        self.say(f"remat: applied {self.plan.summary()}")

    def report_peak(self, module: nn.Module, count: int, unit: str) -> None:
        """After ``report_after_steps`` steps on CUDA: measure the peak and say it beside the prediction."""
        if count != self.report_after_steps:
            return
        param = next(module.parameters(), None)
        if param is None or param.device.type != "cuda":
            return
        from remat.units import format_size
        self.measured_peak_bytes = torch.cuda.max_memory_allocated(param.device)
        predicted = self.plan.notes.get("predicted_peak_bytes") if self.plan is not None else None
        self.say(f"remat: measured peak after {count} {unit}: {format_size(self.measured_peak_bytes)}"
                 + (f" (predicted {format_size(predicted)})" if predicted else ""))
