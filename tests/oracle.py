"""The one test oracle: a treated model trained beside an untouched copy, and proof that the treatment ran.

Every treatment test asks two questions, and equal gradients answer only the first:

1. Is the math the same? :func:`compare` trains ``treated`` and ``reference`` (an untouched copy:
   same state_dict) side by side on the same batch, with the same seed before each forward, and
   records every difference: the loss, every input gradient (a tensor input that requires grad),
   every parameter gradient and every buffer after the step (BatchNorm statistics).
   :meth:`Comparison.assert_equal` demands ``torch.equal`` everywhere (the math is the same: fp32,
   dropout on); :meth:`Comparison.assert_close` takes a norm-wise relative tolerance, named next
   to its dtype and reason (:data:`FP32_REORDERED`), where sums run in another order (tiles, a
   chunked loss).
2. Did the treatment do anything? A no-op treatment passes question 1. So the first step of each
   side runs under a :class:`Meter`: the aten ops dispatched (a recompute runs more of them; FLOPs
   would miss a selective recompute, which re-runs only pointwise ops) and the bytes saved for
   backward as seen from outside the model (saved-tensor hooks around the forward: a checkpoint
   saves only its inputs there, the offload engine's own hooks take what it moves, parameters and
   buffers are not counted). :func:`check_mechanism` reads the treatments installed on the model
   (:func:`remat.api.treatments`) and asserts what each promises (:func:`promises`): a treatment
   of the whole block saves fewer bytes, every one but plain ``offload`` runs more ops, every
   offloading one moved bytes to the host.

:func:`check` is both in one call, which is what a treatment test usually wants.

Limits: the meter is a dispatch mode and saved-tensor hooks, which ``torch.compile`` does not
trace: a compiled model is compared with ``meter=False``. Autograd skips its version-counter check
(a saved tensor changed in place) for a tensor its hooks saw, so the meter's unpack makes the same
check. Exact FLOP accounting of one recompute (``test_mechanism.py``) stays its own test.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

FP32_REORDERED = 1e-6
"""Norm-wise relative tolerance for fp32 sums taken in another order (weight gradients summed over
tiles of tokens, a loss summed a chunk at a time); exact math compares with ``torch.equal``."""

NOISE_FLOOR = 1e-3
"""A gradient whose norm is under this fraction of the step's largest is compared against that
largest instead: its exact value is ~zero (a key projection's bias: softmax ignores a bias shared by
every key), so both sides hold rounding noise and a relative error of it means nothing."""


def model_loss(model: nn.Module, batch) -> torch.Tensor:
    """The loss a model computes itself: ``model(**batch).loss`` for a dict of keyword arguments,
    ``model(input_ids=batch, labels=batch).loss`` for a tensor of token ids."""
    if isinstance(batch, dict):
        return model(**batch).loss
    return model(input_ids=batch, labels=batch).loss


def clone(value):
    """A fresh copy of a batch: tensors cloned (a leaf that requires grad stays one), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def _leaves(value, prefix="input") -> dict:
    """``{path: tensor}`` of the tensors of a batch that require grad (their gradients are compared)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value} if value.requires_grad else {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    found = {}
    for key, item in items:
        found.update(_leaves(item, f"{prefix}[{key!r}]"))
    return found


@dataclass
class Mechanism:
    """What one side's metered step did (:class:`Meter`)."""

    ops_by_op: collections.Counter = field(default_factory=collections.Counter)
    """aten ops dispatched in the forward and backward, by op overload (``torch.ops.aten.mm.default``: n)."""
    saved_bytes: int = 0
    """Bytes of the distinct storages the forward saved for backward under hooks set outside the
    model, parameters and buffers left out."""

    @property
    def ops(self) -> int:
        """aten ops dispatched in the forward and backward."""
        return sum(self.ops_by_op.values())


class Meter(TorchDispatchMode):
    """Counts the aten ops of a step (``with meter:``) and, inside :meth:`forward`, the bytes it saves for backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.result = Mechanism()
        self._counts = self.result.ops_by_op
        self._own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._counts[func] += 1
        return func(*args, **(kwargs or {}))

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._own:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return tensor, tensor._version  # the tensor itself: the step runs as without hooks

    @staticmethod
    def _unpack(packed):
        tensor, version = packed
        if tensor._version != version:  # autograd's own check, which it skips for a hooked tensor
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation (version {version}, now {tensor._version}; oracle.Meter)")
        return tensor

    @contextlib.contextmanager
    def forward(self):
        """Saved-tensor hooks for the ``with`` block (the forward: every saved tensor is alive until backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self.result.saved_bytes = sum(self._saved.values())


def _rel(value: torch.Tensor, reference: torch.Tensor, scale: float = 0.0) -> float:
    if not value.is_floating_point():
        return 0.0 if torch.equal(value, reference) else float("inf")
    value, reference = value.double(), reference.double()
    if value.shape != reference.shape or not bool(torch.isfinite(value).all() and torch.isfinite(reference).all()):
        return float("inf")
    denominator = max(float(reference.norm()), NOISE_FLOOR * scale, 1e-30)
    return float((value - reference).norm()) / denominator


@dataclass(frozen=True)
class Comparison:
    """A treated model trained beside an untouched copy (:func:`compare`)."""

    first_difference: Optional[str]
    """The first loss, gradient or buffer that is not ``torch.equal`` (``"step 0: gradient of
    lm_head.weight differs"``); None when every one is bitwise equal."""
    max_rel: float
    """The largest norm-wise relative difference, ``||treated - untouched|| / ||untouched||``, over
    the losses, gradients and buffers of every step (0.0 when bitwise equal)."""
    worst: str = ""
    """Where ``max_rel`` was found (``"step 1: gradient of lm_head.weight"``)."""
    max_rel_by_step: tuple = ()
    """``max_rel`` of each step alone: the first step's compares the same weights, a later one's
    also carries what the earlier steps' differences did to the weights (with ``lr``)."""
    treated: Optional[Mechanism] = None
    """What the treated model's first step did (None: not metered)."""
    reference: Optional[Mechanism] = None
    """What the untouched model's first step did (None: not metered)."""

    @property
    def ops(self) -> int:
        return self.treated.ops

    @property
    def reference_ops(self) -> int:
        return self.reference.ops

    def assert_equal(self) -> "Comparison":
        """AssertionError unless the loss, every gradient and every buffer were ``torch.equal``."""
        assert self.first_difference is None, self.first_difference
        return self

    def assert_close(self, rtol: float) -> "Comparison":
        """AssertionError unless every difference is within ``rtol``, norm-wise relative."""
        assert self.max_rel <= rtol, f"relative difference {self.max_rel:.2e} > {rtol:.0e} ({self.worst})"
        return self


def _step(model, batch, loss, seed, retain, meter):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with meter if meter is not None else contextlib.nullcontext():
        with meter.forward() if meter is not None else contextlib.nullcontext():
            value = loss(model, batch)
        value.backward(retain_graph=retain)
        if retain:
            value.backward()
    return value.detach()


def compare(treated: nn.Module, reference: nn.Module, batch, loss: Callable[[nn.Module, Any], torch.Tensor] = model_loss,
            *, steps: int = 1, seed: int = 7, lr: float = 0.0, retain: bool = False, meter: bool = True,
            buffers: bool = True) -> Comparison:
    """Train ``treated`` and ``reference`` side by side and record every difference.

    Args:
        treated, reference: the model under test and an untouched copy of it (same state_dict).
        batch: what ``loss`` is given: a tensor, or a dict / list / tuple of tensors and values; each
            step gives each side its own clone, and a tensor that requires grad stays a leaf whose
            gradient is compared.
        loss: ``loss(model, batch)``, the scalar each step calls ``backward`` on (default
            :func:`model_loss`).
        steps: steps per side; before step ``i`` the seed is ``seed + i`` on both sides (dropout
            draws the same masks).
        lr: with ``lr > 0`` an SGD step follows each step, so later steps compare trained weights.
        retain: backward twice (``retain_graph``): every saved tensor is unpacked twice.
        meter: run each side's first step under a :class:`Meter` (off for a compiled model).
        buffers: compare the buffers after each step (off only beside a test of its own that
            says why they differ).

    Returns:
        A :class:`Comparison`; check it with :meth:`~Comparison.assert_equal` or
        :meth:`~Comparison.assert_close`, and :func:`check_mechanism`.

    Raises:
        AssertionError for a difference no tolerance can accept: parameter names that differ, a
        gradient present on one side only.

    Example::

        result = compare(model, reference, {"input_ids": ids, "labels": ids}, steps=2)
        result.assert_equal()
        check_mechanism(model, result)
    """
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (treated, reference)] if lr else []
    metered = (Meter(treated), Meter(reference)) if meter else (None, None)
    first, found = None, []  # found: (relative difference, step, what)
    for step in range(steps):
        batches = (clone(batch), clone(batch))
        loss_t, loss_r = (_step(m, b, loss, seed + step, retain, k if step == 0 else None)
                          for m, b, k in zip((treated, reference), batches, metered))
        if not torch.equal(loss_t, loss_r):
            first = first or f"step {step}: loss {loss_t.item()!r} != {loss_r.item()!r}"
            found.append((_rel(loss_t, loss_r), step, "loss"))
        inputs, ref_inputs = _leaves(batches[0]), _leaves(batches[1])
        for name, value in inputs.items():
            grad, ref_grad = value.grad, ref_inputs[name].grad
            assert (grad is None) == (ref_grad is None), f"step {step}: gradient of {name} is None on one side"
            if grad is not None and not torch.equal(grad, ref_grad):
                first = first or f"step {step}: gradient of {name} differs"
                found.append((_rel(grad, ref_grad), step, f"gradient of {name}"))
        params, ref_params = dict(treated.named_parameters()), dict(reference.named_parameters())
        assert params.keys() == ref_params.keys(), "parameter names differ"
        scale = max((float(q.grad.double().norm()) for q in ref_params.values() if q.grad is not None), default=0.0)
        for name, p in params.items():
            q = ref_params[name]
            assert (p.grad is None) == (q.grad is None), f"step {step}: gradient of {name} is None on one side"
            if p.grad is not None and not torch.equal(p.grad, q.grad):
                first = first or f"step {step}: gradient of {name} differs"
                found.append((_rel(p.grad, q.grad, scale), step, f"gradient of {name}"))
        ref_buffers = dict(reference.named_buffers()) if buffers else {}
        for name, b in treated.named_buffers() if buffers else ():
            if not torch.equal(b, ref_buffers[name]):
                first = first or f"step {step}: buffer {name} differs"
                found.append((_rel(b, ref_buffers[name]), step, f"buffer {name}"))
        for opt in opts:
            opt.step()
    worst = max(found, default=(0.0, 0, ""))
    return Comparison(first_difference=first, max_rel=worst[0], worst=f"step {worst[1]}: {worst[2]}" if found else "",
                      max_rel_by_step=tuple(max((r for r, s, _ in found if s == step), default=0.0)
                                            for step in range(steps)),
                      treated=metered[0] and metered[0].result, reference=metered[1] and metered[1].result)


WHOLE_BLOCK = ("full", "selective", "attn-saved", "offload", "segment")
"""Parts of a treatment's name that act on the whole block (``segment:0``: a run of blocks)."""


def promises(treatment: str) -> set:
    """What an installed treatment (a name :func:`remat.api.treatments` reports: ``full+offload``,
    ``segment:1``) must show in a step:

    - ``"saves no more"``: every one but ``keep``;
    - ``"saves less"``: every one with a part of :data:`WHOLE_BLOCK`; a sub-module's alone
      (``attention``, ``mlp``, ``tiled``) may save just what the untouched block saves (a bare
      ``nn.Linear`` checkpointed or tiled still saves its input);
    - ``"recomputes"``: every one but ``keep`` and plain ``offload``;
    - ``"moves"``: every one that offloads.
    """
    if treatment == "keep":
        return set()
    parts = {part.split(":")[0] for part in treatment.split("+")}
    found = {"saves no more"}
    if parts & set(WHOLE_BLOCK):
        found.add("saves less")
    if treatment != "offload":
        found.add("recomputes")
    if "offload" in parts:
        found.add("moves")
    return found


def check_mechanism(model: nn.Module, result: Comparison, *, blocks=None, reference_ops: Optional[int] = None,
                    reference_saved: Optional[int] = None) -> None:
    """AssertionError for a treatment that did nothing: the treatments installed on ``model``'s
    blocks (``blocks``: as given to ``remat.apply``) promise what :func:`promises` says, and
    ``result`` (a metered :func:`compare`) shows it. ``reference_ops`` and ``reference_saved``: the
    ops to beat and the saved bytes to stay under, where another change to the model (a chunked
    head) already runs and saves otherwise than the untouched one (a chunked head over a small
    vocabulary saves more than its logits)."""
    import remat
    from remat.api import treatments
    from remat.treat.treatments import engine_of
    assert result.treated is not None, "compare(..., meter=False) measured no mechanism"
    if remat.current_plan(model) is not None:   # a treatment that installs nothing shows here as "keep"
        check_installed(model, blocks)
    installed = treatments(model, blocks)
    promised = set().union(*(promises(t) for t in installed.values()))
    what = sorted(set(installed.values()))
    if "recomputes" in promised:
        baseline = result.reference.ops if reference_ops is None else reference_ops
        assert result.treated.ops > baseline, \
            f"{what} recomputed nothing: {result.treated.ops} ops in a step, untouched {baseline}"
    saved = result.treated.saved_bytes
    untouched = result.reference.saved_bytes if reference_saved is None else reference_saved
    if "saves less" in promised:
        assert saved < untouched, f"{what} saved {saved} bytes for backward, untouched {untouched}"
    if "saves no more" in promised:
        assert saved <= untouched, f"{what} saved {saved} bytes for backward, more than untouched {untouched}"
    if "moves" in promised:
        engine = engine_of(model)
        assert engine is not None and engine.stats()["bytes_d2h"] > 0, f"{what} moved no saved tensor to the host"


def check_untouched(result: Comparison) -> None:
    """AssertionError unless the treated model's metered step ran the untouched one's ops and saved
    its bytes (a model whose treatment was removed, or never applied)."""
    assert (result.treated.ops, result.treated.saved_bytes) == (result.reference.ops, result.reference.saved_bytes), \
        f"treated: {result.treated.ops} ops, {result.treated.saved_bytes} bytes saved; untouched: " \
        f"{result.reference.ops} ops, {result.reference.saved_bytes} bytes saved"


def check_installed(model: nn.Module, blocks=None) -> None:
    """AssertionError unless every block carries the treatment the applied plan gives it (an
    equality must not come from a block left untreated)."""
    import remat
    from remat.api import treatments
    planned = remat.current_plan(model).blocks
    installed = treatments(model, blocks)
    assert installed == {block: planned.get(block, "keep") for block in installed}, \
        f"the blocks carry {installed}, the plan says {dict(planned)}"


def check(treated: nn.Module, reference: nn.Module, batch, loss: Callable = model_loss, *, rtol: Optional[float] = None,
          blocks=None, **kwargs) -> Comparison:
    """:func:`compare`, then equality (``torch.equal``; ``rtol``: norm-wise relative) and
    :func:`check_mechanism`. ``kwargs`` go to :func:`compare`. Returns the comparison."""
    result = compare(treated, reference, batch, loss, **kwargs)
    result.assert_equal() if rtol is None else result.assert_close(rtol)
    check_mechanism(treated, result, blocks=blocks)
    return result
