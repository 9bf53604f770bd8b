"""remat's own ``torch.compile`` calls, and taking their compiled graphs back out of dynamo's cache.

remat compiles to measure (compiled profiles, verifying a compiled plan, the bench, the mask
skip's one question). dynamo keeps every graph it compiles as a cache entry on the code object it
traced, for the life of the process; left there, remat's entries would hold their code and count
against ``torch._dynamo.config.recompile_limit``, so the user's ``model.compile()`` after
``remat.plan(..., compile=True)`` would fall back to eager. ``torch._dynamo.reset()`` would also
remove every graph the user compiled.

How remat's entries are taken out and the user's left alone:

- :func:`compiled` compiles a trampoline ``(module, *args, **kwargs) -> module._call_impl(...)``
  whose code object is a fresh copy per call (dynamo keys its cache by code object), with the
  module an argument, so one compiled trampoline serves every block of a class (``.bind(block)``);
- where torch has it (``torch.compile(isolate_recompiles=True)``), remat's compiles form regions
  of their own that neither reuse nor count against the user's entries;
- :func:`own_compiles` notes the entries of every code object dynamo has seen; at its end a code
  object that had none is reset whole (``torch._dynamo.reset_code``), and on one holding the
  user's entries remat's new ones are invalidated one by one.

:func:`eager` is the other side: ``torch.compiler.disable`` of a frame of remat's that dynamo must
not trace, made once per function.

Limits: outside a region of its own an invalidated entry would still count against the user's
limit, so there such a code object is reset whole, with a warning; a torch lacking these dynamo
internals keeps remat's entries, with a warning; other threads' compiles during
:func:`own_compiles` are taken for remat's. More: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from typing import Iterator

import torch

from remat import caches


def _trampoline(module, *args, **kwargs):
    return module._call_impl(*args, **kwargs)  # not module(...): its _compiled_call_impl may be this


def compile_options() -> dict:
    """Keywords for remat's ``torch.compile`` calls: a region of their own where torch has them."""
    return {"isolate_recompiles": True} if isolating() else {}


@caches.register
@functools.lru_cache(maxsize=None)
def isolating() -> bool:
    """Whether this torch's ``torch.compile`` keeps a call's entries apart (``isolate_recompiles``)."""
    try:
        return "isolate_recompiles" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return False


class Compiled:
    """A module's call compiled on a code object of its own (:func:`compiled`)."""

    def __init__(self, **options):
        fresh = types.FunctionType(_trampoline.__code__.replace(), _trampoline.__globals__, "remat_compiled")
        self.code = fresh.__code__
        self.call = torch.compile(fresh, **options, **compile_options())

    def bind(self, module):
        """``module``'s compiled call: ``module(*args, **kwargs)`` through the compiled trampoline.
        Every module bound to one :class:`Compiled` shares its graphs where dynamo's guards let it."""
        return functools.partial(self.call, module)


def compiled(**options) -> Compiled:
    """``torch.compile(**options)`` of a fresh trampoline: ``compiled(...).bind(module)(*args)``."""
    return Compiled(**options)


_EAGER = caches.register({}, "treat.dynamo_cache._EAGER")  # (module, qualname, recursive) -> wrapper


def eager(fn, recursive: bool = True):
    """``torch.compiler.disable(fn, recursive=recursive)``, made once per function: a frame of
    remat's that dynamo must not trace (the chunked head's loss, the profiler's stubs). A new
    wrapper at each call would be a new object for dynamo to guard on; keyed by name, not by the
    function, so that a compiled forward that calls this looks up a constant. Importing dynamo
    takes seconds, so callers make theirs on first use, not at import time."""
    key = (fn.__module__, fn.__qualname__, recursive)
    wrapped = _EAGER.get(key)
    if wrapped is None:
        wrapped = _EAGER[key] = torch.compiler.disable(fn, recursive=recursive)
    return wrapped


def _internals():
    """``(cache entries of a code object, reset one code object, the code objects dynamo has
    seen)`` from this torch's dynamo, or None where it lacks them."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
        from torch._dynamo import convert_frame

        def seen():
            refs = list(convert_frame.input_codes.seen) + list(convert_frame.output_codes.seen)
            return [c for c in (r() for r in refs) if c is not None]
        seen()
    except (ImportError, AttributeError):
        return None
    return _debug_get_cache_entry_list, reset_code, seen


def _invalidate(entry) -> bool:
    """Drop one cache entry as dynamo drops one whose guarded object died; False where this torch
    cannot (the entry is then left as it is)."""
    try:
        from torch._dynamo.guards import DeletedGuardManagerWrapper
        manager = entry.guard_manager
        cache_entry, extra_state = manager.cache_entry, manager.extra_state
        if cache_entry is None or extra_state is None:
            return False
        extra_state.invalidate(cache_entry, DeletedGuardManagerWrapper("remat: its own compile, done"))
        return True
    except (ImportError, AttributeError, TypeError):
        return False


def _key(entry) -> str:
    """A cache entry's identity, the same after dynamo invalidates it: its compile id."""
    return str(entry.compile_id)


def _name(code) -> str:
    return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"


@contextlib.contextmanager
def own_compiles(what: str = "remat") -> Iterator[None]:
    """Inside the block, compiles are remat's; at its end they are gone from dynamo's cache and
    every entry that existed before it is still there (module docstring). ``what``: who compiled,
    for the warnings."""
    import torch._dynamo  # noqa: F401  (dynamo's internals below need it imported)
    internals = _internals()
    if internals is None:
        try:
            yield
        finally:
            warnings.warn(f"{what}: this torch ({torch.__version__}) gives no way to drop one compiled graph, so "
                          "the graphs remat compiled stay in dynamo's cache and count against "
                          "torch._dynamo.config.recompile_limit; torch._dynamo.reset() drops them, and every other "
                          "graph this process compiled", RuntimeWarning, stacklevel=3)
        return
    list_entries, reset_code, seen = internals
    before = {id(code): (code, {_key(e): e.code is not None for e in list_entries(code)}) for code in seen()}
    try:
        yield
    finally:
        shared = []
        for code in seen():
            owner, old = before.get(id(code), (None, {}))
            old = old if owner is code else {}
            new = [e for e in list_entries(code) if _key(e) not in old]
            if not new:
                continue
            if not any(old.values()):          # nothing compiled before lives there: all of it is remat's
                reset_code(code)
            elif not (all(getattr(e, "isolate_recompiles_id", -1) >= 0 for e in new)
                      and all(_invalidate(e) for e in new if e.code is not None)):
                reset_code(code)
                shared.append(_name(code))
        if shared:
            why = ("its graphs share no region of their own with this torch's" if not isolating() else
                   "a stock torch.compile shares its region with the process's other compiles")
            warnings.warn(f"{what}: the graphs it compiled of a function this process had compiled too cannot be "
                          f"dropped alone ({why}), so every graph of {', '.join(shared[:4])}"
                          f"{' ...' if len(shared) > 4 else ''} was dropped: they recompile on their next call",
                          RuntimeWarning, stacklevel=3)
