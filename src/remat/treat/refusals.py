"""The error remat raises when it refuses a model from inside a training step.

Most refusals come at ``remat.apply``, before the model is touched. A few can only come once the
model runs, where what remat must know is decided by the model's code on its inputs: selective's
guard sees a block write in place into an output selective keeps; a tiled sub-module learns that
its block calls it with more than the hidden states; the chunked head sees how the forward calls
its ``lm_head`` and post-processes the logits; a treated block is handed state a recompute cannot
see as its forward saw it (:mod:`remat.treat.block_state`). Those raise :class:`StepRefusal`, from
inside the model's forward. :func:`remat.apply` wraps the model's ``forward`` so that a
``StepRefusal`` passing through it takes every change remat made to the model back off before it
reaches the caller, and says so: the model is then the model as it was without remat, and the
next step trains it untouched. The forward that raised ran only part of the way, and no gradient
of it exists.

A ``StepRefusal`` is a ``ValueError``: code that catches remat's refusals by that class still does.
One raised in backward (a recompute that would see other values than its forward saw) cannot take
remat off: it is raised as a plain ``ValueError`` whose message says what to change.
"""
from __future__ import annotations


class StepRefusal(ValueError):
    """remat refuses the model from inside its forward; the message names what and what to do."""


UNDONE = (" remat.apply has been undone (every change remat made to this model is taken off): the model is as "
          "it was before it, and trains untouched from the next step; this forward stopped part of the way and "
          "computed no gradient.")
"""What :func:`remat.apply`'s wrapper appends to a ``StepRefusal`` once it has taken remat off."""
