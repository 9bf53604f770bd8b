"""Fake-tensor profiles kept for the next call on the same model, batch and settings.

What: :func:`remat.profile` (and so :func:`remat.plan`, the doctor, the Trainer callback and
``Guard``, which call it) looks here before profiling with fake tensors, and keeps what it measured.
A second ``remat.plan`` of one model and batch at another budget, or a plan after a profile,
then takes milliseconds instead of the profile's seconds; the profile returned is a copy, equal to
the one a new profile would measure, so the plan is the same plan.

Why only fake profiles: a fake profile is a function of what the key holds (the model's modules,
parameters and buffers as they are, the batch's shapes and values, the loss, the settings), so reusing
it cannot change a result. A CUDA profile reads the process's allocated memory and the GPU's timing
now (an optimizer created since, another model on the card), which no key can tell apart.

The key: per module its name, class, class ``forward``, an instance ``forward`` and hook counts
(remat's own patches are off while it is taken: an applied plan does not stop reuse), and its plain
attributes and tensor attributes (:func:`~remat.profiling.snapshot.fingerprint`: flags such as
``gradient_checkpointing``, dropout rates, cached masks); per parameter and
buffer its name, shape, dtype, device, ``requires_grad``, address and version (an optimizer step or a
``load_state_dict`` changes them); the model's config as JSON; the batch's structure with every
tensor's shape, dtype, device and a digest of its values; the loss function; the request's settings.
A batch tensor over :data:`DIGEST_LIMIT` bytes, or a batch leaf that is not a tensor or a plain value,
makes the call uncacheable: it profiles, as without this module.

A profile is kept under the key of the model before it ran and after (a forward may write its
config once: ViT's classification head sets ``problem_type`` on its first call with labels).

Limits: :data:`KEPT` keys at most, the oldest dropped first; the entries hold the model weakly.
``remat.caches.clear()`` empties them (the process caches' one switch).
"""
from __future__ import annotations

import collections
import copy
import hashlib
import weakref
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from remat import caches
from remat.profiling.snapshot import fingerprint

KEPT = 8
"""Keys kept at once (a profile is kept under one or two: see the module docstring)."""
DIGEST_LIMIT = 256 * 2**20
"""Bytes of one batch tensor above which a call is not cached (its digest would cost what it saves)."""
_PLAIN = (bool, int, float, str, type(None))  # batch leaves keyed by value

PROFILES = caches.register(collections.OrderedDict(), "profiling.reuse.PROFILES")
"""key -> (weakref to the model, loss_fn, profile), oldest first."""


def key_of(model: nn.Module, batch, loss_fn, request, blocks) -> Optional[tuple]:
    """The key of a fake profile of ``model`` on ``batch`` (module docstring), or None: not cacheable."""
    leaves, spec = tree_flatten(batch)
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            digest = _digest(leaf)
            if digest is False:
                return None
            described.append((tuple(leaf.shape), str(leaf.dtype), str(leaf.device), leaf.requires_grad, digest))
        elif isinstance(leaf, _PLAIN):
            described.append((type(leaf).__name__, leaf))
        else:
            return None
    settings = replace(request, say=None)
    try:
        hash(settings)
    except TypeError:
        return None
    return (id(model), _model_fingerprint(model), str(spec), tuple(described), id(loss_fn), settings,
            None if blocks is None else tuple(blocks))


def kept(model: nn.Module, key: Optional[tuple], loss_fn):
    """A copy of the profile kept under ``key`` for this very model and loss, or None."""
    entry = PROFILES.get(key) if key is not None else None
    if entry is None or entry[0]() is not model or entry[1] is not loss_fn:
        return None
    PROFILES.move_to_end(key)
    return copy.deepcopy(entry[2])


def keep(model: nn.Module, key: Optional[tuple], loss_fn, profile) -> None:
    """Keep a copy of ``profile`` under ``key`` and under the key of ``model`` as it is now, after the
    profile ran (nothing when the call was not cacheable)."""
    if key is None:
        return
    entry = (weakref.ref(model), loss_fn, copy.deepcopy(profile))
    for each in (key, (key[0], _model_fingerprint(model), *key[2:])):
        PROFILES[each] = entry
        PROFILES.move_to_end(each)
    while len(PROFILES) > KEPT:
        PROFILES.popitem(last=False)


def _digest(tensor: torch.Tensor):
    """A digest of ``tensor``'s values; None where it has none (meta, fake); False: too large."""
    if tensor.device.type == "meta" or isinstance(tensor, torch._subclasses.FakeTensor):
        return None
    if tensor.numel() * tensor.element_size() > DIGEST_LIMIT:
        return False
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def _model_fingerprint(model: nn.Module) -> tuple:
    modules = []
    for name, module in model.named_modules():
        hooks = tuple(len(getattr(module, attribute, ()) or ()) for attribute in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
            "_state_dict_hooks", "_load_state_dict_pre_hooks"))
        instance_forward = vars(module).get("forward")
        modules.append((name, type(module).__qualname__, id(type(module).forward),
                        None if instance_forward is None else id(instance_forward), hooks))
    tensors = tuple((name, tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad, _address(t), t._version)
                    for name, t in (*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)))
    config = getattr(model, "config", None)
    try:
        config_text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    except (TypeError, ValueError):  # a config holding something JSON cannot write
        config_text = repr(config)
    return tuple(modules), tuple(sorted(fingerprint(model).items())), tensors, config_text


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
        return id(tensor)
