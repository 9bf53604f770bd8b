"""``remat.apply`` and ``remat.remove``: change a model in place, and undo it.

``apply`` discovers the blocks (or takes ``blocks=``), turns the spec into a
:class:`~remat.planning.plans.Plan`, refuses a model on which Hugging Face gradient checkpointing
is on, and treats each block, all or nothing. It also guards the model against Hugging Face
checkpointing being switched on *later* (the Trainer does that at ``train()`` with
``gradient_checkpointing=True``): ``gradient_checkpointing_enable`` then raises instead of
silently checkpointing every block twice.

State beside the blocks, each given back by ``remove`` (and by the model's finalizer):

- under ``torch.compile``, transformers' attention-mask decision as eager mode makes it, inside
  this model's forward only (:mod:`remat.treat.mask_skip`; ``mask_skip=False`` leaves it out);
- on a GPU, the caching allocator's expandable segments while the model holds the plan
  (:mod:`remat.treat.allocator`: fixed-size segments fragment past a card-sized budget;
  ``expandable_segments=False`` leaves the allocator alone).

Applying again replaces the previous plan; a block is never wrapped twice. Blocks a plan puts in
one segment (``"segments:K"``) share one :class:`~remat.treat.segments.Segment`, made fresh at each
apply.

Why it checks the plan against the model: a plan from :func:`remat.plan` knows what it was made for
(:attr:`remat.Plan.made_for`). ``apply`` refuses one whose blocks are not this model's, one for one,
or whose model class is nowhere in this model, naming the first difference; a wrapper's prefix is
looked through (PEFT). ``strict=False`` applies the blocks the plan names, by suffix. The batch
shape is checked at the first training forward (a difference is warned once); a compiled model is
not checked, as the check would split the graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
import torch.nn as nn

from remat.planning.plans import KERNELS, Plan, resolve
from remat.planning.records import block_records
from remat.treat import allocator as _allocator
from remat.treat import mask_skip as _mask_skip
from remat.treat import patches
from remat.treat.block_state import cache_reader
from remat.treat.cache_views import release_withheld
from remat.treat.discovery import BlockSelector, discover
from remat.treat.kernels import check_kernels, install_kernels, liger_targets, refuse_stock, require_liger
from remat.treat.liger_head import install_liger_head, liger_head_unavailable
from remat.treat.refusals import UNDONE, StepRefusal
from remat.treat.segments import segments_of
from remat.treat.treatments import apply_treatment, check_treatment, treatment_of

_PLAN = "_remat_plan"
_BATCH_TAG = "batch-check"
_REFUSAL_TAG = "step-refusal"


def apply(model: nn.Module, spec="full", *, blocks: BlockSelector = None,
          head: Optional[str] = None, chunk_tokens: Optional[int] = None,
          tile_tokens: Union[int, Mapping[str, int], None] = None, offload_options: Optional[dict] = None,
          strict: bool = True, mask_skip: bool = True, kernels: Optional[str] = None,
          expandable_segments: Optional[bool] = None) -> nn.Module:
    """Treat ``model``'s blocks according to ``spec``, in place, all or nothing; returns ``model``.

    The spec, the head and every block's treatment are checked before the model is touched; if
    installing fails anyway the model is put back exactly as it was, its previous plan included.
    What shows only once the model runs (a block that writes in place into an output ``selective``
    keeps, a forward that post-processes its logits otherwise than its source says) is refused in the
    first step that shows it, which takes remat off the model again (:mod:`remat.treat.refusals`).

    Args:
        model: the ``nn.Module`` to change.
        spec: a treatment for every block (``"full"``, ``"selective"``, ``"attention"``, ``"mlp"``,
            ``"offload"``, ``"full+offload"``, ``"tiled"``, ``"full+tiled"``, ``"full+offload+tiled"``,
            ``"keep"``), ``"every:N[:treatment]"``, ``"first:N[:treatment]"``, ``"segments:K"`` /
            ``"segments:sqrt"`` (:mod:`remat.planning.plans`), a ``{block name: treatment}`` mapping,
            or a :class:`~remat.planning.plans.Plan`.
        blocks: which modules are the blocks (default: :func:`remat.discover`'s).
        head: ``"plain"``, ``"chunked"`` (the LM loss a chunk of tokens at a time: :mod:`remat.head`)
            or ``"liger"``; default the plan's.
        chunk_tokens: the chunked head's chunk; default the plan's, else chosen for the vocabulary.
        tile_tokens: tokens per chunk of the tiled treatments' token-wise sub-modules
            (:mod:`remat.treat.tiled`), one size or a ``{block name: size}`` mapping; replaces the
            plan's (default: the plan's, else 8192).
        offload_options: keyword arguments of :class:`remat.offload.engine.OffloadEngine`
            (default: the plan's ``notes["offload_options"]``).
        strict: a plan from :func:`remat.plan` must be for this model, block for block (module
            docstring); False applies the blocks it names, by suffix, and keeps the rest.
        mask_skip: under ``torch.compile``, let this model's forward skip the attention mask where
            eager mode skips it (:mod:`remat.treat.mask_skip`); False leaves transformers alone.
        kernels: ``"liger"``: every block's norms, gated MLP and rotary embedding run liger-kernel's
            fused kernels (:mod:`remat.treat.kernels`; blocks Liger cannot serve keep theirs, warned),
            and, where ``head`` is not given and the plan's head is plain, Liger's fused loss where the
            family has it. ``"stock"``: the model's own modules. Default: the plan's, stock for a spec.
        expandable_segments: None: switch the caching allocator to expandable segments while the
            model holds the plan, where it trains on a GPU and nothing opts out
            (``REMAT_EXPANDABLE_SEGMENTS=0``, ``PYTORCH_CUDA_ALLOC_CONF``); warned where a plan
            counted on them. True: the same, warned whenever they cannot be had. False: left alone.

    Returns:
        ``model``, changed in place (:func:`remove` undoes it; :func:`current_plan` reads the plan).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: Hugging Face gradient checkpointing is on; an unknown spec, treatment, head or
            kernel; a treatment a block cannot take (named); a plan made for another model (with
            ``strict``); ``kernels="stock"`` on a model liger-kernel patched itself; a head that
            cannot run on this model.

    Example:
        >>> remat.apply(model, "every:2")                               # doctest: +SKIP
        >>> remat.apply(model, remat.plan(model, batch, "24GiB"))       # doctest: +SKIP
        >>> remat.remove(model)                                         # doctest: +SKIP
    """
    _check_module(model, "apply", "remat.apply(model, spec)")
    _refuse_hf_checkpointing(model)
    structure = discover(model, blocks)
    plan = resolve(spec, structure.block_names, strict=strict)
    if strict:
        problem = model_mismatch(model, plan, structure.block_names)
        if problem:
            raise ValueError(f"{problem}; plan this model with remat.plan(model, batch, budget), or pass "
                             "strict=False to apply the plan anyway")
    named = structure.blocks(model)
    if kernels is not None:
        plan, head = _with_kernels(model, plan, kernels, head, named)
    if head is not None or chunk_tokens is not None or tile_tokens is not None:
        plan = dataclasses.replace(plan, head=head if head is not None else plan.head,
                                   chunk_tokens=chunk_tokens if chunk_tokens is not None else plan.chunk_tokens,
                                   tile_tokens=tile_tokens if tile_tokens is not None else plan.tile_tokens)
    records = block_records(plan, [name for name, _ in named])   # the plan resolved once, per block
    offloading = any(r.offload for r in records)
    for (name, block), record in zip(named, records):
        try:
            check_treatment(block, record)
            check_kernels(block, record)
        except ValueError as error:
            raise ValueError(f"block {name}: {error}") from None
    if plan.head == "chunked":
        from remat.head import check_chunked_head
        check_chunked_head(model, chunk_tokens=plan.chunk_tokens)
    if plan.head == "liger":
        _check_liger_head(model)
    previous = patches.remove(model)
    try:
        engine = None
        if offloading:
            from remat.offload import OffloadEngine
            options = offload_options if offload_options is not None else plan.notes.get("offload_options")
            engine = OffloadEngine(model, **dict(options or {}))
        segments = segments_of(records)
        writes_cache = cache_reader(model) is not None  # the model reads its cache in its training forward
        for (name, block), record in zip(named, records):
            install_kernels(block, record.kernel)   # first: a tiled sub-module's chunks run the fused forward
            apply_treatment(block, record, engine=engine, segment=segments.get(record.segment),
                            writes_cache=writes_cache)
        if plan.head == "chunked":
            from remat.head import enable_chunked_head
            enable_chunked_head(model, chunk_tokens=plan.chunk_tokens)
        elif plan.head == "liger":
            install_liger_head(model)
        _guard_hf_checkpointing(model)
        patches.install_value(model, _PLAN, plan, tag="plan")
        if "batch" in plan.notes and "seq" in plan.notes:
            patches.install(model, "forward", _check_batch, tag=_BATCH_TAG, state=_BatchCheck(plan))
        patches.install(model, "forward", _undo_on_refusal, tag=_REFUSAL_TAG)
    except BaseException:
        patches.remove(model)
        patches.reinstall(previous)
        raise
    if mask_skip:
        _mask_skip.hold(model, structure.block_names)
    else:
        _mask_skip.release(model)
    _hold_allocator(model, plan, expandable_segments)
    return model


def _hold_allocator(model: nn.Module, plan: Plan, wanted: Optional[bool]) -> None:
    """Expandable segments for a model on a GPU while it holds ``plan`` (see :func:`apply`)."""
    if wanted is False or not _trains_on_gpu(model):
        _allocator.release(model)
        return
    why = _allocator.hold(model)
    counted = str(plan.notes.get("allocator", "")).startswith("expandable")
    if why is not None and (wanted or counted):
        warnings.warn(f"remat: the caching allocator's expandable segments stay off ({why}); "
                      + ("this plan was made counting on them, so the memory the allocator reserves can exceed its "
                         "budget by its fragmentation: plan again in this environment, which keeps a share of the "
                         "budget for it" if counted else "reserved memory can exceed the plan's peak by the "
                         "allocator's fragmentation"), UserWarning, stacklevel=3)


def _trains_on_gpu(model: nn.Module) -> bool:
    """A model with parameters on a GPU, or on ``meta`` (materialised later, FSDP2's way) where one is present."""
    devices = {p.device.type for p in model.parameters()}
    return "cuda" in devices or (devices == {"meta"} and torch.cuda.is_available())


def _with_kernels(model: nn.Module, plan: Plan, kernels, head, named) -> tuple:
    """``(plan, head)`` with ``kernels`` for every block (and Liger's fused loss as the head where ``head``
    is not given, the plan's is plain and the model's family has it); warns of the blocks Liger cannot
    serve; refuses ``"stock"`` for blocks liger-kernel patched itself."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)} (or None for the plan's), got {kernels!r}")
    if kernels == "stock":
        refuse_stock(named)
        return dataclasses.replace(plan, kernels=None), head
    require_liger()
    kept = {name: "; ".join(why) for name, block in named for why in [liger_targets(block)[1]] if why}
    if kept:
        first = next(iter(kept))
        warnings.warn(f"remat: {len(kept)} of {len(named)} blocks keep some or all of their stock modules under "
                      f"kernels='liger' ({first}: {kept[first]})", UserWarning, stacklevel=3)
    if head is None and plan.head == "plain" and liger_head_unavailable(model) is None:
        head = "liger"
    notes = dict(plan.notes, kernels_stock=kept) if kept else plan.notes
    return dataclasses.replace(plan, kernels="liger", notes=notes), head


def _check_liger_head(model: nn.Module) -> None:
    """The error installing the ``liger`` head would raise (or TRL's fused head bypassing it), before any change."""
    from remat.head import find_trl_head
    if find_trl_head(model) is not None:
        raise ValueError("head='liger' with TRL's fused LM head: the trainer computes its loss with its own head, "
                         "which never calls the model's forward; use head='plain'")
    why = liger_head_unavailable(model)
    if why is not None:
        raise ValueError(f"head='liger' cannot run on {type(model).__name__}: {why}; use head='plain' or 'chunked'")


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every change remat made to ``model`` is undone, newest first.

    A wrapper that another library installed over remat's (accelerate's autocast ``forward``)
    stays, and remat's part inside it passes calls straight through. The attention-mask skip and
    the allocator setting :func:`apply` took are given back. A model remat never touched is
    returned as it is.

    Args:
        model: the ``nn.Module`` :func:`apply` changed.

    Returns:
        ``model``, with its original modules.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> remat.remove(remat.apply(model, "full"))                    # doctest: +SKIP
    """
    _check_module(model, "remove", "remat.remove(model)")
    patches.remove(model)
    _mask_skip.release(model)
    _allocator.release(model)
    return model


def current_plan(model: nn.Module) -> Optional[Plan]:
    """The plan last applied to ``model`` by :func:`apply`, or None.

    Args:
        model: an ``nn.Module``.

    Returns:
        The :class:`~remat.planning.plans.Plan` it holds (a spec such as ``"full"`` resolved over
        its blocks), or None where no plan is applied (never, or since :func:`remove`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> remat.current_plan(remat.apply(model, "full")).summary()    # doctest: +SKIP
    """
    _check_module(model, "current_plan", "remat.current_plan(model)")
    return model.__dict__.get(_PLAN)


def treatments(model: nn.Module, blocks: BlockSelector = None) -> dict:
    """``{block_name: treatment}`` as the model is now."""
    _check_module(model, "api.treatments", "remat.api.treatments(model)")
    structure = discover(model, blocks)
    return {name: treatment_of(block) for name, block in structure.blocks(model)}


def _check_module(model, verb: str, call: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.{verb} expects a torch.nn.Module as its first argument, got "
                        f"{type(model).__name__} ({_short(model)}); call {call} with the model object")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def model_mismatch(model: nn.Module, plan: Plan, block_names) -> Optional[str]:
    """Why ``plan`` (resolved over ``block_names``, ``model``'s blocks) was not made for ``model``, or
    None: a solved plan that does not name every block, or whose model class is nowhere in ``model``
    (a PEFT wrapper holds its base model's class; a plan made on a wrapper names the wrapper's)."""
    made = plan.made_for
    if not made:
        return None
    names = list(block_names)
    missing = [n for n in names if n not in plan.blocks]
    if missing:
        return (f"the plan was made for {made.get('model', 'a model')} with {made['blocks']} blocks; this "
                f"{type(model).__name__} has {len(names)}, and the first the plan does not name is {missing[0]!r}")
    wanted = made.get("model")
    classes = {c.__name__ for m in model.modules() for c in type(m).__mro__}   # FSDP2's FSDPLlama... too
    if wanted and wanted not in classes and not wanted.startswith("Peft"):
        return (f"the plan was made for a {wanted}, and this model ({type(model).__name__}) holds none: its "
                f"{len(plan.blocks)} blocks match by name only")
    return None


@dataclass(eq=False)
class _BatchCheck:
    """The batch-shape check's state: the plan's shape, and whether the first training forward ran."""

    plan: Plan
    checked: bool = False


def _check_batch(patch, *args, **kwargs):
    """The model's ``forward`` until its first training call: warns if that batch's shape is not the
    plan's (module docstring), then passes calls straight through."""
    state = patch.state
    if not state.checked and patch.module.training and torch.is_grad_enabled() and not _compiling():
        state.checked = True
        shape = batch_shape(args, kwargs)
        want = (state.plan.notes["batch"], state.plan.notes["seq"])
        if shape is not None and shape != want:
            warnings.warn(
                f"remat: the plan applied to {type(patch.module).__name__} was made for a batch of {want[0]} x "
                f"{want[1]} tokens, and it trains on {shape[0]} x {shape[1]}: its predicted peak "
                f"({_gib(state.plan.notes.get('predicted_peak_bytes'))}) and step time are for the other shape. "
                "Re-plan at this shape (remat.plan(model, batch, budget)), or let remat.Guard / RematCallback "
                "plan from the batches that run", UserWarning, stacklevel=3)
    return patch.call_previous(*args, **kwargs)


def _undo_on_refusal(patch, *args, **kwargs):
    """The model's ``forward``: a :class:`~remat.treat.refusals.StepRefusal` raised inside it (remat
    refusing the model once it runs) takes remat off the model before it reaches the caller; and the
    KV cache layers treated blocks withheld in it are readable again once it returns
    (:func:`remat.treat.cache_views.release_withheld`)."""
    if _compiling():
        return patch.call_previous(*args, **kwargs)
    try:
        return patch.call_previous(*args, **kwargs)
    except StepRefusal as error:
        remove(patch.module)
        raise StepRefusal(str(error) + UNDONE) from error
    finally:
        release_withheld()  # the cache the forward returns may be read now (it lacks the treated blocks)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def batch_shape(args, kwargs) -> Optional[tuple]:
    """(sequences, tokens) as the profiler reads a batch: ``input_ids``/``inputs_embeds``, else the
    first tensor argument's first two dimensions; None when there is no such tensor."""
    for key in ("input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    if first is None:
        return None
    return int(first.shape[0]), int(first.shape[1]) if first.dim() in (2, 3) else 1


def _gib(nbytes) -> str:
    from remat.units import format_size
    return "unknown" if nbytes is None else format_size(nbytes)


@contextlib.contextmanager
def batch_check_held(model: nn.Module):
    """Inside the block the model's first training forward is not compared with its plan's batch
    (``remat doctor`` runs a step of its own, which must not use up the user's check)."""
    states = [p.state for p in patches.patches(model, tag=_BATCH_TAG)]
    before = [state.checked for state in states]
    for state in states:
        state.checked = True
    try:
        yield
    finally:
        for state, value in zip(states, before):
            state.checked = value


def _refuse_hf_checkpointing(model: nn.Module) -> None:
    on = [name or type(model).__name__ for name, m in model.named_modules()
          if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        raise ValueError(
            "Hugging Face gradient checkpointing is on for this model "
            f"({', '.join(on[:3])}{' ...' if len(on) > 3 else ''}); remat would checkpoint on top of "
            f"it. Call model.{hf_disable_name(model)}() first (Trainer: {hf_argument_name()}=False), then "
            "remat.apply(model, ...) gives the same memory saving and more.")


def hf_disable_name(model: nn.Module) -> str:
    """The method that turns Hugging Face checkpointing off on ``model``: ``activation_checkpointing_disable``
    (transformers 5; ``gradient_checkpointing_disable`` is its deprecated alias there), else the old name."""
    return ("activation_checkpointing_disable" if callable(getattr(model, "activation_checkpointing_disable", None))
            else "gradient_checkpointing_disable")


def hf_argument_name() -> str:
    """``TrainingArguments``' switch for Hugging Face checkpointing in the installed transformers:
    ``activation_checkpointing`` where it exists (transformers 5), else ``gradient_checkpointing``."""
    transformers = sys.modules.get("transformers")
    args = getattr(transformers, "TrainingArguments", None) if transformers is not None else None
    fields = getattr(args, "__dataclass_fields__", {}) if args is not None else {}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


# transformers 5.x renamed the switch; both names stay guarded while either exists
_HF_ENABLE_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def _guard_hf_checkpointing(model: nn.Module) -> None:
    for module in model.modules():
        for name in _HF_ENABLE_METHODS:
            if callable(getattr(type(module), name, None)):
                patches.install(module, name, _refuse_enable, tag="hf-guard")


def _refuse_enable(patch, *args, **kwargs):
    raise ValueError(
        "remat is applied to this model, so Hugging Face gradient (activation) checkpointing must stay off: "
        f"it would checkpoint every block a second time. Set {hf_argument_name()}=False in TrainingArguments "
        f"(or don't call {patch.attribute}), or call remat.remove(model) first if you want Hugging Face's "
        "checkpointing instead.")
