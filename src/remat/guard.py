"""``remat.Guard``: one line around a training step that keeps a run alive.

    guard = remat.Guard(model, budget="40GiB")          # or budget=None: the GPU's free memory
    for batch in loader:
        loss = guard(train_step, batch)                 # train_step(batch): forward + backward
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

What it does, per call:

- Shapes: the plan is made from the first batch, and made again whenever a batch arrives
  with more tokens (elements of its largest tensor) than any batch planned for so far,
  before that batch runs, so the budget holds for every shape seen (a plan made for the
  longest batch also covers the shorter ones: every term of the peak grows with the
  tokens). Plans are cached by token count; a run whose lengths vary re-plans only when the
  longest length so far grows.
- Out of memory: when ``train_step`` raises ``torch.OutOfMemoryError``, the guard drops the
  failed step's tensors (the exception and its frames first, then the caching allocator's
  free blocks), puts back every parameter's ``.grad`` as it was before the step (gradient
  accumulation survives: grads that existed are kept on the host meanwhile) and the RNG
  states (CPU and every CUDA device), re-plans at ``shrink`` times the budget, applies the
  new plan, and runs the same step on the same batch again. The loss curve is then the one
  of a run that never hit the limit (treatments are exact; the head mode is kept as it was,
  so the loss is computed the same way; a re-plan for a longer batch may change the head). After ``max_retries`` it raises a RuntimeError
  naming the budgets tried.

Why a wrapper around the step rather than a hook inside the model: the step is the unit that
can be redone (forward and backward both allocate), and only the caller knows what it is.
Do not put ``optimizer.step()`` inside ``train_step``: an out-of-memory error in the middle
of it would leave the parameters half updated, which no retry can undo.

Limits: the re-plan profiles the model (seconds on a GPU); the budget only shrinks; a step
that runs out of memory for reasons remat does not control (the optimizer's state, another
process on the GPU) fails after ``max_retries`` with the message naming the budgets tried.
"""
from __future__ import annotations

import gc
from typing import Callable, Optional

import torch
import torch.nn as nn

from remat.units import format_size, parse_budget

_FREE_MARGIN = 0.9  # budget=None: this fraction of the GPU's free memory when the guard starts


class Guard:
    """Plans ``model`` from real batches and redoes a step that ran out of memory (module doc)."""

    def __init__(self, model: nn.Module, budget=None, *, max_retries: int = 3, shrink: float = 0.85,
                 say: Optional[Callable[[str], None]] = None, **plan_options):
        if not isinstance(model, nn.Module):
            raise TypeError(f"remat.Guard expects a torch.nn.Module, got {type(model).__name__}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")
        if not 0.0 < float(shrink) < 1.0:
            raise ValueError(f"shrink must be between 0 and 1 (the budget's factor after an out-of-memory "
                             f"step), got {shrink!r}")
        self.model = model
        self.budget = parse_budget(budget) if budget is not None else _free_gpu_bytes(model)
        self.max_retries = max_retries
        self.shrink = float(shrink)
        self.say = say or (lambda message: None)
        self.plan_options = plan_options
        self.planned_tokens = 0
        self.plan = None
        self.replans = 0
        self.recovered = 0

    def __call__(self, step: Callable, batch):
        """``step(batch)``, planned for this batch's shape, redone after an out-of-memory error."""
        tokens = batch_tokens(batch)
        if tokens > self.planned_tokens:
            self._replan(batch, self.budget, f"a batch of {tokens} tokens", keep_head=False)
            self.planned_tokens = tokens
        tried = [self.budget]
        grads, rng = _grads_to_host(self.model), _rng_state()
        for attempt in range(self.max_retries + 1):
            failed = False
            try:
                return step(batch)
            except torch.OutOfMemoryError:
                failed = True   # handled below, once the exception's frames are gone
            if failed:
                _free()
                _restore_grads(self.model, grads)
                _set_rng_state(rng)
                if attempt == self.max_retries:
                    break
                self.budget = int(self.budget * self.shrink)
                tried.append(self.budget)
                self._replan(batch, self.budget, "an out-of-memory step", keep_head=True)
                self.recovered += 1
        raise RuntimeError(
            f"remat.Guard: the step still ran out of memory after {self.max_retries} re-plans (budgets tried: "
            f"{', '.join(format_size(b) for b in tried)}). Something outside the plan holds the memory "
            "(optimizer state, another process, a leak): check torch.cuda.memory_summary(), or give a "
            "smaller batch.")

    def _replan(self, batch, budget, why: str, *, keep_head: bool) -> None:
        from remat.api import apply, current_plan
        from remat.planner import plan as make_plan
        from remat.planning.solver import NoPlanFits
        options = dict(self.plan_options)
        previous = current_plan(self.model)
        if keep_head and previous is not None and "heads" not in options:
            options["heads"] = [previous.head]          # the redone step computes its loss the same way
        try:
            chosen = make_plan(self.model, batch, budget, **options)
        except NoPlanFits as e:
            if e.plan is None:
                raise
            chosen = e.plan                             # the smallest peak there is: better than none
        apply(self.model, chosen, blocks=options.get("blocks"))
        self.plan = chosen
        self.replans += 1
        self.say(f"remat.Guard: planned for {why} at {format_size(budget)}: {chosen.summary()}")


def batch_tokens(batch) -> int:
    """The size of a batch: elements of its largest tensor (batch x sequence for token ids)."""
    tensors = []

    def visit(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
    visit(batch)
    if not tensors:
        raise TypeError(f"remat.Guard needs a batch that holds tensors (a tensor, a tuple or a dict of "
                        f"them), got {type(batch).__name__}")
    return max(t.numel() for t in tensors)


def _free_gpu_bytes(model: nn.Module) -> int:
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        raise ValueError("remat.Guard(budget=None) takes the GPU's free memory as the budget, but the model is "
                         "not on a GPU: pass budget='24GiB' (or move the model to the GPU first)")
    free, _ = torch.cuda.mem_get_info(param.device)
    return int((free + torch.cuda.memory_allocated(param.device)) * _FREE_MARGIN)


def _grads_to_host(model: nn.Module) -> dict:
    return {id(p): (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True))
            for p in model.parameters()}


def _restore_grads(model: nn.Module, saved: dict) -> None:
    for p in model.parameters():
        param, grad = saved.get(id(p), (p, None))
        p.grad = None if grad is None else grad.to(p.device, copy=True)  # the snapshot serves every retry


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
