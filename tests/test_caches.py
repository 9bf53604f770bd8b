"""remat.caches: every process cache of remat is registered, and one clear() empties them all.

A cache is module state that can be worked out again (a compiled kernel, a decision per op, a
probe's answer). :func:`test_every_module_cache_is_registered` reads every module of
``src/remat`` with :mod:`ast` and finds each module-level empty container (``{}``, ``set()``,
``dict()``, ``defaultdict``, ``WeakKeyDictionary``) and each ``functools.lru_cache`` function:
each is registered with :func:`remat.caches.register` where it is made, or named in
:data:`STATE` with why it is state and not a cache.
"""
import ast
import functools
import importlib
from pathlib import Path

import pytest

from remat import caches

SOURCE = Path(__file__).resolve().parent.parent / "src" / "remat"
STATE = {
    "caches._CLEARS": "the registry itself",
    "treat.mask_skip._holders": "the models that hold mask-skip's wrappers: emptied by release(), never by a clear",
    "treat.mask_skip._originals": "transformers' functions while wrapped: put back by release()",
    "treat.cache_layout._WARNED": "a warning given once per process",
    "treat.cache_views._HELD": "the cache layers withheld in the forward running now: released when it returns",
    "treat.allocator._holders": "the models that hold expandable segments: emptied by release(), never by a clear",
}
CONTAINERS = ("dict", "set", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "OrderedDict")


def _module_caches():
    """``{name: registered?}`` of each module-level container made empty, and each lru_cache function."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        module = ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if any("lru_cache" in d or d in ("functools.cache", "cache") for d in decorators):
                    found[f"{module}.{node.name}"] = "caches.register" in decorators
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if not isinstance(target, ast.Name):
                continue
            registered = isinstance(value, ast.Call) and ast.unparse(value.func) == "caches.register"
            inner = value.args[0] if registered else value
            empty = (isinstance(inner, (ast.Dict, ast.Set, ast.List)) and not ast.unparse(inner).strip("{}[]")) or (
                isinstance(inner, ast.Call) and ast.unparse(inner.func).split(".")[-1] in CONTAINERS
                and not inner.keywords and all(isinstance(a, ast.Name) for a in inner.args))
            if empty:
                found[f"{module}.{target.id}"] = registered
    return found


def test_every_module_cache_is_registered():
    found = _module_caches()
    assert "head.xent_kernel.KERNEL" in found and "treat.selective.saved_ops" in found  # the scan sees both forms
    unowned = sorted(name for name, registered in found.items() if not registered and name not in STATE)
    assert unowned == [], f"register these with remat.caches.register (or name them in STATE, with why): {unowned}"
    assert not [name for name in STATE if name not in found], "STATE names a global that is gone"


def test_the_registered_names_are_the_globals_they_name():
    for name, registered in _module_caches().items():
        if registered:
            importlib.import_module(f"remat.{name.rpartition('.')[0]}")
    ours = {name for name in caches.registered() if not name.startswith("tests.")}  # this file registers its own
    assert {name for name, registered in _module_caches().items() if registered} == ours


def test_clear_empties_every_cache_and_the_next_call_works_them_out_again(fresh_caches):
    from remat.treat import selective
    ops = selective.saved_ops()
    assert selective.saved_ops.cache_info().currsize == 1
    kernel = importlib.import_module("remat.head.xent_kernel").KERNEL
    kernel["fn"] = object()
    assert "head.xent_kernel.KERNEL" in caches.clear("head.")
    assert kernel == {} and selective.saved_ops.cache_info().currsize == 1  # only under the prefix
    caches.clear()
    assert selective.saved_ops.cache_info().currsize == 0 and selective.saved_ops() == ops


def test_register_takes_containers_and_cached_functions_and_refuses_anything_else():
    table = caches.register({}, "tests.table")

    @functools.lru_cache(maxsize=None)
    def answer():
        return 42
    assert caches.register(answer, "tests.answer") is answer
    table["x"] = answer()
    assert {"tests.table", "tests.answer"} <= set(caches.registered())
    assert caches.clear("tests.") == ["tests.answer", "tests.table"]
    assert table == {} and answer.cache_info().currsize == 0
    with pytest.raises(TypeError, match="clear"):
        caches.register(42, "tests.number")
    with pytest.raises(TypeError, match="needs a name"):
        caches.register({})
