"""A stand-in ``triton`` package for CPU tests of remat's Liger wiring: liger-kernel's modules import.

liger-kernel (a small pure-Python wheel) imports ``triton`` at module level, and Triton's wheel is
~290 MB with nothing to run on a CPU. :func:`liger_imported` imports liger-kernel with a stub
under ``sys.modules`` (tests that need liger-kernel use it through the ``liger`` fixture of
``tests/test_kernels.py``): every ``triton`` / ``triton.*`` module imports, decorators hand back
their function, ``cdiv``/``next_power_of_2`` compute, and launching a kernel (``kernel[grid](...)``)
raises :class:`TritonLaunched` and counts the launch in :data:`LAUNCHES`, so a test can say that no
Triton kernel ran (a fake-tensor profile must never hand one a fake tensor). Anything else is a
permissive :class:`unittest.mock.MagicMock`. A real Triton, where one imports, is left alone. See
:func:`liger_imported` for how torch is kept from seeing the stub.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from unittest import mock

LAUNCHES = []


class TritonLaunched(RuntimeError):
    """A Triton kernel was launched (on the CPU there is none to run)."""


class _Kernel:
    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES.append(self.__name__)
            raise TritonLaunched(f"Triton kernel {self.__name__} launched (grid {grid}) on the CPU")
        return launch

    def __call__(self, *args, **kwargs):  # a @triton.jit helper called from another kernel
        return self.fn(*args, **kwargs)


def _decorator(fn=None, **kwargs):
    if callable(fn):
        return _Kernel(fn)
    return lambda f: f if isinstance(f, _Kernel) else _Kernel(f)


def _passthrough(*args, **kwargs):
    return lambda f: f


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _top() -> _Module:
    top = _Module("triton")
    top.__path__ = []
    top.__version__ = "3.5.0"
    top.jit = _decorator
    top.autotune = _passthrough
    top.heuristics = _passthrough
    top.cdiv = lambda a, b: -(-a // b)
    top.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
    return top


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _top() if spec.name == "triton" else _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def real_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return not isinstance(sys.modules.get("triton"), _Module)


LIGER_MODULES = ("liger_kernel.transformers", "liger_kernel.ops", "liger_kernel.transformers.model.llama",
                 "liger_kernel.transformers.model.mistral", "liger_kernel.transformers.model.qwen2",
                 "liger_kernel.transformers.model.qwen3", "liger_kernel.transformers.model.gemma",
                 "liger_kernel.transformers.model.gemma2")
"""What remat reaches of liger-kernel: imported under the stub, so they need no Triton afterwards."""


@contextlib.contextmanager
def liger_imported():
    """liger-kernel imported (:data:`LIGER_MODULES`) for the ``with`` block: on a machine without Triton
    under the stub, which is then taken out of ``sys.modules`` again (liger-kernel's modules keep the
    stub objects they imported; torch, which probes for Triton, never sees it: its probes are made
    first, and find none). The ``liger_kernel*`` modules imported here are forgotten afterwards.
    Raises ImportError where liger-kernel is not installed."""
    import importlib
    before = set(sys.modules)
    if real_triton():
        for name in LIGER_MODULES:
            importlib.import_module(name)
        yield False
        return
    import torch.utils._triton as torch_triton
    import torch.utils.flop_counter  # noqa: F401  (it reads Triton's JIT class once, at import)
    torch_triton.has_triton_package(), torch_triton.has_triton()   # cached: no Triton
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        for name in LIGER_MODULES:
            importlib.import_module(name)
    except BaseException:
        _forget(before, ("triton", "liger_kernel"))
        raise
    finally:
        sys.meta_path.remove(finder)
        _forget(before, ("triton",))
    try:
        yield True
    finally:
        _forget(before, ("liger_kernel",))


def _forget(before, prefixes):
    for name in set(sys.modules) - before:
        if name.split(".")[0] in prefixes:
            del sys.modules[name]
