"""remat inside the Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``): one callback.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[RematCallback(budget="40GiB")])   # or spec="full", head="chunked"
    guard_trainer(trainer)          # optional: a training step that runs out of memory is redone

How: :class:`RematCallback` takes Hugging Face checkpointing over at ``on_init_end`` (both switches
off, one message: ``train()`` enables it before any ``on_train_begin``, and would checkpoint every
block a second time), then plans from the first *training* batch exactly as the Trainer collated
it, through a watcher on the model's ``forward`` (patch registry, tag ``"hf-callback"``), and
re-plans before every batch with more tokens than any planned so far, the head mode kept. It never
draws a batch from the loader itself: a second iterator would change the data order and dropout.
``spec=`` or ``batch=`` applies or plans at ``on_train_begin``; the plan stays after ``on_train_end``.

What it reads from the Trainer: TRL's fused LM head (the blocks planned with the ``plain`` head,
remat's chunked head kept off), Liger's ``use_liger_kernel`` (the patched model planned as it is:
``kernels="liger"``), context parallelism (one rank of the mesh: :mod:`remat.integrations._parallelism`),
several ranks (the garbage collector between steps: :mod:`remat.integrations.collector`).
``budget=None`` on CUDA is 90% of what the device can give this process; a budget nothing fits
stops at the first batch with :class:`remat.NoPlanFits`, as :func:`remat.plan` does.

:func:`guard_trainer` redoes an out-of-memory ``training_step`` (a callback cannot catch it) under
:func:`remat.guard.redo_out_of_memory`, re-planning at ``shrink`` times the budget;
:func:`without_full_attention_masks` wraps a collator so that a compiled model runs SDPA's causal
kernel on unpadded batches. Limits: planning runs inside the first training forward, outside any
autocast wrapper accelerate installs later; the CP plan has been checked on the CPU only;
:func:`guard_trainer` is refused under CP. The order of events and each case in full:
docs/design/diagnosis.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from transformers import TrainerCallback

from remat.guard import batch_tokens, check_recovery, redo_out_of_memory  # one rule and one loop with remat.Guard
from remat.head import find_trl_head
from remat.integrations._parallelism import context_parallel_sizes, sequence_length, whole_sequences
from remat.integrations._planning import BatchPlanner
from remat.integrations.collector import collect_every as collect_every_steps, started
from remat.treat import patches

_TAG = "hf-callback"
_OOM_TAG = "hf-oom-guard"
_HF_SWITCHES = ("activation_checkpointing", "gradient_checkpointing")


class RematCallback(BatchPlanner, TrainerCallback):
    """A ``TrainerCallback`` that plans remat from the Trainer's own batches and applies it (module docstring).

    Args:
        budget: peak memory of one device (bytes or ``"24GiB"``); None on CUDA: 90% of what the
            device can give this process.
        spec: apply this instead of planning (``"full"``, ``"every:2"``, a :class:`remat.Plan` ...).
        head: ``"plain"`` or ``"chunked"`` to fix the head mode (default: the planner chooses; with
            ``spec``, plain).
        batch: an example batch to plan from at ``on_train_begin`` instead of the first real one.
        report_after_steps: after how many steps the measured peak is printed (CUDA).
        max_retries, shrink: how :func:`guard_trainer` redoes an out-of-memory step (re-plans at
            ``shrink`` times the budget, at most ``max_retries`` times).
        profile_device: where plans are profiled (as :class:`remat.Guard` takes it).
        say: where messages go (default: stderr).
        collect_every: Python's garbage collection between steps (``"auto"``: every 50 steps under
            several ranks, Python's own on one; 0: Python's own; an int: that many steps).
        **plan_options: passed to :func:`remat.plan` (``gpu=``, ``treatments=``, ``kernels=`` ...).

    Raises:
        ValueError: both ``budget`` and ``spec``; an unknown ``head``, budget, ``profile_device``,
            ``collect_every``, ``max_retries`` or ``shrink``. Training stops with
            :class:`remat.NoPlanFits` at the first batch when no plan fits ``budget``.

    Example:
        >>> Trainer(model=model, args=args, callbacks=[RematCallback(budget="40GiB")])  # doctest: +SKIP
    """

    def __init__(self, budget=None, spec=None, *, head: Optional[str] = None, batch=None,
                 report_after_steps: int = 2, max_retries: int = 3, shrink: float = 0.85,
                 profile_device: str = "auto", say: Optional[Callable[[str], None]] = None,
                 collect_every: Union[int, str] = "auto", **plan_options):
        check_recovery(max_retries, shrink)
        collect_every_steps(collect_every, 1)   # a bad value fails here, not when training starts
        super().__init__(budget, spec, head=head, report_after_steps=report_after_steps,
                         profile_device=profile_device, say=say, plan_options=plan_options)
        self.max_retries = max_retries
        self.shrink = float(shrink)
        self.recovered = 0            # out-of-memory steps redone (guard_trainer)
        self._guard = None
        self.batch = batch
        self.took_over = False        # TrainingArguments asked for HF checkpointing; remat does it instead
        self.trl_head = False         # TRL's fused LM head is on the model
        self._model = None
        self._watch = None
        self._budget_bytes = None
        self._optimizer = "none"
        self.collect_every = collect_every
        self._collector = None
        self.context_parallel = None  # (cp, fsdp_world) when the Trainer splits sequences over ranks

    # -- Trainer events ------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        self._take_over_args(args)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("RematCallback.on_train_begin got no model; it runs inside a transformers Trainer")
        self._model = model
        self._collect(args)
        self._take_over_args(args)
        self._take_over_model(model)
        self._optimizer = _optimizer_state(args)
        self.context_parallel = context_parallel_sizes(args)
        if self.context_parallel is not None:
            cp, fsdp = self.context_parallel
            self.say(f"remat: the Trainer splits each sequence over {cp} context-parallel ranks (FSDP2 over {fsdp}): "
                     "plans are made for one rank's share")
        self.trl_head = find_trl_head(model) is not None
        if self.trl_head:
            self._cooperate_with_trl(model)
        if getattr(args, "use_liger_kernel", False):
            self._say_liger(model)
        if self.spec is not None:
            self._apply_spec(model)
            return
        self._budget_bytes = self.resolve_budget(model)   # fixed for the run: later re-plans use it too
        if self.batch is not None:
            self._plan(model, _tensors(self.batch), f"the given batch of {batch_tokens(self.batch)} tokens", whole=True)
            self.planned_tokens = batch_tokens(self.batch)
        self._watch = patches.install(model, "forward", _watched_forward, tag=_TAG, state=_Watch(self))

    def on_step_end(self, args, state, control, **kwargs):
        if self._collector is not None:
            self._collector.step(state.global_step)
        if self._model is not None:
            self.report_peak(self._model, state.global_step, "steps")

    def on_train_end(self, args, state, control, **kwargs):
        if self._collector is not None:
            self._collector.stop()
            self._collector = None
        if self._watch is not None:
            patches.uninstall(self._watch)
            self._watch = None
        if self._guard is not None:
            patches.uninstall(self._guard)
            self._guard = None

    # -- out of memory (guard_trainer) ------------------------------------------------------
    def redo(self, run: Callable, inputs):
        """``run()`` (one ``training_step``), redone on the same ``inputs`` after an out-of-memory error."""
        if self._model is None or self._budget_bytes is None:   # not planning (spec=) or not training yet
            return run()
        return redo_out_of_memory(self._model, run, lambda: self._shrink(inputs), budget=self._budget_bytes,
                                  max_retries=self.max_retries, who="remat guard_trainer")

    def _shrink(self, inputs) -> int:
        self._budget_bytes = int(self._budget_bytes * self.shrink)
        self._plan(self._model, _tensors(inputs), "an out-of-memory step", refuse=False)   # the head mode is kept
        self.recovered += 1
        self._rewatch()
        return self._budget_bytes

    def _rewatch(self) -> None:
        """apply() took every remat patch off the model and put the plan's on: the watcher goes back on top."""
        if self._watch is not None and not self._watch.active:
            self._watch = patches.install(self._model, "forward", _watched_forward, tag=_TAG, state=self._watch.state)

    # -- the pieces ----------------------------------------------------------------------
    def _collect(self, args) -> None:
        self._collector = started(self.collect_every, getattr(args, "world_size", 1), self.say)

    def _take_over_args(self, args) -> None:
        if not any(getattr(args, name, False) for name in _HF_SWITCHES):
            return
        for name in _HF_SWITCHES:
            if hasattr(args, name):
                setattr(args, name, False)
        self._say_take_over()

    def _take_over_model(self, model: nn.Module) -> None:
        if not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            return
        from remat.api import hf_disable_name
        disable = getattr(model, hf_disable_name(model), None)   # transformers 5's name where it exists
        if disable is None:
            raise ValueError(f"Hugging Face checkpointing is on in {type(model).__name__} and it has no "
                             "activation_checkpointing_disable() / gradient_checkpointing_disable(); switch it off "
                             "before training with RematCallback")
        disable()
        self._say_take_over()

    def _say_take_over(self) -> None:
        if not self.took_over:
            self.say("remat: TrainingArguments gradient_checkpointing / activation_checkpointing=True is taken over: "
                     "Hugging Face checkpointing stays off and remat's plan decides what each block recomputes "
                     "(both at once would recompute every block twice)")
        self.took_over = True

    def _cooperate_with_trl(self, model: nn.Module) -> None:
        from remat.api import apply, current_plan
        from remat.planning.plans import Plan
        if self.head in ("chunked", "liger"):
            raise ValueError(f"RematCallback(head={self.head!r}) with TRL: the trainer computes its loss with its own "
                             "fused LM head, which never calls remat's head; pass head=None or 'plain'")
        self.head = "plain"
        applied = current_plan(model)
        if applied is not None and applied.head in ("chunked", "liger"):
            apply(model, Plan(blocks=applied.blocks, head="plain", chunk_tokens=None, notes=applied.notes,
                              tile_tokens=applied.tile_tokens, kernels=applied.kernels), strict=False)
            then = ("the callback's spec replaces the blocks' plan now" if self.spec is not None else
                    "the blocks keep their plan until the callback plans them from the first batch")
            self.say(f"remat: TRL's fused LM head computes the loss here, so remat's {applied.head} head (applied before "
                     f"the trainer was built) would never be called: it is taken off; {then}")
        self.say("remat: TRL's fused LM head found: remat plans the blocks and leaves TRL's head as it is")

    def _say_liger(self, model: nn.Module) -> None:
        from remat.treat.liger_head import liger_loss
        head = ("TRL's fused head computes the loss" if self.trl_head else
                "the plain head is Liger's fused linear cross-entropy, remat's chunked head the other choice, "
                "whichever the budget makes faster" if liger_loss(model) else "the loss is the model's own")
        self.say("remat: the Trainer runs Liger's kernels (use_liger_kernel=True): remat plans over them, measured "
                 f"on the GPU or stood in for on fake tensors; {head}")

    # -- what differs from the shared planner ---------------------------------------------
    def _options(self, module: nn.Module, batch) -> dict:
        options = dict(self.plan_options)
        options.setdefault("optimizer", self._optimizer)
        if self.context_parallel is not None:
            from remat.parallel import torch_balances
            cp, fsdp = self.context_parallel
            options.setdefault("cp_world", cp)
            options.setdefault("fsdp_world", fsdp)
            options.setdefault("cp_balance", torch_balances(sequence_length(batch), cp))
        return options

    def _plan(self, module: nn.Module, batch, why: str, refuse: bool = True, whole: bool = False) -> None:
        """Under CP: plan for the whole sequences a share came from (``whole``: ``batch`` is them
        already), with torch's SDPA in place for the profile (module docstring)."""
        if self.context_parallel is None:
            return super()._plan(module, batch, why, refuse)
        from remat.parallel import plain_attention
        cp = self.context_parallel[0]
        if not whole:
            batch = whole_sequences(batch, cp)
            why = f"{why}, one of {cp} context-parallel shares"
        with plain_attention():
            return super()._plan(module, batch, why, refuse)

    def _planning_budget(self, module: nn.Module) -> int:
        return self._budget_bytes


@dataclass(eq=False)
class _Watch:
    """The watcher patch's state: the callback it reports to."""

    callback: Any


def _watched_forward(patch, *args, **kwargs):
    """The model's ``forward`` during training: plans before a batch longer than any so far."""
    callback = patch.state.callback
    module = patch.module
    if not (module.training and torch.is_grad_enabled()):
        return patch.call_previous(*args, **kwargs)
    batch = _tensors(kwargs, args)
    if not callback.plan_if_longer(module, batch, batch_tokens(batch) if batch else 0):
        return patch.call_previous(*args, **kwargs)
    # this call runs through the new plan's patches, below the watcher put back on top
    callback._rewatch()
    return callback._watch.call_previous(*args, **kwargs)


def guard_trainer(trainer, callback: Optional[RematCallback] = None):
    """Redo a ``trainer.training_step`` that runs out of memory, re-planned at a lower budget.

    Call after the Trainer is built, before ``train()``; undone at ``on_train_end``.

    Args:
        trainer: a transformers ``Trainer`` (or TRL's) built with a :class:`RematCallback`.
        callback: the :class:`RematCallback` that plans (default: the one in the Trainer's callbacks).

    Returns:
        ``trainer``, its ``training_step`` guarded (calling it twice installs one guard).

    Raises:
        ValueError: no or several RematCallbacks in the Trainer; a callback that applies a fixed
            ``spec`` (nothing to re-plan); context parallelism (a redo would shard the batch twice).
    """
    if callback is None:
        found = [c for c in trainer.callback_handler.callbacks if isinstance(c, RematCallback)]
        if len(found) != 1:
            raise ValueError(f"guard_trainer needs the Trainer's RematCallback, found {len(found)}: build the "
                             "Trainer with callbacks=[RematCallback(budget=...)] (or pass callback=)")
        callback = found[0]
    if callback.spec is not None:
        raise ValueError("guard_trainer redoes a step after re-planning at a lower budget, but this RematCallback "
                         "applies a fixed spec; build it with budget= (or budget=None on a GPU) instead")
    if context_parallel_sizes(trainer.args) is not None:
        raise ValueError("guard_trainer cannot redo a step under context parallelism (parallelism_config.cp_size > 1): "
                         "the Trainer shards the batch in place for its CP step, so a redo would shard the shares "
                         "again; train without guard_trainer (RematCallback still plans each rank's share)")
    if callback._guard is not None and callback._guard.active:
        return trainer
    callback._guard = patches.install(trainer, "training_step", _guarded_training_step, tag=_OOM_TAG,
                                      state=_Watch(callback))
    return trainer


def _guarded_training_step(patch, model, inputs, *args, **kwargs):
    """``Trainer.training_step`` under the callback's out-of-memory recovery."""
    return patch.state.callback.redo(lambda: patch.call_previous(model, inputs, *args, **kwargs), inputs)


def without_full_attention_masks(collate: Callable) -> Callable:
    """A collator whose batches drop ``attention_mask`` where it is all ones (no row padded).

    The same attention for a model that uses the mask only to mask (decoders, encoders), and
    under ``torch.compile`` SDPA's causal kernel instead of a masked one; batches with padding
    keep their mask.

    Args:
        collate: the collator to wrap (``data_collator=`` of the Trainer).

    Returns:
        A callable that collates as ``collate`` does, then drops an all-ones mask.

    Raises:
        TypeError: ``collate`` is not callable.
    """
    if not callable(collate):
        raise TypeError(f"without_full_attention_masks wraps a collator (a callable), got {type(collate).__name__}")

    def collate_without_full_masks(features):
        batch = collate(features)
        mask = batch.get("attention_mask") if hasattr(batch, "get") else None
        if isinstance(mask, torch.Tensor) and bool(mask.all()):
            del batch["attention_mask"]
        return batch
    return collate_without_full_masks


def _tensors(kwargs, args=()) -> dict:
    """The batch as the planner takes it: tensor keyword arguments (positional ids as input_ids)."""
    if isinstance(kwargs, torch.Tensor):
        return {"input_ids": kwargs}
    batch = {k: v for k, v in dict(kwargs).items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if args and isinstance(args[0], torch.Tensor) and "input_ids" not in batch:
        batch["input_ids"] = args[0]
    return batch


def _optimizer_state(args) -> str:
    """The planner's name for the optimizer ``args.optim`` makes (``adamw_torch_fused``, the Trainer's
    default on torch >= 2.8: ``adamw-fused``, whose step allocates no temporaries)."""
    name = str(getattr(args, "optim", "") or "").lower()
    if "adam" not in name:
        return "none"
    if "8bit" in name:
        return "adamw8bit"
    return "adamw-fused" if "fused" in name else "adamw"
