"""The one way remat changes a module: install an attribute, remember what it replaced, undo.

Every change remat makes to a user's model (a treated block's ``forward``, the chunked head's, the
profiler's stubs, the applied plan itself) is a :class:`Patch` made by :func:`install` (or
:func:`install_value` for plain data). A patch records the attribute and what the instance had
before, and is listed, in install order, in the module's ``__dict__["_remat_patches"]``;
:func:`uninstall` and :func:`remove` undo patches in reverse order. This is the composable-API idea
of ``torch.distributed._composable.contract``: one registry per module, one install and one
uninstall path.

Undo restores only what remat put there: if another library wrapped a patched method after remat
(accelerate, PEFT, ``torch.compile``), the attribute is theirs and stays; remat's function inside
it becomes a pass-through (``Patch.active`` is False).

Installed methods are ``functools.partial(_dispatch, patch)`` objects (:class:`_Method`) over a
module-level function, so a treated model pickles, ``torch.save``s and deep-copies. The function is
called as ``function(patch, *args, **kwargs)``; ``patch.call_previous`` runs what was there before.
``install(..., bound=True)`` installs the patch's bound :meth:`Patch.run` instead, for sub-module
forwards inside a compiled frame shared by many blocks: dynamo guards a bound method by its code,
the same for every patch, where every partial was a new guard (past ``recompile_limit`` the rest ran
eager). Keep the partial where callers read the signature (the Trainer reads ``forward``'s).

:func:`suspended` takes every remat patch off a model and puts them back afterwards (planning a
model that has a plan). :func:`compiled_calls` sets a module's in-place compile for a while: a
scope around remat's own work, not a change to the user's model, hence no :class:`Patch`.

Limits: ``nn.DataParallel`` replicas copy ``__dict__`` shallowly; treatments refuse them at forward
time (:mod:`remat.treat.treatments`). More: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn

_REGISTRY = "_remat_patches"
_COUNTER = [0]  # install order, across modules: undo runs newest first


class _MISSING:
    """Marks "the instance had no attribute of its own" (a class pickles by name)."""


def _next_order() -> int:
    _COUNTER[0] += 1
    return _COUNTER[0]


@dataclass(eq=False)
class Patch:
    """One attribute remat installed on one module."""

    module: nn.Module
    attribute: str
    tag: str                    # what installed it: "treatment", "head", "hf-guard", "plan", ...
    function: Optional[Callable]  # for methods: called as function(patch, *args, **kwargs)
    value: Any                  # what was put in module.__dict__[attribute]
    previous: Any               # the instance attribute it replaced, or _MISSING
    state: Any = None           # data the function reads (the treatment, the engine ...)
    order: int = field(default_factory=_next_order)
    active: bool = True

    def call_previous(self, *args, **kwargs):
        """Run what ``attribute`` was before this patch (instance value, else the class's)."""
        if self.previous is not _MISSING:
            return self.previous(*args, **kwargs)
        return getattr(type(self.module), self.attribute)(self.module, *args, **kwargs)

    def run(self, *args, **kwargs):
        """The installed method of ``install(..., bound=True)``."""
        return _dispatch(self, *args, **kwargs)

    def __setstate__(self, state):
        # loaded (pickle, deepcopy): later installs must still sort after this one
        self.__dict__.update(state)
        _COUNTER[0] = max(_COUNTER[0], self.order + 1)


class _Method(functools.partial):
    """The installed method: ``_dispatch(patch, ...)`` that reports the signature of what it
    replaced, so ``inspect.signature(model.forward)`` (the Trainer's column filter, accelerate)
    sees the model's real parameters, not ``(*args, **kwargs)``."""

    @property
    def __signature__(self):
        patch = self.args[0]
        if patch.previous is not _MISSING:
            return inspect.signature(patch.previous)
        return inspect.signature(getattr(type(patch.module), patch.attribute).__get__(patch.module))


def _dispatch(patch: Patch, *args, **kwargs):
    if not patch.active:
        return patch.call_previous(*args, **kwargs)
    return patch.function(patch, *args, **kwargs)


def install(module: nn.Module, attribute: str, function: Callable, *, tag: str, state=None,
            bound: bool = False) -> Patch:
    """Replace method ``attribute`` of this one module by ``function(patch, *args, **kwargs)``.

    ``function`` must be a module-level function (it is pickled by name). ``bound``: install
    ``patch.run`` (traced by dynamo without an identity guard, signature not kept) instead of
    the signature-keeping partial."""
    patch = Patch(module, attribute, tag, function, None, module.__dict__.get(attribute, _MISSING), state)
    patch.value = patch.run if bound else _Method(_dispatch, patch)
    return _put(patch)


def install_value(module: nn.Module, attribute: str, value, *, tag: str) -> Patch:
    """Set a plain instance attribute (data, not a method), recorded like :func:`install`."""
    return _put(Patch(module, attribute, tag, None, value, module.__dict__.get(attribute, _MISSING)))


def _put(patch: Patch) -> Patch:
    # __dict__ directly: never a submodule, parameter or buffer, and no __setattr__ hooks
    patch.module.__dict__[patch.attribute] = patch.value
    patch.module.__dict__.setdefault(_REGISTRY, []).append(patch)
    return patch


def uninstall(patch: Patch) -> None:
    """Undo one patch. If the attribute is still remat's, the previous value comes back; if
    someone installed their own value on top, theirs stays and remat's becomes a pass-through."""
    if not patch.active:
        return
    patch.active = False
    module = patch.module
    listed = module.__dict__.get(_REGISTRY, [])
    if patch in listed:
        listed.remove(patch)
        if not listed:
            module.__dict__.pop(_REGISTRY, None)
    if _is_value(module.__dict__.get(patch.attribute, _MISSING), patch):
        if patch.previous is _MISSING:
            module.__dict__.pop(patch.attribute, None)
        else:
            module.__dict__[patch.attribute] = patch.previous


def _is_value(current, patch: Patch) -> bool:
    """Whether ``current`` is what ``patch`` installed. A deep copy of a ``bound=True`` patch can hold
    another bound ``run`` than its module's ``__dict__`` (deepcopy's memo misses the method it is
    copying when it reaches it again through the patch): equal, not identical, and still remat's."""
    if current is patch.value:
        return True
    return isinstance(current, types.MethodType) and getattr(current, "__self__", None) is patch and current == patch.value


def patches(model: nn.Module, tag: Optional[str] = None) -> list:
    """Active patches on ``model`` and its submodules, in install order (``tag`` filters)."""
    found = [p for m in model.modules() for p in m.__dict__.get(_REGISTRY, ())
             if tag is None or p.tag == tag]
    return sorted(found, key=lambda p: p.order)


def patch_of(module: nn.Module, attribute: str, tag: Optional[str] = None) -> Optional[Patch]:
    """The newest active patch of ``attribute`` on this one module, or None."""
    for patch in reversed(module.__dict__.get(_REGISTRY, ())):
        if patch.attribute == attribute and (tag is None or patch.tag == tag):
            return patch
    return None


def remove(model: nn.Module, tag: Optional[str] = None) -> list:
    """Undo every remat patch on ``model`` (or those with ``tag``), newest first; returns them."""
    undone = patches(model, tag)
    for patch in reversed(undone):
        uninstall(patch)
    return undone


def reinstall(undone: list) -> None:
    """Put back patches :func:`remove` returned, oldest first, as the same objects."""
    for patch in undone:
        patch.previous = patch.module.__dict__.get(patch.attribute, _MISSING)
        patch.active = True
        _put(patch)


@contextlib.contextmanager
def temporarily(module: nn.Module, attribute: str, function: Callable, *, tag: str, state=None) -> Iterator[Patch]:
    """:func:`install` for the duration of a ``with`` block (profiler stubs, head capture)."""
    patch = install(module, attribute, function, tag=tag, state=state)
    try:
        yield patch
    finally:
        uninstall(patch)


@contextlib.contextmanager
def compiled_calls(calls) -> Iterator[None]:
    """Each module's in-place compile set for the ``with`` block, and put back at its end.

    Args:
        calls: ``(module, call)`` pairs: ``call`` takes the place ``Module.compile()`` gives its
            compiled call (``module(*args)`` then runs ``call(*args)``); None runs the module eagerly.

    At the end each module gets back the compiled call it had (none: the class's default).

    Example::

        compiled = [m for m in model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
        with compiled_calls((m, None) for m in compiled):
            loss = model(**batch).loss  # eager
    """
    calls = list(calls)
    before = [module.__dict__.get(_COMPILED, _MISSING) for module, _ in calls]
    for module, call in calls:
        module.__dict__[_COMPILED] = call
    try:
        yield
    finally:
        for (module, _), previous in zip(reversed(calls), reversed(before)):
            if previous is _MISSING:
                module.__dict__.pop(_COMPILED, None)
            else:
                module.__dict__[_COMPILED] = previous


_COMPILED = "_compiled_call_impl"  # where Module.compile() puts its compiled call


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[list]:
    """The model without any remat patch inside the block, with all of them back after it."""
    undone = remove(model)
    try:
        yield undone
    finally:
        remove(model)  # anything installed inside the block goes first
        reinstall(undone)
