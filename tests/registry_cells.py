"""The cells of the registry zoo (issue 29): one treatment, or ``remat.plan``, on one model, classified.

:func:`run_cell` applies a treatment with the plain or the chunked head to a fresh copy of a
:mod:`registry_zoo` case and trains it beside an untouched copy (:func:`zoo.compare`, :mod:`oracle`'s: two SGD
steps, same batch and seeds, fp32, dropout on); :func:`run_plan_cell` plans on fake tensors
(:func:`zoo.run_plan`), applies the plan of the smallest peak and trains it the same way;
:func:`run_model` runs every cell of one model type. A :class:`Cell` is

- ``exact``: loss, every gradient and every buffer ``torch.equal``, and the treatment did
  something (a recomputing one ran more aten ops than the same model without it, an offloading
  one moved bytes: :func:`oracle.check_mechanism`);
- ``rounding``: not bitwise equal for a reason named in ``detail`` and within :data:`ROUNDING`
  (or, beyond it, within :data:`FLOAT64_ROUNDING` when the cell is run again in float64)
  -- only the chunked head (its loss is summed a chunk at a time), so the baseline of its
  recompute check is the same model with the chunked head alone, and the tiled treatments
  (:data:`TILED`: their weight gradients are summed a chunk of :data:`TILE_TOKENS` tokens at a
  time), whose mechanism check is that a tiled sub-module was called on more tokens than a chunk
  and never ran on more (:func:`counted_tiles`);
- ``refused``: remat raised ValueError/TypeError with a ``raise`` of its own (the innermost frame is
  in remat) before touching the model, and its first line quotes no crash it caught
  (:data:`WRAPPED_CRASH`); ``detail`` is that line;
- ``refused late``: the same, raised from inside the first step (a
  :class:`remat.treat.refusals.StepRefusal`, or one of :data:`RUNTIME_REFUSALS`), where what remat
  must know is decided by the model's code on its inputs; remat must have taken itself off the
  model then (no patch of remat's left on it), else the cell is a FAIL;
- ``FAIL``: anything else -- a crash, a difference beyond rounding, a treatment that did nothing,
  an error raised inside the model under remat.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import time
import traceback
import warnings
from dataclasses import dataclass

import oracle
import registry_zoo as rz
import torch
import zoo

ROUNDING = 1e-5
"""The largest norm-wise relative difference of the first step called fp32 rounding: the chunked
head sums the loss a chunk at a time, so its loss and gradients differ from the plain head's in
the last bits (1e-7 to 1e-6 on most models)."""
ROUNDING_LATER = 1e-4
"""The same for the second step, which starts from weights that already differ by the first
step's rounding: a model that amplifies a change of its weights (DeepSeek-V4's hyper-connection
head, a Sinkhorn normalisation) shows it there tenfold."""


TILED = ("tiled", "full+tiled")
"""The tiled treatments the sweep adds to :data:`zoo.TREATMENTS` (issue 28's, on every architecture)."""
SWEEP_TREATMENTS = zoo.TREATMENTS + TILED
"""The sweep's treatment columns, in order."""
TILE_TOKENS = 3
"""Tokens per chunk of the tiled cells: fewer than any model's sequence here, so every tiled call is
cut into chunks (the default, 8,192, would run each in one)."""


@dataclass(frozen=True)
class Cell:
    """One cell of the sweep: a treatment with a head, or ``remat.plan``, on one model."""

    model: str
    column: str
    """A treatment of :data:`SWEEP_TREATMENTS`, ``keep`` (the head alone) or ``plan``."""
    head: str
    """``plain`` or ``chunked``; ``plan`` cells: the head of the applied plan."""
    verdict: str
    """``exact`` (``torch.equal`` everywhere), ``rounding`` (within :data:`ROUNDING`, for a
    named reason), ``refused`` (remat raised ValueError/TypeError before touching the model),
    ``refused late`` (in the first step, remat taken off the model), ``not built`` or ``FAIL``
    (anything else)."""
    detail: str = ""
    """The refusal's or failure's first line, the rounding's reason, the plan applied."""
    max_rel: float = 0.0
    seconds: float = 0.0


def _raised_by_remat(error: BaseException) -> bool:
    """Whether remat raised ``error`` on purpose: the innermost frame is in remat and is a ``raise``
    statement (a TypeError of an operator inside remat is a crash, not a refusal)."""
    import remat
    frames = traceback.extract_tb(error.__traceback__)
    root = os.path.dirname(os.path.abspath(remat.__file__))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(root) and \
        (frames[-1].line or "").lstrip().startswith("raise")


# refusals remat makes only once the model runs, each telling what to use instead: selective sees an
# in-place change to an output it keeps only in the forward (tests/test_zoo.py's IN_PLACE_INTO_KEPT);
# the chunked head sees how the model calls its lm_head and treats its logits only in the forward;
# a tiled sub-module learns that its block calls it with more than the hidden states only then.
# Any other error in a step is a failure (GIT's "20 targets for 150 hidden-state rows" among them)
RUNTIME_REFUSALS = ("modifies in place", "use head='plain'", "with the hidden states alone",
                    "remat.apply has been undone")


# a refusal that quotes a crash it caught ("could not profile X's head: IndexError: ...") is not clear
WRAPPED_CRASH = re.compile(r"\b(IndexError|KeyError|AttributeError|TypeError|RuntimeError|AssertionError|NameError)\b:")


def _refusal(error: BaseException, running: bool = False) -> bool:
    return isinstance(error, (ValueError, TypeError)) and _raised_by_remat(error) and \
        not WRAPPED_CRASH.search(str(error).strip().splitlines()[0] if str(error).strip() else "") and \
        (not running or any(text in str(error).lower() for text in RUNTIME_REFUSALS))


_CHUNKED: dict = {}  # id(case) -> (aten ops, bytes saved for backward) of one step with the chunked head alone

FLOAT64_ROUNDING = 1e-9
"""A cell beyond :data:`ROUNDING` in fp32 for a reason that sums in another order (the chunked head,
tiling) is run again in float64 (:func:`_in_float64`): rounding falls there to ~1e-13 (tiling), a
difference of the mathematics stays as large. The chunked head computes its loss in fp32 also in a
float64 model (as HF's ``logits.float()`` does), so its cells must come within :data:`ROUNDING` in
float64, where the model no longer amplifies that rounding. Models that amplify their weights'
rounding through BatchNorm over conv stages (CvT) or many pooled layers (Funnel) exceed the fp32
bounds on some CPUs (an AMD EPYC here; an earlier sweep's CPU did not)."""
_FLOAT64: dict = {}  # id(case) -> the case in float64


def _float64_case(case: zoo.Case) -> zoo.Case:
    """``case`` built and fed in float64 (one per case, so that zoo.build's copy is reused)."""
    if id(case) not in _FLOAT64:
        def batch(model):
            found = case.batch(model)
            if isinstance(found, torch.Tensor):
                return found.double() if found.is_floating_point() else found
            return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                    for k, v in found.items()}
        _FLOAT64[id(case)] = dataclasses.replace(case, name=f"{case.name} (float64)",
                                                 build=lambda: case.build().double(), batch=batch)
    return _FLOAT64[id(case)]


def _in_float64(the_case, spec, head, steps: int = 2):
    """The largest relative difference of the cell run in float64, or None where it cannot run so."""
    import remat
    case = _float64_case(the_case)
    try:
        model = zoo.build(case)
        reference = copy.deepcopy(model)
        remat.apply(model, spec, head=None if head == "plain" else head, blocks=case.blocks,
                    offload_options=zoo.INLINE_OFFLOAD, tile_tokens=TILE_TOKENS if spec in TILED else None)
        return zoo.compare(case, treated=model, reference=reference, steps=steps).max_rel
    except Exception:  # noqa: BLE001 - a model that does not run in float64 keeps its fp32 verdict
        return None


def _verdict(spec, head, model, comparison, baseline, tiles=None, the_case=None, blocks=None) -> tuple:
    """``(verdict, detail, largest difference)`` of a cell; ``the_case``: run it again in float64 where
    fp32 rounding is exceeded for a reason that sums in another order (None: the plan cells, whose
    plan is not a spec to apply again); ``blocks``: the case's, as given to ``remat.apply``."""
    baseline_ops, baseline_saved = baseline
    oracle.check_mechanism(model, comparison, blocks=blocks, reference_ops=baseline_ops, reference_saved=baseline_saved)
    if spec in TILED:  # a call of more rows than a chunk, and no sub-module run on more than a chunk
        assert tiles["calls"] and tiles["largest_chunk"] <= TILE_TOKENS < tiles["largest_call"], \
            f"{spec!r} did not run its sub-modules in chunks of {TILE_TOKENS} tokens: {tiles}"
    if comparison.first_difference is None:
        return "exact", "", 0.0
    steps = ", ".join(f"{r:.1e}" for r in comparison.max_rel_by_step)
    reasons = (["chunked loss summed a chunk at a time"] if head == "chunked" else []) + (
        [f"weight gradients summed over chunks of {TILE_TOKENS} tokens"] if spec in TILED else [])
    if reasons and comparison.max_rel_by_step[0] <= ROUNDING and comparison.max_rel <= ROUNDING_LATER:
        return "rounding", f"{'; '.join(reasons)}: largest difference {steps} by step " \
                           f"({comparison.worst})", comparison.max_rel
    if reasons and the_case is not None:
        in_float64 = _in_float64(the_case, spec, head)
        # the chunked head computes its loss in fp32 also for a float64 model, as HF's .float() does
        bound = ROUNDING if head == "chunked" else FLOAT64_ROUNDING
        if in_float64 is not None and in_float64 <= bound:
            return "rounding", f"{'; '.join(reasons)}: largest difference {steps} by step in fp32 " \
                               f"({comparison.worst}), {in_float64:.0e} in float64", comparison.max_rel
    return "FAIL", f"{comparison.first_difference}; largest relative difference {steps} by step " \
                   f"({comparison.worst})", comparison.max_rel


def _rows(args, kwargs) -> int:
    """Token rows of the one tensor a tiled sub-module is called with (0 if there is none)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return tensors[0].numel() // tensors[0].shape[-1] if tensors and tensors[0].dim() else 0


@contextlib.contextmanager
def counted_tiles(model):
    """``{"calls", "largest_call", "largest_chunk"}`` over the ``with``: the tiled sub-modules'
    calls with gradients on, the most token rows one was called with, and the most one run of the
    sub-module's own forward was handed (one run per chunk, in forward and in backward). Each tiled
    patch (:mod:`remat.treat.tiled`) is wrapped to count; unwrapped at the end."""
    from remat.treat import patches
    counts = {"calls": 0, "largest_call": 0, "largest_chunk": 0}
    wrapped = []
    for patch in patches.patches(model, tag="tiled"):
        function, previous = patch.function, patch.call_previous

        def call(patch, *args, _function=function, **kwargs):
            if torch.is_grad_enabled():
                counts["calls"] += 1
                counts["largest_call"] = max(counts["largest_call"], _rows(args, kwargs))
            return _function(patch, *args, **kwargs)

        def chunk(*args, _previous=previous, **kwargs):
            counts["largest_chunk"] = max(counts["largest_chunk"], _rows(args, kwargs))
            return _previous(*args, **kwargs)
        patch.function, patch.call_previous = call, chunk
        wrapped.append((patch, function))
    try:
        yield counts
    finally:
        for patch, function in wrapped:
            patch.function = function
            del patch.call_previous  # the instance attribute: the method again


@zoo._one_thread
def run_cell(the_case: zoo.Case, spec: str, head: str = "plain", steps: int = 2) -> Cell:
    """Apply ``spec`` (and ``head``) to a fresh copy of the case and train it beside an untouched one
    (a tiled ``spec`` in chunks of :data:`TILE_TOKENS`)."""
    import remat
    start = time.perf_counter()
    model = zoo.build(the_case)
    reference = copy.deepcopy(model)
    try:
        try:
            remat.apply(model, spec, head=None if head == "plain" else head, blocks=the_case.blocks,
                        offload_options=zoo.INLINE_OFFLOAD, tile_tokens=TILE_TOKENS if spec in TILED else None)
        except Exception as error:  # noqa: BLE001
            if _refusal(error):
                return Cell(the_case.name, spec, head, "refused", rz.first_line(error),
                            seconds=time.perf_counter() - start)
            raise
        oracle.check_installed(model, the_case.blocks)
        with counted_tiles(model) as tiles:
            comparison = zoo.compare(the_case, treated=model, reference=reference, steps=steps)
        if spec == "keep" and head == "chunked":
            _CHUNKED[id(the_case)] = (comparison.ops, comparison.treated.saved_bytes)
        # the chunked head's cells beat the chunked head alone, not the untouched model
        baseline = (comparison.reference_ops, None) if head == "plain" or spec == "keep" else \
            _CHUNKED.get(id(the_case), (0, None))
        verdict, detail, worst = _verdict(spec, head, model, comparison, baseline, tiles, the_case,
                                          the_case.blocks)
    except Exception as error:  # noqa: BLE001 -- the sweep records every failure instead of stopping
        detail = rz.first_line(error)
        verdict = "refused late" if _refusal(error, running=True) else "FAIL"
        if verdict == "refused late" and _remat_left_on(model):
            verdict, detail = "FAIL", "refused in the step, but remat is still on the model: " + detail
        return Cell(the_case.name, spec, head, verdict, detail, seconds=time.perf_counter() - start)
    return Cell(the_case.name, spec, head, verdict, detail, worst, time.perf_counter() - start)


def _remat_left_on(model) -> bool:
    """Whether any patch of remat's is on ``model`` (a refusal from inside a step must take them off)."""
    from remat.treat import patches
    return bool(patches.patches(model))


def _plan_text(plan) -> str:
    counts = {}
    for treatment in plan.blocks.values():
        counts[treatment] = counts.get(treatment, 0) + 1
    return ", ".join(f"{n}x {t}" for t, n in sorted(counts.items())) + f"; {plan.head} head"


@zoo._one_thread
def run_plan_cell(the_case: zoo.Case, steps: int = 2) -> Cell:
    """``remat.plan`` on fake tensors (:func:`zoo.run_plan`: the model left as found), then the
    plan of the smallest peak applied to a fresh copy and trained beside an untouched one."""
    import remat
    start = time.perf_counter()
    head = "plain"
    try:
        try:
            _, smallest = zoo.run_plan(the_case, smallest=True)
        except Exception as error:  # noqa: BLE001
            if _refusal(error):
                return Cell(the_case.name, "plan", head, "refused", rz.first_line(error),
                            seconds=time.perf_counter() - start)
            raise
        model = zoo.build(the_case)
        reference = copy.deepcopy(model)
        remat.apply(model, smallest, blocks=the_case.blocks, offload_options=zoo.INLINE_OFFLOAD)
        head = smallest.head
        comparison = zoo.compare(the_case, treated=model, reference=reference, steps=steps)
        verdict, detail, worst = _verdict("plan", head, model, comparison, (comparison.reference_ops, None),
                                          blocks=the_case.blocks)
        detail = detail or _plan_text(smallest)
    except Exception as error:  # noqa: BLE001
        return Cell(the_case.name, "plan", head, "FAIL", rz.first_line(error), seconds=time.perf_counter() - start)
    return Cell(the_case.name, "plan", head, verdict, detail, worst, time.perf_counter() - start)


def run_model(model_type: str, emit=print) -> None:
    """Every cell of one model type, each handed to ``emit`` as it finishes (the head alone first:
    its op count is the chunked treatments' baseline)."""
    the_case = rz.case(model_type)
    start = time.perf_counter()
    try:
        rz.check_built(the_case)
    except zoo.Unavailable as reason:
        emit(Cell(model_type, "build", "plain", "not built", str(reason), seconds=time.perf_counter() - start))
        return
    emit(run_cell(the_case, "keep", "chunked"))
    for spec in SWEEP_TREATMENTS:
        for head in ("plain", "chunked"):
            emit(run_cell(the_case, spec, head))
    emit(run_plan_cell(the_case))


@contextlib.contextmanager
def quiet():
    """Warnings off (deprecations, offload on the CPU ...): the sweep's cells say what matters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
