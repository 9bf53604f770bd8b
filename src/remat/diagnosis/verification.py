"""``remat.verify``: a treatment checked on the user's own model and batch, as a careful engineer would.

    result = remat.verify(model, batch, "full+tiled")      # or a Plan; None: what is applied now
    print(result)                                         # the verdict, why, and a table
    assert result.verdict != "wrong"

How: the model runs one training step (train mode, dropout on) untouched -- remat's patches taken off
(:func:`remat.treat.patches.suspended`), Hugging Face checkpointing off -- then treated, then untouched
again, each from the same parameters, buffers and random state, so a treatment that preserves the RNG
gives the same dropout masks. Compared: the loss, every parameter gradient, the gradient of every
floating tensor of the batch (on a fresh copy) and every buffer after the step. Each is ``bitwise``,
``within rounding`` or ``wrong`` (the verdicts and the report: :mod:`remat.diagnosis.verdicts`):

- the difference is ``rms(treated - untouched)`` over the tensor's own rms, floored at ``SCALE_FLOOR``
  times the model's gradient scale, so a tensor whose true value is about zero is not an error;
- where the model allows it, both runs are made again on a float64 copy (:class:`_Float64`): a
  difference that shrinks by ``1 / SHRINK`` there is rounding (the same sums in another order), one
  that does not is wrong (other dropout masks, a wrong cache); without float64 the bound is
  ``sqrt(eps)`` of the working dtype, and the result says that this is the weaker test;
- a treated step torch's checkpoint refuses (``CheckpointError``) is ``wrong``, with the error.

The untouched model run twice tells whether it can be compared at all: where its two runs differ
(nondeterministic kernels, state changed outside parameters and buffers) each tensor is judged against
that spread (``reference_spread``). On CUDA the treated step is also measured beside the prediction.

Left as it was: parameters, gradients, buffers, flags, RNG states, the applied plan and Hugging Face's
switches. Limits: one step, eager; the untouched step must fit in memory (verify at a shorter length:
a treatment's arithmetic does not depend on it); a parameter the forward writes in place cannot be
put back (reported). The thresholds and their reasons: docs/design/diagnosis.md.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import inspect
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
from remat.diagnosis.verdicts import (ABSENT, VERDICTS, Measured, Step, Verification, all_bitwise, batch_shape,
                                      changed_state, compare_tensors, judge, nondeterminism, why_of,
                                      working_dtype)
from remat.diagnosis.findings import Finding, hf_checkpointing_on, unwrapped
from remat.profiling.snapshot import fingerprint
from remat.diagnosis.run_checks import eager, hf_checkpointing_off
from remat.planning.plans import Plan
from remat.profiling.snapshot import restore, snapshot
from remat.treat import mask_skip, patches

FLOAT64_ROOM = 4
"""A float64 copy is made where this many times its parameters' bytes are free (copy, gradients, steps)."""
FLOAT64_CPU_PARAMETERS = 300_000_000
"""Above this many parameters a float64 re-run on the CPU would take minutes: scale-based judgement."""


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
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


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




# -- one step ----------------------------------------------------------------------------------------
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
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(eager(model))
                stack.enter_context(batch_check_held(model))
                undone = stack.enter_context(patches.suspended(model))
                stack.enter_context(hf_checkpointing_off(model))
                before = fingerprint(model)   # after verify's own switches: only the forward's changes count
                reference = self._step(model, state, keep=True)
                after_first = fingerprint(model)
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
                changed = changed_state(before, after_first)
                if treated is None:
                    return self._failed(setup, failure, model, device)
                wanted64 = float64 if float64 is not None else not all_bitwise(treated)
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
        checks, spread_any = judge(reference, treated, again, pair64, working_dtype(model))
        deterministic = not spread_any
        if not deterministic:
            self._problem(nondeterminism(again, changed, device))
        if pair64 is not None and pair64[2]:
            self._problem("the float64 run still computed some ops in lower precision ("
                          + ", ".join(f"{op} x{n}" for op, n in pair64[2].most_common(3))
                          + "): where float64 did not shrink a difference, it was judged against the gradient scale")
        measured = _measured(timed, again, setup, model, held) if measure and timed else None
        verdict = max((c.verdict for c in checks), key=VERDICTS.index, default="bitwise")
        shape = batch_shape(self.batch)
        return Verification(
            verdict=verdict, why=why_of(verdict, checks, float64_note, deterministic, model), treatment=setup.name,
            model=type(model).__name__, tensors=tuple(checks), float64=float64_note, deterministic=deterministic,
            problems=tuple(self.problems), measured=measured, dtype=str(working_dtype(model)).replace("torch.", ""),
            device=str(device), batch=shape)

    def _failed(self, setup: _Setup, failure: str, model, device) -> Verification:
        return Verification(
            verdict="wrong", treatment=setup.name, model=type(model).__name__, tensors=(), float64="not run",
            why=f"the treated step fails where the untouched one runs ({failure}): its recompute does not compute "
                "what its forward computed", problems=tuple(self.problems),
            dtype=str(working_dtype(model)).replace("torch.", ""), device=str(device), batch=batch_shape(self.batch))

    # a step --------------------------------------------------------------------------------------
    def _step(self, model, state, *, keep: bool = False, reference: Optional[Step] = None, timed: bool = False,
              dtype=None) -> Step:
        """One training step from ``state``: its tensors kept (``keep``: moved off the GPU), or
        compared with ``reference``'s as they come (:func:`stats`), or only timed."""
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
            return Step({}, seconds, *peaks)
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
            return Step(stored, seconds, *peaks)
        compared = {k: (kind, compare_tensors(t, reference.tensors.get(k, (kind, ABSENT))[1]))
                    for k, (kind, t) in tensors.items()}
        for k, (kind, t) in reference.tensors.items():
            if k not in compared:
                compared[k] = (kind, compare_tensors(ABSENT, t))
        return Step(compared, seconds, *peaks)

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
                with patches.suspended(twin), hf_checkpointing_off(twin):
                    reference = self._step(twin, twin_state, keep=True, dtype=torch.float64)
                treated = self._step(twin, twin_state, reference=reference, dtype=torch.float64)
        except Exception as error:   # a kernel without float64 (Triton, flash attention), a dtype check
            return (f"the model does not run in float64 ({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
                    "judged against the gradient scale"), None
        finally:
            patches.remove(twin)
            mask_skip.release(twin)
            del twin
            gc.collect()   # a treated copy holds cycles (an offload engine and its model): its memory goes now
        loss = reference.tensors["loss"][1]
        if loss.dtype != torch.float64:
            return f"the float64 run's loss is {loss.dtype} (the model casts it); judged against the gradient scale", None
        return "ran", (reference, treated, lower)


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


# -- the measured step -----------------------------------------------------------------------------
def _measured(timed: list, again: Step, setup: _Setup, model, held: int) -> Measured:
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
