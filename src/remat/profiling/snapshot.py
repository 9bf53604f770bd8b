"""What a profile must leave as it found it: a model's state around a measurement.

How: :func:`preserved` takes a :class:`ModelState` before profiling and puts it back after,
whatever happens inside. It records, per module slot, the very ``Parameter`` and buffer
objects (so a slot swapped for a fake tensor, or reassigned, gets its own object back), each
parameter's ``requires_grad`` and ``.grad``, a copy of every buffer (BatchNorm running
statistics change in a training forward), every module's ``training`` flag and the CPU and
CUDA random states. While the block runs, each parameter's ``.grad`` is None: a profile's
backward then makes fresh gradients instead of accumulating into the user's, and the user's
come back afterwards as the same tensors. (Remat's own patches are the other half:
:func:`remat.treat.patches.suspended` takes a plan off and puts it back.)

Why references, not copies, for parameters and gradients: a profile never writes a parameter
(no optimizer step) and never touches the user's gradients once they are set aside, so a copy
would only double the model's memory on the GPU. Parameter version counters are checked: a
parameter written in place during a profile is reported (RuntimeError), not silently kept.

Limits: CUDA random states are restored only for a CUDA that was initialised before the
profile (one initialised by it has nothing to go back to); state outside the module tree
(``model.config``, globals a model's forward sets) is not recorded. :func:`fingerprint` reads the
modules' plain and tensor attributes, for telling whether a forward changed them (``remat.verify``)
or whether a kept profile still holds (:mod:`remat.profiling.reuse`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn as nn


@dataclass
class ModelState:
    """One model's state, as :func:`snapshot` recorded it."""

    parameters: list
    """``(module, name, parameter, requires_grad, grad, version)`` per parameter slot."""
    buffers: list
    """``(module, name, buffer, copy, version)`` per buffer slot."""
    training: list
    """``(module, training)`` per module."""
    cpu_rng: torch.Tensor
    """``torch.get_rng_state()``."""
    cuda_rng: Optional[list]
    """``torch.cuda.get_rng_state_all()`` when CUDA was initialised, else None."""

    @property
    def held_grad_bytes(self) -> int:
        """Bytes of the user's gradients on a GPU, set aside while the block runs (a profile
        reads allocated memory and must not count them twice)."""
        seen = {}
        for _, _, _, _, grad, _ in self.parameters:
            if grad is not None and grad.device.type == "cuda":
                seen[id(grad.untyped_storage())] = grad.untyped_storage().nbytes()
        return sum(seen.values())


def snapshot(model: nn.Module) -> ModelState:
    """Record ``model``'s parameters, gradients, buffers, training flags and RNG states."""
    parameters, buffers, training = [], [], []
    for module in model.modules():
        training.append((module, module.training))
        for name, p in module._parameters.items():
            if p is not None:
                parameters.append((module, name, p, p.requires_grad, p.grad, p._version))
        for name, b in module._buffers.items():
            if b is not None:
                buffers.append((module, name, b, b.detach().clone(), b._version))
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return ModelState(parameters=parameters, buffers=buffers, training=training,
                      cpu_rng=torch.get_rng_state(), cuda_rng=cuda)


def restore(state: ModelState) -> None:
    """Put ``state`` back: the same objects in their slots, their flags, gradients, buffer
    values, training flags and RNG states."""
    written = []
    for module, name, p, requires_grad, grad, version in state.parameters:
        module._parameters[name] = p
        p.requires_grad_(requires_grad)
        p.grad = grad
        if p._version != version:
            written.append(name)
    with torch.no_grad():
        for module, name, b, copy, version in state.buffers:
            module._buffers[name] = b
            if b._version != version:
                b.copy_(copy)
    for module, flag in state.training:
        module.training = flag
    torch.set_rng_state(state.cpu_rng)
    if state.cuda_rng is not None:
        torch.cuda.set_rng_state_all(state.cuda_rng)
    if written:
        raise RuntimeError(f"remat: parameters were written in place while profiling ({written[:5]}); "
                           "a profile runs forward and backward only, so something in the model's forward "
                           "changes its weights")


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[ModelState]:
    """``model`` as it was before the block, whatever the block did (gradients set aside inside)."""
    state = snapshot(model)
    for _, _, p, _, _, _ in state.parameters:
        p.grad = None
    try:
        yield state
    finally:
        restore(state)


_SIMPLE = (bool, int, float, str, type(None))


def fingerprint(model: nn.Module) -> dict:
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
