"""The stacks users already run, as bench rows beside remat's plans (``remat bench --anchors``).

A claim that remat is fast is made against what a user turns on with one flag, measured in the same
process on the same batch: Liger's fused kernels with Hugging Face checkpointing (``use_liger_kernel``),
Liger without checkpointing (the ceiling of those kernels, where it fits), ``torch.compile`` over HF
checkpointing, and Unsloth's offloaded checkpointing. transformers' own every-N and offload
checkpointing are the bench's default rows (:mod:`remat.prove.strategies`).

Liger patches a model family module-wide (``apply_liger_kernel_to_llama`` replaces ``LlamaRMSNorm``,
``LlamaMLP`` and ``apply_rotary_pos_emb`` in ``modeling_llama`` and ``LlamaForCausalLM.forward`` on the
class), so every model built after it is Liger's. A Liger row therefore runs inside
:func:`liger_patched`: the modeling module's globals and its classes' attributes are saved, Liger is
applied, the row's model is built, prepared and measured, and on exit everything Liger replaced is put
back, so the rows before and after it run the stock modules (a test holds it). The row's
:attr:`Strategy.around` is that scope; the bench enters it before it builds the model.

Rows (:data:`STACKS`; ``stacks`` names them all):

- ``liger_hf``: Liger (rope, rms_norm, swiglu, fused linear cross-entropy) + HF checkpointing;
- ``liger_keep``: the same kernels, no checkpointing: the ceiling other rows are a fraction of;
- ``liger_remat@<budget>``: ``remat.plan`` on the Liger-patched model (its profile its own);
- ``compile_hf``: HF checkpointing, then ``torch.compile``;
- ``unsloth``: HF checkpointing through Unsloth's offloaded checkpointer (``unsloth_zoo``).

Rows that cannot run here are ``skipped`` with the reason (liger-kernel or unsloth-zoo does not
import, no GPU for Triton kernels, a family Liger does not patch), never refused: one command names
several stacks, and one absent package must not cost the others.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Optional

from remat.prove.anchors import Skip

LIGER_KERNELS = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
"""What ``use_liger_kernel=True`` turns on for a Llama-family model (Liger's defaults)."""

STACKS = {
    "liger_hf": "Liger kernels (rope, rms_norm, swiglu, fused linear CE) + HF checkpointing",
    "liger_keep": "Liger kernels, no checkpointing (the ceiling)",
    "liger_remat": "remat.plan at each budget on the Liger-patched model",
    "compile_hf": "torch.compile + HF checkpointing",
    "unsloth": "Unsloth's offloaded gradient checkpointing (unsloth_zoo)",
}


def expand(names) -> list:
    """``--anchors`` names with ``stacks`` spelled out, in order, once each."""
    out = []
    for name in names:
        for one in (STACKS if name == "stacks" else [name]):
            if one not in out:
                out.append(one)
    return out


def liger_unavailable(model_type: str, cuda: bool) -> Optional[str]:
    """Why a Liger row cannot run here, or None."""
    if not cuda:
        return "Liger runs Triton kernels: it only applies on a GPU"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as error:  # ImportError, or a kernel package failing at import (no Triton)
        return (f"liger-kernel does not import here ({type(error).__name__}: {str(error)[:120]}); install it with "
                "`pip install liger-kernel` or, offline, `pip install --no-deps .whl/liger_kernel-*.whl`")
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger has no kernels for the {model_type!r} family"
    return None


@contextlib.contextmanager
def liger_patched(model_type: str, cuda: bool = True):
    """Within the region, models of ``model_type`` built are Liger's (:data:`LIGER_KERNELS`), and the
    family's module runs Liger's functions; on exit the module and its classes are as before.
    Raises :class:`Skip` where Liger cannot run (:func:`liger_unavailable`)."""
    why = liger_unavailable(model_type, cuda)
    if why:
        raise Skip(why)
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = ModuleState(module)
    try:
        apply(**{k: v for k, v in LIGER_KERNELS.items() if _accepts(apply, k)})
        yield
    finally:
        saved.restore()


def _accepts(function, name: str) -> bool:
    import inspect
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True


class ModuleState:
    """A module's globals and the attributes of the classes it defines, saved to be put back:
    what a module-wide monkeypatch (Liger's) changes, undone exactly."""

    def __init__(self, module):
        self.module = module
        self.globals = dict(vars(module))
        self.classes = {value: dict(vars(value)) for value in self.globals.values()
                        if isinstance(value, type) and value.__module__ == module.__name__}

    def restore(self) -> None:
        _put_back(self.module, self.globals)
        for cls, attributes in self.classes.items():
            _put_back(cls, attributes)


def _put_back(owner, saved: dict) -> None:
    now = vars(owner)
    for name in [n for n in now if n not in saved]:
        delattr(owner, name)
    for name, value in saved.items():
        if now.get(name, _MISSING) is not value:
            setattr(owner, name, value)


_MISSING = object()


def unsloth_checkpointer():
    """Unsloth's offloaded checkpointing function (``unsloth_zoo.gradient_checkpointing``), or
    :class:`Skip` saying why it is not here."""
    try:
        module = importlib.import_module("unsloth_zoo.gradient_checkpointing")
    except Exception as error:  # noqa: BLE001 - unsloth_zoo imports unsloth, which needs its own pins and a GPU
        raise Skip(f"unsloth_zoo does not import here ({type(error).__name__}: {str(error)[:160]}); Unsloth's "
                   "wheels (unsloth, unsloth-zoo and their pinned bitsandbytes/xformers/triton) are not among the "
                   "ones carried to this machine") from None
    checkpointer = getattr(module, "Unsloth_Offloaded_Gradient_Checkpointer", None)
    if checkpointer is None:
        raise Skip(f"unsloth_zoo {getattr(sys.modules.get('unsloth_zoo'), '__version__', '?')} has no "
                   "Unsloth_Offloaded_Gradient_Checkpointer")
    return checkpointer
