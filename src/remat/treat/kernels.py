"""liger-kernel's fused ops on one block instance (and on the LM head), installed through the patch registry.

What: ``kernels="liger"`` runs a block's RMSNorms, its gated MLP (SwiGLU, GeGLU) and its rotary
embedding with Liger's Triton kernels (the head mode ``"liger"``, :mod:`remat.treat.liger_head`,
the LM loss with its fused linear cross-entropy), as liger-kernel's
``apply_liger_kernel_to_<family>(model=...)`` does, but per instance and undoably: every change is
an instance ``forward`` installed by :func:`remat.treat.patches.install` (tag ``"kernels"``), so
:func:`remat.remove` takes it off, ``state_dict`` keys stay the same and no class, no module global
of transformers and no other model in the process changes. Liger's own patching binds methods and
sets attributes on the modules, or rebinds transformers' classes for every model built afterwards;
neither can be undone.

How: a norm's ``forward`` calls ``LigerRMSNormFunction`` with the family's offset, casting mode and
in-place backward (Liger's table); an MLP's calls ``LigerSwiGLUMLP.forward`` / ``LigerGEGLUMLP.forward``
on the module's own projections (LoRA layers included); the attention runs a copy of its class's
``forward`` whose globals bind ``apply_rotary_pos_emb`` to Liger's (one copy per class). Sub-module
forwards are bound methods (one dynamo guard for every block's); tiled treatments installed after
these run them a chunk at a time.

Families: :data:`FAMILIES` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma-2), read from the module
defining the block's class; any other block keeps its stock modules and :func:`liger_targets` says
why (the plan's notes). A sub-module already running Liger's code is left as it is
(:func:`liger_parts`), and :func:`refuse_stock` refuses ``kernels="stock"`` for such a model rather
than undo another library's change.

Limits: the kernels need a GPU (Triton); on fake tensors the profiler stands in for them.
liger-kernel is optional (``pip install remat[kernels]``), imported only when a kernel is installed.
"""
from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from remat import caches
from remat.treat import patches

TAG = "kernels"
EXTRA = "pip install remat[kernels]"


@dataclass(frozen=True)
class Family:
    """What liger-kernel 0.8.5 patches in one model family's decoder layer."""

    norms: tuple
    """The layer's RMSNorms, by relative name."""
    offset: float = 0.0
    """Added to the norm's weight (Gemma's ``1 + weight``)."""
    casting: str = "llama"
    """Liger's casting mode: where the norm computes in fp32."""
    in_place: bool = True
    """The norm's backward writes its input gradient into its output gradient."""
    mlp: Optional[str] = "swiglu"
    """The gated MLP's kernel: ``swiglu``, ``geglu`` or None."""
    rope: bool = True
    """The attention's rotary embedding (``apply_rotary_pos_emb``) runs Liger's."""


_PAIR = ("input_layernorm", "post_attention_layernorm")
FAMILIES = {
    "llama": Family(norms=_PAIR),
    "mistral": Family(norms=_PAIR),
    "qwen2": Family(norms=_PAIR),
    "qwen3": Family(norms=_PAIR + ("self_attn.q_norm", "self_attn.k_norm")),
    "gemma": Family(norms=_PAIR, offset=1.0, casting="gemma", mlp="geglu"),
    "gemma2": Family(norms=_PAIR + ("pre_feedforward_layernorm", "post_feedforward_layernorm"), offset=1.0,
                     casting="gemma", in_place=False, mlp="geglu"),
}
"""Model type (the ``transformers.models.<type>`` package of a block's class) -> its kernels."""
_ACTIVATIONS = {"swiglu": ("silu", "swish"), "geglu": ("gelu_pytorch_tanh", "gelu_tanh")}


def liger_unavailable() -> Optional[str]:
    """Why liger-kernel cannot be used in this process (not installed, or its import fails), or None."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as error:  # noqa: BLE001 - ImportError, or Triton's own import failing on this machine
        return f"{type(error).__name__}: {str(error)[:160]}"
    return None


def require_liger(what: str = "kernels='liger'") -> None:
    """ValueError, one line naming the extra, where liger-kernel does not import."""
    why = liger_unavailable()
    if why is not None:
        raise ValueError(f"{what} needs liger-kernel, which does not import here ({why}): {EXTRA}")


_LIGER = caches.register({}, "treat.kernels._LIGER")  # what the installed forwards call: Liger's objects, looked up once per import of liger-kernel


def liger_objects() -> dict:
    """Liger's functions remat's installed forwards call: ``rms_norm`` (the autograd function),
    ``swiglu`` / ``geglu`` (the MLP forwards), ``rope`` (its ``apply_rotary_pos_emb``)."""
    ops = sys.modules.get("liger_kernel.ops")
    if ops is None or _LIGER.get("ops") is not ops:
        require_liger()
        import liger_kernel.ops as ops
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        _LIGER.clear()
        _LIGER.update(ops=ops, rms_norm=ops.LigerRMSNormFunction, swiglu=LigerSwiGLUMLP.forward,
                      geglu=LigerGEGLUMLP.forward, rope=liger_rotary_pos_emb)
    return _LIGER


def _liger(name: str):
    """One of :func:`liger_objects` (looked up after a model with remat's kernels is loaded in a new process)."""
    found = _LIGER.get(name)
    return found if found is not None else liger_objects()[name]


@dataclass(frozen=True)
class _Norm:
    eps: float
    offset: float
    casting: str
    in_place: bool


@dataclass(frozen=True)
class Target:
    """One sub-module remat would run with a Liger kernel."""

    name: str
    """Its name relative to the block (``""``: the block itself)."""
    module: nn.Module
    kind: str
    """``norm``, ``swiglu``, ``geglu`` or ``rope``."""
    state: object = None


def family_of(module: nn.Module) -> Optional[str]:
    """The model type of ``module``'s class (``transformers.models.llama...`` -> ``"llama"``), or None."""
    parts = type(module).__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _own_forward(module: nn.Module):
    """The instance ``forward`` beneath remat's patches (None: the class's)."""
    listed = [p for p in module.__dict__.get(patches._REGISTRY, ()) if p.attribute == "forward"]
    value = listed[0].previous if listed else module.__dict__.get("forward", patches._MISSING)
    return None if value is patches._MISSING else value


def _from_liger(value) -> bool:
    function = getattr(value, "__func__", value)
    return (getattr(function, "__module__", None) or "").startswith("liger_kernel")


def liger_owned(module: nn.Module) -> bool:
    """Whether ``module`` runs Liger's code that liger-kernel put there itself (a Liger class, or a
    forward Liger bound on the instance), not remat."""
    return _from_liger(type(module)) or _from_liger(_own_forward(module))


def _rope_owned(attention: nn.Module) -> bool:
    """Whether the attention's module calls Liger's rotary embedding already (a class-level patch)."""
    found = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)
    return found is not None and _from_liger(found)


def liger_targets(block: nn.Module) -> tuple:
    """``(targets, kept)``: the sub-modules of ``block`` remat runs with Liger's kernels, and why the
    others keep their own modules (``[]`` when nothing is kept; sub-modules Liger already runs are
    neither). Needs no liger-kernel."""
    family = family_of(block)
    spec = FAMILIES.get(family)
    if spec is None:
        return [], [f"{type(block).__name__} is not a family remat installs Liger's kernels on "
                    f"({', '.join(FAMILIES)}): its modules stay stock"]
    modules = dict(block.named_modules())
    targets, kept = [], []
    for name in spec.norms:
        norm = modules.get(name)
        if norm is None or liger_owned(norm):
            continue
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
        if weight is None or not isinstance(eps, float) or _own_forward(norm) is not None:
            kept.append(f"{name} ({type(norm).__name__}) stays stock: no weight, no eps or its own forward")
            continue
        targets.append(Target(name, norm, "norm", _Norm(eps, spec.offset, spec.casting, spec.in_place)))
    mlp = modules.get("mlp")
    if spec.mlp and mlp is not None and not liger_owned(mlp):
        config = getattr(mlp, "config", None)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")) or _own_forward(mlp) is not None:
            kept.append(f"mlp ({type(mlp).__name__}) stays stock: not gate/up/down projections")
        elif act not in _ACTIVATIONS[spec.mlp]:
            kept.append(f"mlp ({type(mlp).__name__}) stays stock: its activation is {act!r}, Liger's "
                        f"{spec.mlp} is {' / '.join(_ACTIVATIONS[spec.mlp])}")
        else:
            targets.append(Target("mlp", mlp, spec.mlp))
    attention = modules.get("self_attn")
    if spec.rope and attention is not None and not _rope_owned(attention):
        why = _rope_refused(attention)
        if why:
            kept.append(f"self_attn ({type(attention).__name__}) keeps its rotary embedding: {why}")
        else:
            targets.append(Target("self_attn", attention, "rope", type(attention)))
    return targets, kept


def liger_parts(block: nn.Module) -> list:
    """Relative names of ``block``'s sub-modules that run Liger's code liger-kernel put there itself
    (``self_attn`` for a class-level rotary embedding patch)."""
    found = [name or type(block).__name__ for name, m in block.named_modules() if liger_owned(m)]
    attention = dict(block.named_modules()).get("self_attn")
    if attention is not None and _rope_owned(attention):
        found.append("self_attn (apply_rotary_pos_emb)")
    return found


def kernel_of(block: nn.Module) -> str:
    """``"liger"`` where ``block`` runs Liger's kernels (remat's or liger-kernel's own), else ``"stock"``."""
    return "liger" if patches.patches(block, tag=TAG) or liger_parts(block) else "stock"


def refuse_stock(named) -> None:
    """ValueError where ``kernels="stock"`` was asked of blocks (``[(name, block)]``) that run Liger's
    kernels put there by liger-kernel: remat does not undo another library's patches."""
    for name, block in named:
        parts = liger_parts(block)
        if parts:
            raise ValueError(
                f"kernels='stock' was asked, but block {name} already runs Liger's kernels ({', '.join(parts[:3])}), "
                "put there by liger-kernel (apply_liger_kernel_to_<family>() before the model was built, or the "
                "Trainer's use_liger_kernel=True); remat does not undo another library's patches. Build the model "
                "without Liger's patch for stock modules, or leave kernels=None to plan over the kernels it has")


_IN_PLACE_ROPE = ("Liger's rotary embedding rotates q and k in place, in the matmul outputs selective keeps, so its "
                  "recompute would rotate them a second time (a Triton write torch's mutation check cannot see); "
                  "use attn-saved, full or mlp")


def selective_refused(block: nn.Module, kernel: str = "stock") -> Optional[str]:
    """Why ``selective`` cannot treat ``block`` running ``kernel`` (``"liger"``: remat's, installed or to be;
    liger-kernel's own count either way), or None."""
    attention = dict(block.named_modules()).get("self_attn")
    if attention is None:
        return None
    if _rope_owned(attention) or liger_owned(attention):
        return _IN_PLACE_ROPE
    if kernel == "liger" and (patches.patch_of(attention, "forward", tag=TAG) is not None
                              or any(t.kind == "rope" for t in liger_targets(block)[0])):
        return _IN_PLACE_ROPE
    return None


def check_kernels(block: nn.Module, record) -> None:
    """Raise the error :func:`install_kernels` (with ``record.kernel``) and the treatment after it would
    raise, without changing ``block``: liger-kernel missing, or ``selective`` over Liger's rotary embedding."""
    if record.kernel == "liger" and liger_targets(block)[0]:
        require_liger()
    if record.keeps == "matmuls":  # selective's policy
        why = selective_refused(block, record.kernel)
        if why:
            raise ValueError(f"treatment 'selective' with {record.kernel} kernels: {why}")


def install_kernels(block: nn.Module, kernel: str) -> list:
    """Run ``block``'s sub-modules with ``kernel`` (``"stock"``: as they are; ``"liger"``: Liger's where
    :func:`liger_targets` finds them); returns the notes on what stayed stock. A block that had
    remat's kernels gets the new ones."""
    remove_kernels(block)
    if kernel == "stock":
        return []
    if kernel != "liger":
        raise ValueError(f"unknown kernel {kernel!r}; expected 'stock' or 'liger'")
    targets, kept = liger_targets(block)
    if targets:
        liger_objects()
    for target in targets:
        if patches.patch_of(target.module, "forward", tag=TAG) is None:  # shared by two blocks: once
            patches.install(target.module, "forward", _FORWARDS[target.kind], tag=TAG, bound=True,
                            state=target.state)
    return kept


def remove_kernels(block: nn.Module) -> None:
    patches.remove(block, tag=TAG)


@contextlib.contextmanager
def kernels_installed(named, kernels):
    """Inside the block, each block of ``named`` (``[(name, block)]``) runs its kernel of ``kernels``
    (one per block); remat's kernels taken off afterwards."""
    try:
        for (_, block), kernel in zip(named, kernels):
            install_kernels(block, kernel)
        yield
    finally:
        for _, block in named:
            remove_kernels(block)


def _fused_norm(patch, hidden_states):
    s = patch.state
    return _liger("rms_norm").apply(hidden_states, patch.module.weight, s.eps, s.offset, s.casting, s.in_place, None)


def _fused_rope(patch, *args, **kwargs):
    return _rope_forward(patch.state)(patch.module, *args, **kwargs)


def _swiglu(patch, x):
    return _liger("swiglu")(patch.module, x)


def _geglu(patch, x):
    return _liger("geglu")(patch.module, x)


_FORWARDS = {"norm": _fused_norm, "swiglu": _swiglu, "geglu": _geglu, "rope": _fused_rope}


def _rope_refused(attention: nn.Module) -> Optional[str]:
    if _own_forward(attention) is not None:
        return "its forward is replaced on the instance by another library"
    names = set()
    function = type(attention).forward
    while function is not None:
        names |= set(getattr(getattr(function, "__code__", None), "co_names", ()))
        function = getattr(function, "__wrapped__", None)
    if "apply_rotary_pos_emb" not in names:
        return f"{type(attention).__name__}.forward does not call apply_rotary_pos_emb"
    try:
        _rebound(type(attention).forward, "apply_rotary_pos_emb", None)
    except ValueError as error:   # a decorator remat cannot see through
        return str(error)
    return None


_ROPE = caches.register({}, "treat.kernels._ROPE")  # attention class -> its forward calling Liger's rotary embedding


def _rope_forward(cls: type):
    """``cls.forward`` with ``apply_rotary_pos_emb`` bound to Liger's in a copy of its globals (made once)."""
    found = _ROPE.get(cls)
    if found is None or found[0] is not _LIGER.get("rope"):
        rope = liger_objects()["rope"]
        found = _ROPE[cls] = (rope, _rebound(cls.forward, "apply_rotary_pos_emb", rope))
    return found[1]


def _rebound(function, name: str, value):
    """A copy of ``function`` whose global ``name`` is ``value``; through ``functools.wraps`` wrappers
    (``deprecate_kwarg``), each copied with its closure's cell for the wrapped function replaced."""
    inner = getattr(function, "__wrapped__", None)
    if isinstance(function, types.FunctionType) and name in function.__code__.co_names:
        return _copy(function, dict(function.__globals__, **{name: value}), function.__closure__)
    if inner is None or not isinstance(function, types.FunctionType) or not function.__closure__:
        raise ValueError(f"cannot find the call to {name} in {getattr(function, '__qualname__', function)}")
    new_inner = _rebound(inner, name, value)
    cells = tuple(types.CellType(new_inner) if _cell(cell) is inner else cell for cell in function.__closure__)
    copy = _copy(function, function.__globals__, cells)
    copy.__wrapped__ = new_inner
    return copy


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _copy(function, globals_, closure):
    copy = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    copy.__dict__.update(function.__dict__)   # a wrapper's __wrapped__ among it (replaced by the caller)
    copy.__annotations__ = dict(getattr(function, "__annotations__", {}))
    return copy
