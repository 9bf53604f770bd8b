"""Hub-kernel wrappers inside a checkpointed block: each module with none installed calls its own forward.

transformers 5.25 decorates its attention classes (and others) with the ``kernels`` package's
``use_kernelized_func``: every call of such a module's ``forward`` sets a context variable to the
module's kernel functions and resets it after (``kernels`` routes a global function, rotary
embeddings say, to a kernel that ``kernels.kernelize`` installed). Under ``torch.compile`` that
variable is a plain Python attribute, and inside a checkpoint's higher-order op dynamo refuses to
trace a write to one ("Mutating a variable from outside the scope of this HOP"): every checkpointed
block broke the graph and ran eager.

Where no kernel was installed on a module (``kernelize`` never ran, or fell back to the stock
forward: none of its kernel functions has a ``forward`` of its own), the wrapper chooses the stock
functions, which is what the module's own forward calls without it. :func:`unwrap_hub_kernels` puts
a patch on each such module's ``forward`` that calls the module class's own forward (the function
the wrapper wraps), so a treated block runs the same ops with no context variable written. A module
with a kernel installed keeps the wrapper: its graph still breaks (compiled, such a block runs its
checkpoint eager), and nothing it computes changes.
"""
from __future__ import annotations

import torch.nn as nn

from remat.treat import patches

_WRAPPER = "new_forward"   # the function use_kernelized_func installs as the class's forward


def _wrapped_forward(module: nn.Module):
    """The class's own forward under a hub-kernel wrapper with no kernel installed, else None."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    inner = getattr(forward, "__wrapped__", None)
    kernel_funcs = module.__dict__.get("_kernel_funcs")
    if code is None or inner is None or not isinstance(kernel_funcs, dict) or code.co_name != _WRAPPER \
            or "kernels" not in code.co_filename.replace("\\", "/").split("/") or _kernel_installed(module):
        return None
    return inner


def _kernel_installed(module: nn.Module) -> bool:
    """Whether ``kernelize()`` gave one of the module's kernel functions a forward of its own."""
    return any("forward" in vars(kernel) for kernel in module._kernel_funcs.values())


def unwrap_hub_kernels(block: nn.Module, *, tag: str) -> None:
    """Patch (with ``tag``, undone with the block's other patches of it) the ``forward`` of every module
    of ``block`` whose hub-kernel wrapper has no kernel installed, to call the class's own forward.
    Call before any other patch of those modules' ``forward``: theirs then run over this one."""
    for module in block.modules():
        if "forward" not in module.__dict__ and _wrapped_forward(module) is not None:
            patches.install(module, "forward", _own_forward, tag=tag, bound=True)


def _own_forward(patch: patches.Patch, *args, **kwargs):
    # looked up at each call, not held by the patch: the class's own forward pickles by a name that
    # now holds the wrapper (a treated model must pickle and deep-copy)
    module = patch.module
    if _kernel_installed(module):
        return patch.call_previous(*args, **kwargs)   # kernelize() installed one since: the wrapper's call
    return type(module).forward.__wrapped__(module, *args, **kwargs)
