"""remat's process caches, registered in one place so that one call empties them all.

What remat works out once per process and keeps for the next call lives in a module global of
the module that needs it: the chunked loss's compiled kernels and the shapes they failed on
(:mod:`remat.head.xent_kernel`), ``selective``'s decision per op, which sub-modules mix tokens
(:mod:`remat.treat.tiled`), a KV cache layer's constructor parameters, the ``torch.compiler.disable``
wrappers of remat's own frames, what dynamo answers for transformers' mask checks. Each is
registered here where it is made (``KERNEL = caches.register({}, "head.xent_kernel.KERNEL")``,
or ``@caches.register`` over a ``functools.lru_cache``), and :func:`clear` empties every one
(or those under a name prefix): the process then behaves as a new one would, recomputing each
entry on first use.

Why: a cache entry outlives the situation it was made in (another torch.compile backend, a
transformers function replaced by a test or another library, a kernel a test put in place);
without one registry a test had to know each global and empty it by hand. The caches hold only
what can be worked out again: clearing one never changes a result, only the time of the next
call. State that is not a cache (the patches on a model, the models holding mask-skip's wrappers,
the offload engine's pools) is not registered, and :func:`clear` leaves it alone.

This module sits at the lowest layer (beside :mod:`remat.units`) and imports nothing, so every
module may register with it and ``import remat`` stays free of torch.
"""
from __future__ import annotations

from typing import Callable

_CLEARS: dict = {}  # name -> the function that empties the cache


def register(cache, name: str | None = None):
    """Register ``cache`` under ``name`` and return it unchanged.

    Args:
        cache: anything with a ``clear()`` (a dict, a set, a ``weakref.WeakKeyDictionary``) or a
            ``functools.lru_cache`` function (emptied with its ``cache_clear()``).
        name: dotted, by convention the module under ``remat`` and the global
            (``"treat.selective._DECISIONS"``); default: a function's module and name.

    Returns:
        ``cache``, so that a global is defined and registered in one line, or a cached function
        registered by decorating it.

    Raises:
        TypeError: ``cache`` has neither ``clear`` nor ``cache_clear``, or no name was given for
            an object that has none.

    A name registered again (its module reloaded) names the newer cache.

    Example::

        KERNEL = caches.register({}, "head.xent_kernel.KERNEL")

        @caches.register
        @functools.lru_cache(maxsize=None)
        def saved_ops(): ...
    """
    empty: Callable = getattr(cache, "cache_clear", None) or getattr(cache, "clear", None)
    if not callable(empty):
        raise TypeError(f"remat.caches.register expects a dict, set or functools.lru_cache function (something with "
                        f"clear() or cache_clear()), got {type(cache).__name__}")
    if name is None:
        module, qualname = getattr(cache, "__module__", None), getattr(cache, "__qualname__", None)
        if not (module and qualname):
            raise TypeError(f"remat.caches.register needs a name for a {type(cache).__name__}: "
                            "register(cache, 'package.module.NAME')")
        name = f"{module.removeprefix('remat.')}.{qualname}"
    _CLEARS[name] = empty
    return cache


def clear(prefix: str = "") -> list:
    """Empty every registered cache whose name starts with ``prefix`` (all of them by default).

    Returns the names emptied, sorted. Example: ``remat.caches.clear("head.")`` before a test
    that puts its own kernel in place, as in a new process.
    """
    names = sorted(name for name in _CLEARS if name.startswith(prefix))
    for name in names:
        _CLEARS[name]()
    return names


def registered() -> list:
    """The names of the registered caches, sorted (those of modules imported so far)."""
    return sorted(_CLEARS)
