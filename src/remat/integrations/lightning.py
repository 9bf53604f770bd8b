"""remat inside a Lightning ``Trainer``: one callback.

    trainer = L.Trainer(..., callbacks=[RematCallback(budget="40GiB")])   # or spec="full", head="chunked"

How it fits Lightning's order of hooks (``Trainer.fit``): callbacks' ``setup`` -> the module's
``setup`` -> ``configure_model`` -> the strategy wraps the model (DDP, FSDP) and moves it to its
device -> ``on_fit_start`` -> for each batch ``on_train_batch_start(batch)``.

- ``spec=`` is applied in ``setup("fit")``, before any strategy wraps or shards the model (remat goes
  before FSDP2 ``fully_shard`` and ``torch.compile``). A module that builds its network in
  ``configure_model`` gets it at ``on_fit_start`` instead (fine for one device and DDP); under FSDP
  with ``configure_model``, call ``remat.apply(self, spec)`` at the end of ``configure_model``.
- ``budget=``: the plan is made from the first real batch (Lightning hands callbacks each batch, on
  its device) and again before every batch with more tokens than any planned so far (as
  :class:`remat.Guard` counts them), the head mode kept.
- On CUDA, after ``report_after_steps`` batches the measured peak is printed beside the prediction.
- Under several ranks Python's garbage collector runs between batches, every 50, on every rank at
  once (:mod:`remat.integrations.collector`; ``collect_every=0`` leaves it to Python); ``on_fit_end``
  and, unlike the Hugging Face Trainer, ``on_exception`` give Python its collector back.

The loss the planner measures: ``loss_fn(module, batch)`` if given; else, for a dict batch,
``lm(**batch).loss`` of the Hugging Face causal LM inside the LightningModule (the first submodule
with a ``config`` and an output embedding). ``training_step`` itself is not used: it may call
``self.log``, which Lightning only allows inside its loop.

Limits: the budget is for one device; planning on a GPU profiles the model for a few seconds at the
first batch and at each new longest one; an out-of-memory step is not redone (use
:class:`remat.Guard` in a manual-optimisation ``training_step`` for that).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch.nn as nn
from lightning.pytorch import Callback

from remat.integrations._planning import BatchPlanner
from remat.integrations.collector import collect_every as collect_every_steps, started


class RematCallback(BatchPlanner, Callback):
    """A Lightning ``Callback`` that applies a spec or plans remat from the real batches (module docstring).

    Args:
        budget: peak memory of one device (``"24GiB"``; None on CUDA: 90% of what the device can give).
        spec: apply this instead of planning.
        head: ``"plain"`` or ``"chunked"`` to fix the head mode (default: the planner chooses).
        loss_fn: ``loss_fn(module, batch) -> loss`` for the planner (default: the Hugging Face
            causal LM inside the module, ``lm(**batch).loss``).
        blocks: which modules are the blocks (as :func:`remat.apply` takes it).
        report_after_steps: after how many batches the measured peak is printed (CUDA).
        profile_device: where plans are profiled (as :class:`remat.Guard` takes it).
        say: where messages go (default: stderr).
        collect_every: Python's garbage collection between batches (``"auto"``: every 50 under
            several ranks; 0: Python's own; an int: that many batches).
        **plan_options: passed to :func:`remat.plan`.

    Raises:
        ValueError: both ``budget`` and ``spec``; an unknown ``head``, budget, ``profile_device``
            or ``collect_every``. TypeError (at the first batch): a batch whose loss cannot be told
            without ``loss_fn``.
    """

    def __init__(self, budget=None, spec=None, *, head: Optional[str] = None, loss_fn=None, blocks=None,
                 report_after_steps: int = 2, profile_device: str = "auto",
                 say: Optional[Callable[[str], None]] = None, collect_every: Union[int, str] = "auto",
                 **plan_options):
        collect_every_steps(collect_every, 1)   # a bad value fails here, not when training starts
        super().__init__(budget, spec, head=head, report_after_steps=report_after_steps,
                         profile_device=profile_device, say=say, plan_options=plan_options)
        self.loss_fn = loss_fn
        self.blocks = blocks
        self.collect_every = collect_every
        self._collector = None
        self._steps = 0

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and self.spec is not None and _has_blocks(pl_module, self.blocks):
            self._apply_spec(pl_module, self.blocks)

    def on_fit_start(self, trainer, pl_module):
        from remat.api import current_plan
        if self.spec is not None and current_plan(pl_module) is None:
            self._apply_spec(pl_module, self.blocks)   # built in configure_model: no blocks at setup
        self._collector = started(self.collect_every, trainer.world_size, self.say, unit="batches")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.spec is None:
            self.plan_if_longer(pl_module, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._steps += 1
        if self._collector is not None:
            self._collector.step(self._steps)
        self.report_peak(pl_module, self._steps, "batches")

    def on_fit_end(self, trainer, pl_module):
        self._stop_collecting()

    def on_exception(self, trainer, pl_module, exception):
        self._stop_collecting()

    def _stop_collecting(self) -> None:
        if self._collector is not None:
            self._collector.stop()
            self._collector = None

    def _options(self, module: nn.Module, batch) -> dict:
        return dict(self.plan_options, blocks=self.blocks, loss_fn=self.loss_fn or _default_loss(module, batch))


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
