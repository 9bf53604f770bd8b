"""``remat.verify``: a treatment checked on the user's own model and batch, as a careful engineer would.

    result = remat.verify(model, batch, "full+tiled")      # or a Plan; None: what is applied now
    print(result)                                         # the verdict, why, and a table
    assert result.verdict != "wrong"

How: the model runs one training step (train mode, dropout on) untouched -- remat's patches taken off
(:func:`remat.treat.patches.suspended`), Hugging Face checkpointing off -- then treated, then untouched
again, each from the same parameters, buffers and random state, so a treatment that preserves the RNG
gives the same dropout masks. Compared: the loss, every parameter gradient, the gradient of every
floating tensor of the batch (given ``requires_grad`` on a fresh copy; the user's batch is untouched)
and every buffer after the step. Each is ``bitwise``, ``within rounding`` or ``wrong``:

- ``difference``: ``rms(treated - untouched) / max(rms(untouched), SCALE_FLOOR * G)``, ``G`` the rms of
  every parameter gradient of the untouched step: a tensor is measured against its own size, and
  one whose true value is about zero (a key projection's bias: softmax ignores a bias shared by every
  key) against the model's gradient scale, not against its own noise ("rel 2.1" over 1e-12 is not an
  error).
- float64: where the model allows it (room for a float64 copy, every op in float64), both runs are
  made again on a float64 copy, every floating op forced to float64 (:class:`_Float64`: the model's own
  upcasts to float32, autocast, ``torch.zeros`` without a dtype). A difference that shrinks by
  ``1 / SHRINK`` or more there (or is at float64's own noise, ``FLOAT64_NOISE``) is rounding: the same
  sums taken in another order (tiled tokens, a chunked loss). One that does not is wrong: the
  treatment computes something else (other dropout masks, a wrong cache).
- without float64 (no room, an op that refuses float64, ``float64=False``): within ``sqrt(eps)`` of
  the working dtype (fp32 3.5e-4, bf16 0.088) is rounding, beyond it wrong; the result says that this
  is the weaker test.

A treated step that torch's checkpoint refuses (``CheckpointError``: its recompute saved other tensors
than its forward, e.g. a cache appended to twice) is ``wrong`` too, with the error; any other error of
either step is raised as it is.

The untouched model run twice tells whether it can be compared at all: where its second run differs
from its first (nondeterministic kernels, a forward that changes state outside its parameters and
buffers) the result says why, names the state that changed, and judges each tensor against the
model's own run-to-run difference (``reference_spread``) instead of bitwise. On CUDA the treated step
is also measured (peak allocated and reserved, step time, median of ``timed_steps``) beside the plan's
prediction (``plan.notes``) and the untouched step.

Left as it was: parameters (the same objects), gradients, buffers, training flags, RNG states, the
applied remat plan and Hugging Face's switches; the float64 copy is dropped. Limits: one step, eager
(a compiled model runs uncompiled here); the untouched step must fit in memory (a model that needs
remat to fit at all: verify at a shorter length, the arithmetic of a treatment does not depend on it);
a parameter written in place by the forward cannot be put back (reported).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointError

from remat.api import apply, batch_check_held, current_plan
from remat.diagnosis.findings import Finding, hf_checkpointing_on, unwrapped
from remat.diagnosis.run_checks import eager
from remat.planning.plans import Plan
from remat.profiling.snapshot import restore, snapshot
from remat.treat import mask_skip, patches

VERDICTS = ("bitwise", "within rounding", "wrong")
"""Best first; a result's verdict is its worst tensor's."""
SCALE_FLOOR = 1e-3
"""A tensor's difference is measured against at least this fraction of the model's gradient rms."""
SHRINK = 1e-3
"""A float64 difference at most this fraction of the working-precision one is rounding."""
FLOAT64_NOISE = 1e-10
"""A float64 difference this small (of the scale) is float64's own rounding, whatever it was before."""
SPREAD_MARGIN = 10.0
"""A nondeterministic model's tensor within this many times its own run-to-run difference is not wrong."""
FLOAT64_ROOM = 4
"""A float64 copy is made where this many times its parameters' bytes are free (copy, gradients, steps)."""
FLOAT64_CPU_PARAMETERS = 300_000_000
"""Above this many parameters a float64 re-run on the CPU would take minutes: scale-based judgement."""


@dataclass(frozen=True)
class TensorCheck:
    """One compared tensor."""

    name: str
    """``"loss"``, ``"gradient of <parameter>"``, ``"gradient of input <key>"`` or ``"buffer <name>"``."""
    kind: str
    """``"loss"``, ``"parameter"``, ``"input"`` or ``"buffer"``."""
    verdict: str
    """One of :data:`VERDICTS`."""
    difference: float = 0.0
    """``rms(treated - untouched)`` over the tensor's scale (module docstring); 0.0 when bitwise."""
    float64_difference: Optional[float] = None
    """The same in the float64 re-run; None where there was none."""
    reference_spread: float = 0.0
    """The untouched model's own difference between two identical runs (0.0: deterministic)."""
    why: str = ""
    """How the verdict was reached, in words (empty when bitwise)."""


@dataclass(frozen=True)
class Measured:
    """The treated step on CUDA beside its prediction and the untouched step (bytes, seconds)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    step_s: float
    reference_peak_allocated_bytes: int
    reference_peak_reserved_bytes: int
    reference_step_s: float
    predicted_peak_bytes: Optional[int] = None
    """``plan.notes["predicted_peak_bytes"]`` (None: not a plan from :func:`remat.plan`)."""
    predicted_step_s: Optional[float] = None
    optimizer_state_bytes: int = 0
    """Optimizer state the prediction counts and this step (no optimizer) does not hold."""


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found; ``str()`` gives the verdict, why, and a table."""

    verdict: str
    """The worst tensor's verdict: ``bitwise``, ``within rounding`` or ``wrong``."""
    why: str
    """The verdict in a sentence: how many tensors differ, by how much, and how rounding was told from error."""
    treatment: str
    """What was verified (the plan's summary, or Hugging Face's checkpointing)."""
    model: str
    tensors: tuple
    """Every :class:`TensorCheck`, in the order compared (loss, parameters, inputs, buffers)."""
    float64: str
    """``"ran"``, or why there was no float64 re-run."""
    deterministic: bool = True
    """Whether the untouched model gave the same result twice."""
    problems: tuple = ()
    """What limited the comparison, in words (nondeterminism, changed state, an impure float64 run ...)."""
    measured: Optional[Measured] = None
    dtype: str = ""
    device: str = ""
    batch: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True unless the verdict is ``wrong``."""
        return self.verdict != "wrong"

    def counts(self) -> dict:
        """``{kind: {verdict: count}}``."""
        table = {}
        for check in self.tensors:
            table.setdefault(check.kind, dict.fromkeys(VERDICTS, 0))[check.verdict] += 1
        return table

    def __str__(self):
        return _report(self)


def verify(model: nn.Module, batch, plan_or_spec=None, *, loss_fn: Optional[Callable] = None, blocks=None,
           head: Optional[str] = None, chunk_tokens: Optional[int] = None, tile_tokens=None,
           offload_options: Optional[dict] = None, strict: bool = True, float64: Optional[bool] = None,
           inputs: bool = True, measure: Optional[bool] = None, timed_steps: int = 3) -> Verification:
    """Run ``model`` untouched and treated on ``batch`` and judge every difference (module docstring).

    Args:
        model: the model as it trains (a PEFT wrapper, a model with a remat plan applied or Hugging Face
            checkpointing on, a ``torch.compile`` wrapper: run uncompiled).
        batch: one training batch: a dict of keyword arguments, a tensor of token ids (or of inputs), or
            a tuple of positional arguments.
        plan_or_spec: what to verify: a spec (``"full"``, ``"tiled"``, ``"every:2"``, a mapping), a
            :class:`remat.Plan`, or None: the setup as it is (the applied plan, else Hugging Face's
            checkpointing). ``blocks``, ``head``, ``chunk_tokens``, ``tile_tokens``,
            ``offload_options`` and ``strict`` go to :func:`remat.apply` with it.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default: the output's ``.loss`` (labels =
            ``input_ids`` when a Hugging Face batch has none), or the output itself when it is a scalar.
        float64: re-run in float64 to tell rounding from error; None: where there is room and some
            tensor is not bitwise.
        inputs: also compare the gradients of the batch's floating tensors.
        measure: on CUDA, measure the treated step's peak and time (default: on CUDA).
        timed_steps: treated steps timed for ``measure`` (the median is reported).

    Returns:
        a :class:`Verification`; ``verdict`` is ``"bitwise"``, ``"within rounding"`` or ``"wrong"``.

    Raises:
        TypeError: ``model`` is not a module, or the loss is not a scalar (pass ``loss_fn``).
        ValueError: nothing to verify (no spec, no plan applied, no checkpointing on), a model on the
            meta device, or a spec :func:`remat.apply` refuses.

    Example::

        >>> result = remat.verify(model, {"input_ids": ids, "labels": ids}, "full+tiled")
        >>> result.verdict
        'within rounding'
    """
    started = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.verify expects a torch.nn.Module as its first argument, got {type(model).__name__}; "
                        "call remat.verify(model, batch, 'full')")
    if batch is None:
        raise TypeError("remat.verify needs a training batch (a dict of tensors, a tensor of ids or a tuple of "
                        "arguments) to run the model on; got None")
    if not isinstance(timed_steps, int) or timed_steps < 1:
        raise ValueError(f"timed_steps must be a whole number >= 1, got {timed_steps!r}")
    inner = unwrapped(model)
    first = next(inner.parameters(), None)
    if first is None:
        raise ValueError(f"remat.verify: {type(inner).__name__} has no parameters: there is no gradient to compare")
    if first.device.type == "meta":
        raise ValueError("remat.verify runs the model, and this one is on the meta device (no weights): build it "
                         "with weights (random ones do: presets.build_model(config, device='cpu')), then verify")
    setup = _Setup.of(inner, plan_or_spec, dict(blocks=blocks, head=head, chunk_tokens=chunk_tokens,
                                                tile_tokens=tile_tokens, offload_options=offload_options,
                                                strict=strict))
    measure = first.device.type == "cuda" if measure is None else bool(measure and first.device.type == "cuda")
    runner = _Runner(inner, batch, loss_fn, inputs)
    result = runner.compare(setup, float64=float64, measure=measure, timed_steps=timed_steps)
    return _dataclass_replace(result, seconds=time.perf_counter() - started)


def _dataclass_replace(result: Verification, **changes) -> Verification:
    import dataclasses
    return dataclasses.replace(result, **changes)


# -- what is verified ------------------------------------------------------------------------------
@dataclass
class _Setup:
    """How to make the treated model from the untouched one, and back."""

    name: str
    spec: object = None          # a spec or plan to apply; None: the model's own setup
    options: dict = field(default_factory=dict)
    hf: tuple = ()               # names of modules with Hugging Face checkpointing on (the setup)
    plan: Optional[Plan] = None  # the plan verified, where there is one (its notes hold predictions)
    applied: bool = False        # the setup is the applied remat plan

    @classmethod
    def of(cls, model: nn.Module, plan_or_spec, options: dict) -> "_Setup":
        hf = tuple(name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True)
        options = {k: v for k, v in options.items() if v is not None}
        options["mask_skip"] = bool(patches.patches(model, tag=mask_skip.PATCH_TAG))   # the model's own state
        if plan_or_spec is not None:   # Hugging Face's checkpointing, if on, stays off for both runs
            plan = plan_or_spec if isinstance(plan_or_spec, Plan) else None
            name = plan.summary() if plan is not None else _spec_name(plan_or_spec)
            return cls(name=name, spec=plan_or_spec, options=options, plan=plan)
        applied = current_plan(model)
        if applied is not None:
            return cls(name=f"the applied plan ({applied.summary()})", plan=applied, applied=True)
        if hf:
            return cls(name=f"Hugging Face checkpointing ({_layers_checkpointed(model, hf)})", hf=hf)
        raise ValueError("remat.verify: nothing to verify: the model has no remat plan applied and no Hugging Face "
                         "checkpointing on; pass what to check, e.g. remat.verify(model, batch, 'full') or a "
                         "remat.Plan")

    def treat(self, model: nn.Module, undone: list) -> None:
        """Put the treatment on ``model`` (the untouched one, inside :func:`patches.suspended`)."""
        if self.spec is not None:
            apply(model, self.spec, **self.options)
        elif self.applied:
            patches.reinstall(undone)
        for name in self.hf:
            model.get_submodule(name).gradient_checkpointing = True

    def untreat(self, model: nn.Module) -> None:
        patches.remove(model)
        for name in self.hf:
            model.get_submodule(name).gradient_checkpointing = False


def _spec_name(spec) -> str:
    if isinstance(spec, Mapping):
        counts = collections.Counter(spec.values())
        return ", ".join(f"{n}x {t}" for t, n in counts.most_common())
    return str(spec)


def _layers_checkpointed(model: nn.Module, hf: tuple) -> str:
    """``"every layer"`` or ``"N of M layers"`` (transformers' ``every_n_layers``)."""
    layers = [m for m in model.modules() if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    on = [m for m in layers if getattr(m, "gradient_checkpointing", False) is True]
    return "every layer" if len(on) == len(layers) else f"{len(on)} of {len(layers)} layers"


@contextlib.contextmanager
def _hf_off(model: nn.Module):
    """Hugging Face checkpointing off in every module inside the block, as it was after."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in on:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True


# -- one step ----------------------------------------------------------------------------------------
@dataclass
class _Step:
    """What one training step produced: ``{name: tensor}`` per kind, and its time and peak."""

    tensors: dict                # name -> (kind, tensor or None)
    seconds: float = 0.0
    peak_allocated: int = 0
    peak_reserved: int = 0


def _fresh(batch, want_inputs: bool, dtype=None):
    """A copy of ``batch`` whose floating tensors (at its top level) are new leaves, ``requires_grad``
    when wanted and cast to ``dtype`` when given, and ``{key: leaf}`` of those that require grad."""
    leaves = {}

    def one(value, key):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        leaf = value.detach().to(dtype) if dtype is not None else value.detach().clone()
        if want_inputs:
            leaves[key] = leaf.requires_grad_(True)
        return leaf
    if isinstance(batch, torch.Tensor):
        return one(batch, "batch"), leaves
    if isinstance(batch, Mapping):
        return {k: one(v, str(k)) for k, v in batch.items()}, leaves
    if isinstance(batch, (tuple, list)):
        return type(batch)(one(v, f"[{i}]") for i, v in enumerate(batch)), leaves
    return batch, leaves


def _takes(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def default_loss(model: nn.Module, batch):
    """The scalar a training step calls ``backward`` on, for a batch as :func:`verify` takes it: the
    output's ``.loss`` (a Hugging Face batch of ``input_ids`` without labels is given ``labels =
    input_ids``), or the output when it is a scalar tensor. TypeError otherwise (pass ``loss_fn``)."""
    if isinstance(batch, Mapping):
        given = dict(batch)
        if "labels" not in given and "input_ids" in given and _takes(model, "labels"):
            given["labels"] = given["input_ids"]
        out = model(**given)
    elif isinstance(batch, torch.Tensor):
        out = (model(input_ids=batch, labels=batch) if not batch.is_floating_point() and _takes(model, "labels")
               else model(batch))
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        raise TypeError(f"remat.verify runs a batch given as a dict, a tensor or a tuple, got {type(batch).__name__}; "
                        "pass loss_fn=lambda model, batch: ... to run it yourself")
    if isinstance(out, torch.Tensor):
        loss = out
    else:
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else
                f"{type(out).__name__} without a loss")
        raise TypeError(f"remat.verify needs a scalar loss to call backward on; the model returned {what}. Pass "
                        "loss_fn=lambda model, batch: <scalar> (e.g. model(**batch).logits.float().square().mean())")
    return loss


class _Runner:
    """Runs steps of one model on one batch from one state (module docstring)."""

    def __init__(self, model: nn.Module, batch, loss_fn, inputs: bool):
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn if loss_fn is not None else default_loss
        self.inputs = inputs
        self.problems = []

    def _problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    # the whole comparison ------------------------------------------------------------------------
    def compare(self, setup: _Setup, *, float64, measure: bool, timed_steps: int) -> Verification:
        model = self.model
        state = snapshot(model)
        device = next(model.parameters()).device
        for _, _, p, _, _, _ in state.parameters:
            p.grad = None
        held = state.held_grad_bytes
        before = _fingerprint(model)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(eager(model))
                stack.enter_context(batch_check_held(model))
                undone = stack.enter_context(patches.suspended(model))
                stack.enter_context(_hf_off(model))
                reference = self._step(model, state, keep=True)
                after_first = _fingerprint(model)
                setup.treat(model, undone)
                stack.enter_context(batch_check_held(model))   # a plan for another shape: verify's batch is not it
                failure = ""
                try:
                    treated = self._step(model, state, reference=reference)
                except CheckpointError as error:   # the recompute computed something else than the forward
                    failure = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
                    treated = None
                timed = ([self._step(model, state, timed=True) for _ in range(timed_steps)]
                         if measure and treated is not None else [])
                setup.untreat(model)
                again = self._step(model, state, reference=reference, timed=measure)
                changed = _changed(before, after_first)
                if treated is None:
                    return self._failed(setup, failure, model, device)
                wanted64 = float64 if float64 is not None else not _all_bitwise(treated)
                float64_note, pair64 = "not needed: every tensor is bitwise equal", None
                if wanted64:
                    float64_note, pair64 = self._float64(setup, undone, state)
                elif float64 is False:
                    float64_note = "not asked for (float64=False)"
        finally:
            try:
                restore(state)
            except RuntimeError as error:   # parameters written in place: they cannot be put back
                self._problem(f"the forward writes parameters in place, so they cannot be put back as they were "
                              f"({error})")
        checks, spread_any = _judge(reference, treated, again, pair64, _working_dtype(model))
        deterministic = not spread_any
        if not deterministic:
            self._problem(_nondeterminism(again, changed, device))
        if pair64 is not None and pair64[2]:
            self._problem("the float64 run still computed some ops in lower precision ("
                          + ", ".join(f"{op} x{n}" for op, n in pair64[2].most_common(3))
                          + "): where float64 did not shrink a difference, it was judged against the gradient scale")
        measured = _measured(timed, again, setup, model, held) if measure and timed else None
        verdict = max((c.verdict for c in checks), key=VERDICTS.index, default="bitwise")
        shape = _batch_shape(self.batch)
        return Verification(
            verdict=verdict, why=_why(verdict, checks, float64_note, deterministic, model), treatment=setup.name,
            model=type(model).__name__, tensors=tuple(checks), float64=float64_note, deterministic=deterministic,
            problems=tuple(self.problems), measured=measured, dtype=str(_working_dtype(model)).replace("torch.", ""),
            device=str(device), batch=shape)

    def _failed(self, setup: _Setup, failure: str, model, device) -> Verification:
        return Verification(
            verdict="wrong", treatment=setup.name, model=type(model).__name__, tensors=(), float64="not run",
            why=f"the treated step fails where the untouched one runs ({failure}): its recompute does not compute "
                "what its forward computed", problems=tuple(self.problems),
            dtype=str(_working_dtype(model)).replace("torch.", ""), device=str(device), batch=_batch_shape(self.batch))

    # a step --------------------------------------------------------------------------------------
    def _step(self, model, state, *, keep: bool = False, reference: Optional[_Step] = None, timed: bool = False,
              dtype=None) -> _Step:
        """One training step from ``state``: its tensors kept (``keep``: moved off the GPU), or
        compared with ``reference``'s as they come (:func:`_stats`), or only timed."""
        self._reset(model, state)
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        only_timed = timed and reference is None and not keep
        start = time.perf_counter()
        batch, leaves = _fresh(self.batch, self.inputs and not only_timed, dtype)
        try:
            loss = self.loss_fn(model, batch)
            _check_loss(loss)
            if loss.requires_grad:
                loss.backward()
        except RuntimeError as error:
            if leaves and "leaf Variable that requires grad" in str(error):
                self.inputs = False   # the forward writes into its inputs in place: compare without them
                self._problem("the forward writes into the batch's tensors in place, so their gradients are not "
                              "compared")
                return self._step(model, state, keep=keep, reference=reference, timed=timed, dtype=dtype)
            raise
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peaks = ((torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)) if cuda
                 else (0, 0))
        if only_timed:
            return _Step({}, seconds, *peaks)
        tensors = {"loss": ("loss", loss.detach())}
        for name, p in _named_parameters(model):
            if p.requires_grad:
                tensors[f"gradient of {name}"] = ("parameter", p.grad)
        for key, leaf in leaves.items():
            tensors[f"gradient of input {key}"] = ("input", leaf.grad)
        for name, b in model.named_buffers():
            tensors[f"buffer {name}"] = ("buffer", b.detach())
        if keep:
            stored = {k: (kind, None if t is None else t.detach().to("cpu", copy=True) if cuda else t.detach().clone())
                      for k, (kind, t) in tensors.items()}
            return _Step(stored, seconds, *peaks)
        compared = {k: (kind, _stats(t, reference.tensors.get(k, (kind, _ABSENT))[1]))
                    for k, (kind, t) in tensors.items()}
        for k, (kind, t) in reference.tensors.items():
            if k not in compared:
                compared[k] = (kind, _stats(_ABSENT, t))
        return _Step(compared, seconds, *peaks)

    def _reset(self, model, state) -> None:
        """Parameters, buffers, RNG and flags as they were before verify; no gradients; train mode."""
        try:
            restore(state)
        except RuntimeError as error:
            self._problem(f"the forward writes parameters in place ({error}); the runs start from different weights")
        for _, _, p, _, _, _ in state.parameters:
            p.grad = None
        model.train()

    # float64 -------------------------------------------------------------------------------------
    def _float64(self, setup: _Setup, undone: list, state):
        """``(note, (reference, treated, lower-precision ops))`` from a float64 copy of the treated model (its
        reference run with the copy's patches suspended and Hugging Face's checkpointing off), or
        ``(why not, None)``."""
        model = self.model
        room = _float64_room(model)
        if room is not None:
            return room, None
        self._reset(model, state)    # no gradients to copy
        setup.treat(model, undone)
        try:
            twin = copy.deepcopy(model)   # a treated model deep-copies treated on its own parameters
        except Exception as error:   # accelerate hooks, unpicklable state: judged on the gradient scale
            return f"no float64 copy of the model could be made ({type(error).__name__}: {str(error)[:100]})", None
        finally:
            setup.untreat(model)
        lower = collections.Counter()
        try:
            twin.double().train()
            twin_state = snapshot(twin)
            twin_state.cpu_rng, twin_state.cuda_rng = state.cpu_rng, state.cuda_rng
            with _float64_everywhere(lower), batch_check_held(twin):
                with patches.suspended(twin), _hf_off(twin):
                    reference = self._step(twin, twin_state, keep=True, dtype=torch.float64)
                treated = self._step(twin, twin_state, reference=reference, dtype=torch.float64)
        except Exception as error:   # a kernel without float64 (Triton, flash attention), a dtype check
            return (f"the model does not run in float64 ({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
                    "judged against the gradient scale"), None
        finally:
            patches.remove(twin)
            mask_skip.release(twin)
            del twin
        loss = reference.tensors["loss"][1]
        if loss.dtype != torch.float64:
            return f"the float64 run's loss is {loss.dtype} (the model casts it); judged against the gradient scale", None
        return "ran", (reference, treated, lower)


_ABSENT = object()


def _named_parameters(model):
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"remat.verify: loss_fn must return a floating scalar loss (what backward is called on), got {what}")


def _float64_room(model) -> Optional[str]:
    """None where a float64 copy of ``model`` fits and runs quickly here, else why not."""
    from remat.offload import host_memory
    from remat.units import format_size
    params = {id(p): p for p in model.parameters()}.values()
    count = sum(p.numel() for p in params)
    need = FLOAT64_ROOM * 8 * count
    device = next(iter(params)).device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            return (f"no room for a float64 copy on the GPU ({format_size(need)} wanted, {format_size(free)} free); "
                    "judged against the gradient scale")
        return None
    if count > FLOAT64_CPU_PARAMETERS:
        return (f"a float64 re-run of {count / 1e6:.0f}M parameters on the CPU would take minutes; judged against "
                "the gradient scale (float64=True forces it)")
    available = host_memory().get("available")
    if available is not None and need > available:
        return f"no room for a float64 copy in host memory ({format_size(need)} wanted); judged against the gradient scale"
    return None


class _Float64(TorchDispatchMode):
    """Every op asked for a lower floating dtype computes in float64 instead (``.float()``, autocast's
    casts, ``torch.zeros(..., dtype=torch.float32)``); an op that still makes a lower-precision result
    from float64 values, or from nothing (a copy into a float32 tensor), is counted."""

    def __init__(self, lower: collections.Counter):
        super().__init__()
        self.lower = lower

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dtype = kwargs.get("dtype")
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != torch.float64:
            kwargs["dtype"] = torch.float64
        out = func(*args, **kwargs)
        given = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not given or any(t.dtype == torch.float64 for t in given):   # made here, or from float64 values
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
                    self.lower[str(func.overloadpacket.__name__)] += 1
        return out


@contextlib.contextmanager
def _float64_everywhere(lower: collections.Counter):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64(lower):
            yield
    finally:
        torch.set_default_dtype(previous)


# -- judging -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stats:
    """One tensor of a run against the same tensor of the reference run."""

    bitwise: bool
    diff_rms: float = 0.0
    ref_rms: float = 0.0
    numel: int = 0
    problem: str = ""            # a difference no tolerance accepts (present on one side only, shape, NaN)


def _stats(value, reference) -> _Stats:
    if value is _ABSENT or reference is _ABSENT:
        return _Stats(False, problem="present in one run only")
    if value is None or reference is None:
        if value is None and reference is None:
            return _Stats(True)
        side = "the treated model" if reference is None else "the untouched model"
        return _Stats(False, problem=f"only {side} has a gradient here")
    if value.shape != reference.shape:
        return _Stats(False, problem=f"shape {tuple(value.shape)} against {tuple(reference.shape)}")
    reference = reference.to(value.device)
    if torch.equal(value, reference):
        return _Stats(True, ref_rms=_rms(reference), numel=value.numel())
    if not value.is_floating_point():
        return _Stats(False, problem="integer values differ")
    finite, ref_finite = torch.isfinite(value), torch.isfinite(reference)
    if not torch.equal(finite, ref_finite):
        return _Stats(False, problem="not finite (inf or nan) where the untouched model's is, or the reverse")
    work = torch.float64 if value.dtype == torch.float64 else torch.float32
    diff = torch.where(finite, value.to(work) - reference.to(work), 0)
    return _Stats(False, diff_rms=_rms(diff), ref_rms=_rms(torch.where(ref_finite, reference.to(work), 0)),
                  numel=value.numel())


def _rms(tensor) -> float:
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return 0.0
    return float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)) / math.sqrt(tensor.numel())


def _all_bitwise(step: _Step) -> bool:
    return all(stats.bitwise for _, stats in step.tensors.values())


def _gradient_rms(step: _Step) -> float:
    """The rms of every parameter gradient of a step, from its stats' reference side (or its tensors)."""
    total, count = 0.0, 0
    for kind, value in step.tensors.values():
        if kind != "parameter" or value is None:
            continue
        rms, numel = (value.ref_rms, value.numel) if isinstance(value, _Stats) else (_rms(value), value.numel())
        total += rms * rms * numel
        count += numel
    return math.sqrt(total / count) if count else 0.0


def _relative(stats: _Stats, scale: float) -> float:
    if stats.bitwise:
        return 0.0
    floor = SCALE_FLOOR * scale
    denominator = max(stats.ref_rms, floor, 1e-300)
    return stats.diff_rms / denominator


def _tolerance(dtype) -> float:
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        eps = 2.0 ** -10   # TF32 matmuls keep 10 bits of mantissa
    return math.sqrt(eps)


def _working_dtype(model) -> torch.dtype:
    """The lowest floating precision among the trainable parameters (else any parameter's)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and p.requires_grad} or \
        {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def _judge(reference: _Step, treated: _Step, again: _Step, pair64, dtype) -> tuple:
    """``(checks, any tensor nondeterministic)``."""
    scale = _gradient_rms(treated) or _gradient_rms(reference)
    scale64 = _gradient_rms(pair64[1]) if pair64 is not None else 0.0
    tolerance = _tolerance(dtype)
    impure = bool(pair64 is not None and pair64[2])
    checks, spread_any = [], False
    for name, (kind, stats) in treated.tensors.items():
        spread_stats = again.tensors.get(name, (kind, _Stats(True)))[1]
        spread = _relative(spread_stats, scale) if not spread_stats.problem else math.inf
        spread_any = spread_any or not spread_stats.bitwise
        if stats.problem:
            checks.append(TensorCheck(name, kind, "wrong", math.inf, reference_spread=spread, why=stats.problem))
            continue
        if stats.bitwise:
            checks.append(TensorCheck(name, kind, "bitwise", reference_spread=spread))
            continue
        difference = _relative(stats, scale)
        if not spread_stats.bitwise:
            ok = difference <= max(SPREAD_MARGIN * spread, tolerance)
            why = (f"{difference:.1e} against the untouched model's own run-to-run difference {spread:.1e}: "
                   + ("within it" if ok else "beyond it"))
            checks.append(TensorCheck(name, kind, "within rounding" if ok else "wrong", difference,
                                      reference_spread=spread, why=why))
            continue
        d64 = None
        if pair64 is not None:
            other = pair64[1].tensors.get(name)
            if other is not None and not other[1].problem:
                d64 = _relative(other[1], scale64)
        if d64 is not None and d64 <= max(SHRINK * difference, FLOAT64_NOISE):
            factor = difference / d64 if d64 else math.inf
            why = (f"{difference:.1e} of its scale; in float64 {d64:.1e}"
                   + (f" ({factor:.0e}x smaller)" if math.isfinite(factor) else " (bitwise)")
                   + ": rounding")
            checks.append(TensorCheck(name, kind, "within rounding", difference, d64, why=why))
        elif d64 is not None and not impure:
            checks.append(TensorCheck(name, kind, "wrong", difference, d64,
                                      why=f"{difference:.1e} of its scale, and in float64 still {d64:.1e}: not rounding"))
        else:
            ok = difference <= tolerance
            why = (f"{difference:.1e} of its scale, {'within' if ok else 'beyond'} sqrt(eps) of "
                   f"{str(dtype).replace('torch.', '')} ({tolerance:.1e})"
                   + (f"; float64 gave {d64:.1e}" if d64 is not None else ""))
            checks.append(TensorCheck(name, kind, "within rounding" if ok else "wrong", difference, d64, why=why))
    return checks, spread_any


# -- state a forward may change --------------------------------------------------------------------
_SIMPLE = (bool, int, float, str, type(None))


def _fingerprint(model: nn.Module) -> dict:
    """``{module.attribute: value}`` of every plain attribute (numbers, strings, tensors that are not
    parameters or buffers) of every module; remat's own left out."""
    found = {}
    for name, module in model.named_modules():
        for key, value in module.__dict__.items():
            if key.startswith("_remat") or key in ("training",):
                continue
            if isinstance(value, _SIMPLE):
                found[f"{name}.{key}" if name else key] = value
            elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                found[f"{name}.{key}" if name else key] = ("tensor", id(value), value._version)
    return found


def _changed(before: dict, after: dict) -> list:
    return [f"{k}: {_short(before.get(k))} -> {_short(after.get(k))}"
            for k in sorted(set(before) | set(after)) if before.get(k, _ABSENT) != after.get(k, _ABSENT)]


def _short(value) -> str:
    if isinstance(value, tuple) and value and value[0] == "tensor":
        return "a tensor"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _nondeterminism(again: _Step, changed: list, device) -> str:
    worst = max(((name, stats) for name, (_, stats) in again.tensors.items() if not stats.bitwise),
                key=lambda item: item[1].diff_rms, default=(None, None))[0]
    text = f"the untouched model gives another result when run twice from the same state (first: {worst})"
    if changed:
        return (text + "; its forward changes state outside its parameters and buffers ("
                + "; ".join(changed[:3]) + (" ..." if len(changed) > 3 else "") + "), which no run can put back: "
                "each tensor is judged against the model's own run-to-run difference")
    kernels = ("CUDA kernels that add with atomics (index_add, scatter_add, some backward kernels): "
               "torch.use_deterministic_algorithms(True) names them" if device.type == "cuda" else
               "nondeterministic kernels or a forward that reads something that changes between calls")
    return text + f"; no plain attribute changed, so: {kernels}. Each tensor is judged against that difference"


# -- the measured step -----------------------------------------------------------------------------
def _measured(timed: list, again: _Step, setup: _Setup, model, held: int) -> Measured:
    notes = setup.plan.notes if setup.plan is not None else {}
    state_bytes = 0
    optimizer = notes.get("optimizer", "none")
    if optimizer not in (None, "none"):
        from remat.planning.costs import optimizer_state_bytes
        from remat.profiling.profiler import trainable_shapes
        state_bytes = optimizer_state_bytes(optimizer, trainable_shapes(model))
    return Measured(
        peak_allocated_bytes=max(s.peak_allocated for s in timed) - held,
        peak_reserved_bytes=max(s.peak_reserved for s in timed),
        step_s=statistics.median(s.seconds for s in timed),
        reference_peak_allocated_bytes=again.peak_allocated - held,
        reference_peak_reserved_bytes=again.peak_reserved, reference_step_s=again.seconds,
        predicted_peak_bytes=notes.get("predicted_peak_bytes"), predicted_step_s=notes.get("predicted_step_s"),
        optimizer_state_bytes=state_bytes)


# -- words ---------------------------------------------------------------------------------------------
def _batch_shape(batch) -> str:
    """``"2 x 128"`` (sequences x tokens) for token batches, the whole shape of another first input."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not leaves:
        return ""
    tokens = next((batch[k] for k in ("input_ids", "inputs_embeds") if isinstance(batch.get(k), torch.Tensor)),
                  None) if isinstance(batch, Mapping) else None
    if tokens is None and not leaves[0].is_floating_point():
        tokens = leaves[0]
    shape = tokens.shape[:2] if tokens is not None else leaves[0].shape
    return " x ".join(str(n) for n in shape)


def _why(verdict: str, checks: list, float64_note: str, deterministic: bool, model) -> str:
    total = len(checks)
    differing = [c for c in checks if c.verdict != "bitwise"]
    if verdict == "bitwise":
        return f"all {total} tensors (loss, gradients, buffers) are bitwise equal to the untouched model's"
    finite = [c for c in differing if math.isfinite(c.difference)]
    worst = max(finite or differing, key=lambda c: c.difference)
    if verdict == "within rounding":
        shrunk = sum(1 for c in differing if c.why.endswith(": rounding"))
        spread = sum(1 for c in differing if "run-to-run" in c.why)
        scaled = len(differing) - shrunk - spread
        how = []
        if shrunk:
            how.append(f"{'every one' if shrunk == len(differing) else shrunk} shrinks by orders of magnitude in "
                       "float64 or vanishes there: the same sums taken in another order (rounding), not an error")
        if scaled:
            how.append(f"{'every one' if scaled == len(differing) else scaled} is within sqrt(eps) of the working "
                       "dtype against the model's gradient scale"
                       + (f" (no float64 verdict: {float64_note})" if float64_note != "ran" else ""))
        if spread:
            how.append(f"{'every one' if spread == len(differing) else spread} is within the untouched model's own "
                       "run-to-run difference")
        return (f"{len(differing)} of {total} tensors differ from the untouched model's, by at most "
                f"{worst.difference:.1e} of their scale ({worst.name}); " + "; ".join(how))
    wrong = [c for c in checks if c.verdict == "wrong"]
    worst = max(wrong, key=lambda c: c.difference if math.isfinite(c.difference) else 1e300)
    where = _where_wrong(wrong, model)
    return (f"{len(wrong)} of {total} tensors differ beyond rounding, the worst {worst.name} ({worst.why})"
            + (f"; {where}" if where else "") + ": the treated model computes something else than the untouched one")


def _where_wrong(wrong: list, model) -> str:
    """Where the wrong gradients start: the last block (in forward order) with a wrong gradient, when the
    blocks after it are right (a backward carries an error to every block before it)."""
    from remat.treat.discovery import discover
    try:
        names = discover(model).block_names
    except ValueError:
        return ""
    wrong_names = [c.name[len("gradient of "):] for c in wrong if c.kind == "parameter"]
    hit = [i for i, block in enumerate(names) if any(n.startswith(block + ".") for n in wrong_names)]
    if not hit:
        return ""
    last = hit[-1]
    if last < len(names) - 1:
        return (f"the wrong gradients start at block {names[last]} (the {len(names) - 1 - last} after it are right): "
                "the error is in that block")
    return "the last block's gradients are wrong too: the error is in the last block or after it"


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "n/a"
    return "0" if value == 0 else f"{value:.1e}"


_KINDS = (("loss", "loss"), ("parameter", "parameter gradients"), ("input", "input gradients"), ("buffer", "buffers"))
SHOWN = 12
"""Differing tensors listed by ``str()`` (worst first); all are in :attr:`Verification.tensors`."""


def _report(result: Verification) -> str:
    from remat.units import format_size as size
    lines = [f"remat.verify: {result.treatment} on {result.model}"
             + (f", batch {result.batch}" if result.batch else "") + f" ({result.dtype}, {result.device}): "
             f"{result.verdict.upper()}", f"  why: {result.why}"]
    counts = result.counts()
    lines.append(f"  {'':<22}{'compared':>9}{'bitwise':>9}{'rounding':>10}{'wrong':>7}")
    for kind, label in _KINDS:
        if kind in counts:
            c = counts[kind]
            lines.append(f"  {label:<22}{sum(c.values()):>9}{c['bitwise']:>9}{c['within rounding']:>10}{c['wrong']:>7}")
    differing = sorted((c for c in result.tensors if c.verdict != "bitwise"),
                       key=lambda c: (-VERDICTS.index(c.verdict), -(c.difference if math.isfinite(c.difference) else 1e300)))
    if differing:
        width = min(max(len(c.name) for c in differing[:SHOWN]), 72)
        lines.append(f"  {'differing (worst first)':<{width}}  {'diff':>8}  {'float64':>8}  verdict")
        for c in differing[:SHOWN]:
            name = c.name if len(c.name) <= width else "..." + c.name[-(width - 3):]
            lines.append(f"  {name:<{width}}  {_fmt(c.difference):>8}  {_fmt(c.float64_difference):>8}  {c.verdict}"
                         + (f" ({c.why})" if c.verdict == "wrong" and not math.isfinite(c.difference) else ""))
        if len(differing) > SHOWN:
            lines.append(f"  ... and {len(differing) - SHOWN} more (Verification.tensors has them all)")
        lines.append("  diff: rms(treated - untouched) / max(rms(untouched), 1e-3 x the model's gradient rms)")
    lines.append(f"  float64 re-run: {result.float64}")
    for problem in result.problems:
        lines.append(f"  note: {problem}")
    m = result.measured
    if m is not None:
        predicted = ""
        if m.predicted_peak_bytes is not None:
            predicted = f" (predicted {size(m.predicted_peak_bytes)}"
            if m.optimizer_state_bytes:
                predicted += f", {size(m.predicted_peak_bytes - m.optimizer_state_bytes)} without the optimizer state " \
                             "this step does not hold"
            predicted += ")"
        step = f"step {m.step_s * 1e3:.1f} ms" + (f" (predicted {m.predicted_step_s * 1e3:.1f} ms)"
                                                 if m.predicted_step_s else "")
        lines.append(f"  measured: peak {size(m.peak_allocated_bytes)} allocated, {size(m.peak_reserved_bytes)} "
                     f"reserved{predicted}; {step}")
        lines.append(f"  untouched: peak {size(m.reference_peak_allocated_bytes)} allocated, "
                     f"{size(m.reference_peak_reserved_bytes)} reserved; step {m.reference_step_s * 1e3:.1f} ms")
    lines.append(f"  ({result.seconds:.1f} s)")
    return "\n".join(lines)


# -- the doctor's check ----------------------------------------------------------------------------------
def check_gradients(model: nn.Module, batch, loss_fn=None) -> list:
    """The doctor's ``wrong-gradients``: :func:`verify` on the setup as it is (nothing to verify: no finding)."""
    if current_plan(model) is None and not hf_checkpointing_on(model):
        return []
    return findings_of(verify(model, batch, None, loss_fn=loss_fn))


def findings_of(result: Verification) -> list:
    """``[wrong-gradients]`` for a wrong verdict, else nothing."""
    if result.ok:
        return []
    return [Finding(check="wrong-gradients", severity="error", cost=1.0,
                    what=f"{result.treatment} gives other gradients than the untouched model (remat.verify)",
                    why=result.why,
                    fix="train without it until it is fixed (remat.remove(model), or Hugging Face checkpointing off); "
                        "print(remat.verify(model, batch)) shows every tensor; report it with that table")]
