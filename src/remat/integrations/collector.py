"""Python's garbage collector between training steps, never inside one, on every rank at once.

    collector = StepCollector(every=50)
    collector.start()                  # collect now, then no automatic collection
    for step, batch in enumerate(loader, 1):
        train_step(batch)
        collector.step(step)           # a full collection every 50 steps, between steps
    collector.stop()                   # Python's automatic collection as it was

Why: under several ranks (FSDP2, DDP) an automatic collection starts on one rank whenever its
allocation counters say so, in the middle of a step, and every other rank waits for it at the next
collective (selective-heavy FSDP2 plans and DDP plans ran measurably slower with it: the record is
``benchmarks/results/issue12``). A collection every ``every`` steps at the step's end happens at the
same step on every rank, so they pause together, once. torchtitan and torchtnt train the same way.

How: :meth:`StepCollector.start` runs one full collection and turns automatic collection off;
:meth:`step` runs a full one on every ``every``-th step; :meth:`stop` turns automatic collection back
on if it was on at :meth:`start`. ``every=0`` leaves Python's collector alone. :func:`collect_every`
is what the integrations pass: ``"auto"`` is :data:`EVERY` steps under several ranks and 0 on one
(where a collection delays one process only, hidden while the GPU runs ahead).

Limits: objects in reference cycles live until the next full collection, so a loop that makes much
cyclic garbage holds more host memory between collections. A loop that raises between :meth:`start`
and :meth:`stop` leaves automatic collection off unless the caller stops the collector
(``try/finally``; the Hugging Face Trainer calls no callback on an exception, one reason
``RematCallback`` does this only under several ranks, where a failed rank ends its process).
"""
from __future__ import annotations

import gc
from typing import Callable, Optional, Union

EVERY = 50
"""Steps between full collections under several ranks (torchtitan's default, too)."""


def collect_every(setting: Union[int, str], world_size: int) -> int:
    """The steps between collections that ``setting`` means for ``world_size`` ranks: ``"auto"``
    is :data:`EVERY` under several ranks and 0 (Python's own collection) on one; an int is itself."""
    if setting == "auto":
        return EVERY if world_size > 1 else 0
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"collect_every must be 'auto', 0 (Python's automatic collection) or a positive number "
                         f"of steps, got {setting!r}")
    return setting


class StepCollector:
    """Full collections every ``every`` steps between steps, none inside one (see the module docstring)."""

    def __init__(self, every: int):
        self.every = collect_every(every, 1)
        self._was_enabled = None   # gc.isenabled() at start(); None while not started

    @property
    def active(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> None:
        if self.every == 0 or self.active:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def step(self, index: int) -> None:
        """After step ``index`` (counted from 1): a full collection every ``every`` steps."""
        if self.active and index > 0 and index % self.every == 0:
            gc.collect()

    def stop(self) -> None:
        if self.active:
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None


def started(setting: Union[int, str], world_size: int, say: Callable[[str], None],
            unit: str = "steps") -> Optional[StepCollector]:
    """What the training callbacks run: a started collector for ``setting`` under ``world_size``
    ranks, announced once through ``say``; None where ``setting`` leaves collection to Python."""
    every = collect_every(setting, world_size)
    if not every:
        return None
    collector = StepCollector(every)
    collector.start()
    say(f"remat: Python's garbage collector runs between {unit}, every {every} {unit} on every rank, not inside "
        "one (a collection on one rank mid-step stalls the others at the next collective); "
        "RematCallback(collect_every=0) leaves it to Python")
    return collector
