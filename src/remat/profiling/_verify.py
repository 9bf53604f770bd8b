"""A compiled plan measured on one real compiled step, before ``remat.plan`` hands it out.

Why: a compiled plan's peak is predicted from each block compiled alone plus two calibration
steps of uniform plans (:mod:`remat.profiling._compiled`). The whole model compiled as one graph
can keep more around a mix of treatments than either shows, and by more than the compile
margin (:data:`remat.planner.COMPILE_MARGIN`): a mixed plan can peak over its budget. An eager plan's
peak is predicted to the megabyte and needs no such check. A compiled one is checked here, so
the budget a user gives is one the plan was seen to keep.

How (:func:`measure_compiled`): the plan is applied as the user applies it (the caller hands in
the function that does, :func:`remat.apply`: this package sits below the API and never imports
it) and the model compiled as the plan's scope says (the whole model as ``Module.compile()`` does, or
each block alone), inside :func:`remat.treat.patches.suspended` and
:func:`remat.profiling.snapshot.preserved`, so the model comes back as it was: its own plan,
gradients, buffers and random state. :func:`remat.profiling._compiled.compiled_steps` runs two
steps that compile and two measured ones; the peak counts static memory as the profile does, so
it compares with the plan's predicted peak and its budget. The steps' compiled graphs are taken
back out of dynamo's cache afterwards, and only they (:mod:`remat.treat.dynamo_cache`): the user's
``model.compile()`` then starts clean, and what else the process compiled stays compiled.
:func:`room_to_measure` says whether the plan's bound fits in this GPU's free memory at all: a
plan made for a larger budget than this GPU has free is returned unmeasured, and says so.

The re-planning of a plan measured over its budget is :func:`remat.planner.verified`'s.
Limits: the measurement holds for this process: in it a plan peaks what its measurement said,
but the same plan in fresh processes peaks differently from one to the next (compiled graphs
differ), so a plan saved and run in another process keeps only the compile margin.
"""
from __future__ import annotations

import contextlib
import statistics

import torch
from torch.utils._pytree import tree_map

from remat.profiling._compiled import BACKEND, compiled_steps, profile_scope
from remat.profiling.snapshot import preserved
from remat.treat import patches
from remat.treat.discovery import discover


def room_to_measure(model, prof, chosen) -> "str | None":
    """None when ``chosen`` (a plan of ``prof``) can run on ``model``'s GPU now (its bound within
    :func:`remat.profiling._calibrate.step_room`); else why not."""
    from remat.planning.simulator import simulate
    from remat.profiling._calibrate import FREE_SHARE, step_room
    from remat.units import format_size
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the model is on {device}, not a GPU"
    room = step_room(device)
    bound = simulate(prof, chosen).bound_bytes
    if bound > room:
        return (f"the plan needs up to {format_size(bound)}, more than {FREE_SHARE:.0%} of this GPU's free memory "
                f"with the model ({format_size(room)})")
    return None


def measure_compiled(model, batch, loss_fn, chosen, prof, *, apply_plan, blocks=None, backend: str = BACKEND) -> dict:
    """``chosen`` applied to ``model`` by ``apply_plan(model, plan, blocks=blocks)`` (:func:`remat.apply`)
    and compiled as its profile's scope says: ``{"peak_bytes", "step_s"}`` of two measured steps after
    two that compile (``loss_fn(model, batch)``: one step's loss, as
    :func:`remat.profiling.profiler.model_loss` gives it). The steps run forward and backward: the
    optimizer's step, which is not compiled with them, is taken at its prediction
    (``optimizer_step_peak_bytes``), and ``peak_bytes`` is the larger. The model comes back as it was."""
    scope = profile_scope(prof.notes) or "model"
    device = next(model.parameters()).device
    batch = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, batch)
    with preserved(model), patches.suspended(model):
        model.train()
        apply_plan(model, chosen, blocks=blocks)
        named = discover(model, blocks).blocks(model)
        # each step clears its gradients; preserved gives the user's back; the compiled graphs leave
        # dynamo's cache when the steps end (remat.treat.dynamo_cache)
        steps, peak = compiled_steps(model, batch, loss_fn, named, contextlib.nullcontext(), backend,
                                     prof.static_bytes, scope, timed=2)
    from remat.planning.simulator import simulate
    stepped = [p.peak_bytes for p in simulate(prof, chosen).timeline if p.name.startswith("optimizer step")]
    measured = {"peak_bytes": max([peak] + stepped), "step_s": statistics.median(s[2] for s in steps)}
    if stepped:
        measured.update(steps_peak_bytes=peak, optimizer_step_peak_bytes=stepped[0])
    return measured

