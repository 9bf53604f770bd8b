"""``remat.Guard``: one line around a training step that keeps a run alive.

    guard = remat.Guard(model, budget="40GiB")          # or budget=None: the GPU's free memory
    for batch in loader:
        loss = guard(train_step, batch)                 # train_step(batch): forward + backward
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

What it does, per call:

- shapes: it plans from the first batch, and again before any batch with more tokens than any so
  far (a plan for the longest batch covers the shorter ones); plans are cached by token count;
- out of memory: when ``train_step`` raises ``torch.OutOfMemoryError``, it frees the failed step's
  tensors, puts back every ``.grad`` (:class:`GradKeeper`, so gradient accumulation survives) and
  the RNG states, re-plans at ``shrink`` times the budget and runs the same step on the same batch
  again, so the loss curve is that of a run that never hit the limit; after ``max_retries`` it
  raises a RuntimeError naming the budgets tried (:func:`redo_out_of_memory` is that loop alone);
- no plan fits: :class:`remat.NoPlanFits` before any out-of-memory step; after one, the smallest plan.

Planning never takes more GPU memory than the budget (``profile_device="auto"``): the first plan
is measured on the GPU with the allocator capped at the budget (a measurement that does not fit
falls back to fake tensors), later ones on fake tensors at this GPU's rates, with what the GPU
already holds taken off the budget. ``"fake"`` and ``"cuda"`` force one way.

Why a wrapper around the step rather than a hook inside the model: the step is the unit that can
be redone, and only the caller knows what it is. Keep ``optimizer.step()`` out of ``train_step``: a
half-applied update cannot be undone.

Limits: the budget only shrinks; fake re-plans time by roofline; a step that changes ``.grad`` itself
(clipping inside ``train_step``) is not undone. More: docs/design/planning.md.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from remat.units import format_size, parse_budget

FREE_MARGIN = 0.9
"""``budget=None`` (the Guard, the training callbacks): this fraction of what the GPU can give
this process when the budget is taken (:func:`free_memory_budget`)."""
PROFILE_DEVICES = ("auto", "fake", "cuda")


class Guard:
    """Plans ``model`` from real batches and redoes a step that ran out of memory (module docstring).

    Args:
        model: the ``nn.Module`` to train (planned and applied in place at the first call).
        budget: peak bytes of one step (``"40GiB"``); None: 90% of what the GPU can give now.
        max_retries: re-plans after out-of-memory steps before giving up.
        shrink: the budget's factor at each of them, in (0, 1).
        profile_device: ``"auto"`` (the first plan measured on the GPU within the budget, later
            ones on fake tensors), ``"fake"`` or ``"cuda"``.
        say: where messages go (default: stderr): one line per plan, saying why it was made (the
            first batch, a longer one, a step that ran out of memory) and the plan it replaced ->
            the new one.
        **plan_options: passed to :func:`remat.plan`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a bad ``budget``, ``max_retries``, ``shrink`` or ``profile_device``; ``budget=None``
            for a model not on a GPU.

    Calling it, ``guard(step, batch)`` returns ``step(batch)`` and raises :class:`remat.NoPlanFits`
    where no plan fits the budget given, or a RuntimeError naming the budgets tried after
    ``max_retries`` out-of-memory steps.

    Example:
        >>> guard = remat.Guard(model, budget="40GiB")                  # doctest: +SKIP
        >>> loss = guard(train_step, batch)                             # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, budget=None, *, max_retries: int = 3, shrink: float = 0.85,
                 profile_device: str = "auto", say: Optional[Callable[[str], None]] = None, **plan_options):
        if not isinstance(model, nn.Module):
            raise TypeError(f"remat.Guard expects a torch.nn.Module, got {type(model).__name__}")
        check_recovery(max_retries, shrink)
        check_profile_device(profile_device)
        self.model = model
        self.budget = parse_budget(budget) if budget is not None else free_memory_budget(
            model, "remat.Guard", "pass budget='24GiB' (or move the model to the GPU first)")
        self.max_retries = max_retries
        self.shrink = float(shrink)
        self.profile_device = profile_device
        self.say = say or _print
        self.plan_options = plan_options
        self.planned_tokens = 0
        self.plan = None
        self.replans = 0
        self.recovered = 0

    def __call__(self, step: Callable, batch):
        """``step(batch)``, planned for this batch's shape, redone after an out-of-memory error.

        Args:
            step: ``step(batch)``, forward and backward (not ``optimizer.step()``).
            batch: this step's batch; a batch with more tokens than any before is planned for first.

        Returns:
            What ``step(batch)`` returns.

        Raises:
            remat.NoPlanFits: no plan fits the budget given (before any out-of-memory step).
            RuntimeError: the step still ran out of memory after ``max_retries`` re-plans.
        """
        tokens = batch_tokens(batch)
        if tokens > self.planned_tokens:   # at the budget given (never shrunk yet), nothing fitting is an error
            why = (f"the first batch ({tokens:,} tokens)" if not self.planned_tokens else
                   f"a longer batch ({tokens:,} tokens; the plan was for {self.planned_tokens:,})")
            self._replan(batch, self.budget, why, keep_head=False, refuse=self.recovered == 0)
            self.planned_tokens = tokens
        return redo_out_of_memory(self.model, lambda: step(batch), lambda: self._shrink(batch),
                                  budget=self.budget, max_retries=self.max_retries, who="remat.Guard")

    def _shrink(self, batch) -> int:
        before, self.budget = self.budget, int(self.budget * self.shrink)
        self._replan(batch, self.budget, f"a step that ran out of memory (budget {format_size(before)})",
                     keep_head=True, refuse=False, then="; the step runs again on the same batch")
        self.recovered += 1
        return self.budget

    def _replan(self, batch, budget, why: str, *, keep_head: bool, refuse: bool, then: str = "") -> None:
        from remat.api import current_plan
        options = dict(self.plan_options)
        previous = current_plan(self.model)
        if keep_head and previous is not None and "heads" not in options:
            options["heads"] = [previous.head]          # the redone step computes its loss the same way
        self.plan = plan_and_apply(self.model, batch, budget, options, profile_device=self.profile_device,
                                   first=self.replans == 0, say=self.say, refuse="remat.Guard" if refuse else None)
        self.replans += 1
        if self.replans == 1:
            before = "" if previous is None else f" (replacing the plan applied before: {previous.summary()})"
            self.say(f"remat.Guard: planned for {why}, at {format_size(budget)}: {self.plan.summary()}{before}")
        else:
            before, after = previous.summary() if previous is not None else "no plan", self.plan.summary()
            change = f"{after} (unchanged)" if before == after else f"{before} -> {after}"
            self.say(f"remat.Guard: re-planned for {why}, at {format_size(budget)}: {change}{then}")


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_recovery(max_retries, shrink) -> None:
    """ValueError unless ``max_retries`` is an int >= 0 and ``shrink`` lies in (0, 1)."""
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")
    if not 0.0 < float(shrink) < 1.0:
        raise ValueError(f"shrink must be between 0 and 1 (the budget's factor after an out-of-memory "
                         f"step), got {shrink!r}")


def check_profile_device(profile_device) -> None:
    if profile_device not in PROFILE_DEVICES:
        raise ValueError(f"profile_device must be one of {', '.join(map(repr, PROFILE_DEVICES))} (where plans are "
                         f"profiled: 'auto' measures the first on the GPU, later ones on fake tensors), "
                         f"got {profile_device!r}")


def redo_out_of_memory(model: nn.Module, run: Callable, shrink: Callable[[], int], *, budget: int,
                       max_retries: int, who: str):
    """``run()``; after ``torch.OutOfMemoryError``: free the failed step, put ``model``'s grads and
    the RNG states back, ``shrink()`` (re-plan at a lower budget, returning it) and ``run()``
    again, at most ``max_retries`` times; then RuntimeError naming the budgets tried."""
    tried = [budget]
    grads, rng = GradKeeper(model, budget), _rng_state()
    for attempt in range(max_retries + 1):
        failed = False
        try:
            with grads.watching():
                return run()
        except torch.OutOfMemoryError:
            failed = True   # handled below, once the exception's frames are gone
        if failed:
            _free()
            grads.restore()
            _set_rng_state(rng)
            if attempt == max_retries:
                break
            tried.append(shrink())
    raise RuntimeError(
        f"{who}: the step still ran out of memory after {max_retries} re-plans (budgets tried: "
        f"{', '.join(format_size(b) for b in tried)}). Something outside the plan holds the memory "
        "(optimizer state, another process, a leak): check torch.cuda.memory_summary(), or give a "
        "smaller batch.")


def plan_and_apply(model: nn.Module, batch, budget: int, options: dict, *, profile_device: str = "auto",
                   first: bool = False, say: Callable[[str], None] = lambda message: None,
                   refuse: Optional[str] = None):
    """Plan ``model`` for ``batch`` within ``budget`` without using more GPU memory than it
    (module docstring), apply the plan and return it. When nothing fits: with ``refuse`` (who is
    planning, for the message) the :class:`~remat.NoPlanFits` error, as :func:`remat.plan` raises it
    -- a budget the user gave that nothing fits; without, the smallest plan (a budget remat lowered
    itself after an out-of-memory step, where the smallest plan is the best left to try)."""
    from remat.api import apply
    from remat.planning.solver import NoPlanFits
    try:
        chosen = _plan(model, batch, budget, options, profile_device, first, say)
    except NoPlanFits as e:
        if refuse is not None and e.plan is not None:
            raise NoPlanFits(f"{refuse}(budget='{format_size(budget)}') cannot train this batch: {e}",
                             e.smallest_peak, e.plan) from None
        if e.plan is None:
            raise
        chosen = e.plan                             # the smallest peak there is: better than none
        say(f"remat: nothing fits {format_size(budget)}; using the smallest plan "
            f"(predicted {format_size(e.smallest_peak)})")
    apply(model, chosen, blocks=options.get("blocks"))
    return chosen


def _plan(model, batch, budget, options, profile_device, first, say):
    from remat.planner import plan as make_plan
    device = _device(model)
    if device is None or "device" in options:
        return make_plan(model, batch, budget, **options)
    if profile_device == "cuda" or (profile_device == "auto" and first):
        failed = False
        try:
            with _allocator_cap(device, budget):
                return make_plan(model, batch, budget, device="cuda", **options)
        except torch.OutOfMemoryError:
            failed = True   # the measurement itself does not fit the budget
        if failed:
            _free()
            say(f"remat: measuring the model on the GPU needs more than {format_size(budget)}; "
                "planning on fake tensors")
    options = dict(options)
    options.setdefault("gpu", _rate_table(device))
    return make_plan(model, batch, max(1, budget - _unplanned_bytes(model, device, options)), device="fake",
                     **options)


def _device(model: nn.Module) -> Optional[torch.device]:
    param = next(model.parameters(), None)
    return param.device if param is not None and param.device.type == "cuda" else None


def _rate_table(device) -> Optional[str]:
    from remat.planning.costs import rates_for
    name = torch.cuda.get_device_name(device)
    try:
        rates_for(name)
    except ValueError:
        return None                                 # an unknown card: the profiler's default table
    return name


def _unplanned_bytes(model: nn.Module, device, options: dict) -> int:
    """GPU bytes a fake profile does not see: allocated memory beyond parameters, buffers, the
    optimizer state it is told about and the grads (the plan counts those as they are made)."""
    from remat.planning.costs import optimizer_state_bytes
    from remat.profiling.profiler import trainable_shapes
    params = {id(p): p for p in model.parameters()}.values()
    storages = {}
    for t in [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None)]:
        if t.device == device:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    optimizer = optimizer_state_bytes(options.get("optimizer", "none"), trainable_shapes(model))
    return max(0, torch.cuda.memory_allocated(device) - sum(storages.values()) - optimizer)


@contextlib.contextmanager
def _allocator_cap(device, budget: int):
    """The caching allocator may reserve at most ``budget`` bytes on ``device`` inside the block."""
    memory = torch.cuda.memory
    total = torch.cuda.get_device_properties(device).total_memory
    before = memory.get_per_process_memory_fraction(device) if hasattr(memory, "get_per_process_memory_fraction") \
        else 1.0
    torch.cuda.empty_cache()                        # cached free blocks count against the cap
    torch.cuda.set_per_process_memory_fraction(min(before, budget / total), device)
    try:
        with warnings.catch_warnings():             # a calibration step over the cap is skipped, as planned
            warnings.filterwarnings("ignore", message="remat: calibration on a real step failed")
            yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


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


def free_memory_budget(module: nn.Module, who: str, instead: str) -> int:
    """``budget=None``'s budget: :data:`FREE_MARGIN` of what ``module``'s GPU can give this process now
    (free memory plus what the process has allocated). ``who`` and ``instead`` name the caller and
    what to pass for a model that is not on a GPU (ValueError)."""
    param = next(module.parameters(), None)
    if param is None or param.device.type != "cuda":
        raise ValueError(f"{who}(budget=None) takes the GPU's free memory as the budget, but the model is not on a "
                         f"GPU: {instead}")
    free, _ = torch.cuda.mem_get_info(param.device)
    return int((free + torch.cuda.memory_allocated(param.device)) * FREE_MARGIN)


class GradKeeper:
    """The gradients as they were before a step, kept where a redo needs them (module docstring).

    Made before the step: it notes each parameter's ``.grad`` tensor (a reference, no copy). Inside
    :meth:`watching`, a hook on each parameter that has one copies it just before autograd adds the
    step's gradient to it, once. Under FSDP, which adds the reduced gradients to ``.grad`` outside
    autograd, every existing gradient is copied when the keeper is made (one device copy a step).
    :meth:`restore` puts the copies back into those tensors, the untouched ones back as they were,
    and None where there was none; it can run after each failed attempt (the copies stay).
    ``budget``: the copies go to the GPU where the existing gradients' bytes fit in it beside the
    step's peak (:attr:`on_device`), else to pinned host memory."""

    def __init__(self, model: nn.Module, budget: Optional[int] = None):
        self.before = [(p, p.grad) for p in {id(p): p for p in model.parameters()}.values()]
        self.existing = [(p, grad) for p, grad in self.before if grad is not None]
        self.copies = {}  # id(param) -> the copy of its gradient before the step
        self.copied_bytes = 0
        self.on_device = not self.existing or _fits_beside_plan(model, budget, self.existing)
        if self.existing and not _autograd_accumulates(model):
            for p, grad in self.existing:   # sharded: FSDP adds to .grad itself, no hook sees it
                self._before_accumulation(p, grad, None)

    @contextlib.contextmanager
    def watching(self):
        """Inside the block, each existing gradient is copied before autograd first adds to it."""
        handles = [p.register_hook(functools.partial(self._before_accumulation, p, grad)) for p, grad in self.existing
                   if p.requires_grad and id(p) not in self.copies]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _before_accumulation(self, param, grad, incoming):
        if id(param) not in self.copies and param.grad is grad:
            self.copies[id(param)] = self._copy(grad)
            self.copied_bytes += grad.numel() * grad.element_size()
        return None

    def _copy(self, grad):
        if self.on_device or grad.device.type == "cpu":
            return grad.detach().clone()
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        return host.copy_(grad.detach(), non_blocking=True)   # ordered before the accumulation on the stream

    def restore(self) -> None:
        """Every ``.grad`` as it was before the step (its values, in the same tensor)."""
        if any(c.device.type == "cpu" for c in self.copies.values()) and torch.cuda.is_initialized():
            torch.cuda.synchronize()                     # the host copies have landed
        with torch.no_grad():
            for p, grad in self.before:
                copy = self.copies.get(id(p))
                if copy is not None:
                    grad.copy_(copy)
                p.grad = grad


def _autograd_accumulates(model: nn.Module) -> bool:
    """Whether autograd itself adds the step's gradients to the parameters' ``.grad`` (where a hook on
    the parameter sees it first): not under FSDP (FSDP2's DTensor parameters, FSDP1's flat ones),
    whose reduce-scatter adds to the sharded ``.grad`` outside autograd."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return False
    return not any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules())


def _fits_beside_plan(model: nn.Module, budget: Optional[int], existing: list) -> bool:
    """Whether a copy of ``existing`` gradients fits on their GPU under ``budget`` beside the step's
    peak: the larger of the applied plan's predicted peak and the peak the allocator has seen (a plan
    made for the first micro-batch may not count the gradients that later ones add to)."""
    device = existing[0][1].device
    if device.type != "cuda":
        return True
    from remat.api import current_plan
    plan = current_plan(model)
    predicted = plan.notes.get("predicted_peak_bytes") if plan is not None else None
    peak = max(predicted or 0, torch.cuda.max_memory_allocated(device))
    if budget is None:
        budget = free_memory_budget(model, "remat", "")
    need = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for _, g in existing}.values())
    return peak + need <= budget


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _free() -> None:
    # the peak statistics are the caller's: a failed attempt's peak stays in them
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
