"""The verdicts of :func:`remat.verify`: its records, how a difference is judged, and the report.

A tensor of the treated step is compared with the same tensor of the untouched one (:func:`compare_tensors`:
bitwise, else the rms of the difference and of the reference), then judged (:func:`judge`): against
its own scale floored at ``SCALE_FLOOR`` of the model's gradient rms, by the float64 re-run where there
was one (a difference that shrinks by ``1 / SHRINK`` or reaches ``FLOAT64_NOISE`` is rounding, one that
does not is wrong), else against ``sqrt(eps)`` of the working dtype, and for a model that does not run
twice alike against its own run-to-run difference (``SPREAD_MARGIN`` times it). :func:`~remat.profiling.snapshot.fingerprint`
and :func:`changed_state` name the plain state a forward changed; :func:`why_of` and :func:`report` put the
verdict into words and a table (:meth:`Verification.__str__`).

A module of its own so that the runs (:mod:`remat.diagnosis.verification`) and the judging each read
in one place; it runs nothing and changes no model (``where_wrong`` reads the model's block names).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

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
        return report(self)


@dataclass
class Step:
    """What one training step produced: ``{name: tensor}`` per kind, and its time and peak."""

    tensors: dict                # name -> (kind, tensor or None)
    seconds: float = 0.0
    peak_allocated: int = 0
    peak_reserved: int = 0


ABSENT = object()


# -- judging -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stats:
    """One tensor of a run against the same tensor of the reference run."""

    bitwise: bool
    diff_rms: float = 0.0
    ref_rms: float = 0.0
    numel: int = 0
    problem: str = ""            # a difference no tolerance accepts (present on one side only, shape, NaN)


def compare_tensors(value, reference) -> _Stats:
    if value is ABSENT or reference is ABSENT:
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


def all_bitwise(step: Step) -> bool:
    return all(stats.bitwise for _, stats in step.tensors.values())


def _gradient_rms(step: Step) -> float:
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


def working_dtype(model) -> torch.dtype:
    """The lowest floating precision among the trainable parameters (else any parameter's)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and p.requires_grad} or \
        {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def judge(reference: Step, treated: Step, again: Step, pair64, dtype) -> tuple:
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


# -- state a forward may change (fingerprint: remat.profiling.snapshot) ---------------------------------
def changed_state(before: dict, after: dict) -> list:
    return [f"{k}: {_short(before.get(k))} -> {_short(after.get(k))}"
            for k in sorted(set(before) | set(after)) if before.get(k, ABSENT) != after.get(k, ABSENT)]


def _short(value) -> str:
    if isinstance(value, tuple) and value and value[0] == "tensor":
        return "a tensor"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def nondeterminism(again: Step, changed: list, device) -> str:
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


# -- words ---------------------------------------------------------------------------------------------
def batch_shape(batch) -> str:
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


def why_of(verdict: str, checks: list, float64_note: str, deterministic: bool, model) -> str:
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


def report(result: Verification) -> str:
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
