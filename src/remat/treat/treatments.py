"""Per-block treatments: what a block keeps for backward and what it redoes.

How: a treated block keeps its class, its children and its parameters; only its ``forward`` is
replaced, through :mod:`remat.treat.patches`, by an instance attribute that runs the original
forward under the treatment. Because the module tree does not change, ``state_dict`` keys stay the
same, FSDP2's ``fully_shard`` and ``Module.compile()`` applied afterwards see the block they
expect, ``remove`` restores exactly what was there, and a treated model pickles and deep-copies.
The alternative, ``checkpoint_wrapper``, inserts a ``_checkpoint_wrapped_module`` level into every
parameter name; that is what breaks state-dict loading in many stacks.

What this module reads is a record's decisions (:class:`remat.planning.records.BlockRecord`:
``checkpoint``, ``submodule``, ``keeps``, ``offload``, ``tiled``, ``segment``), which
:func:`_treated_forward` composes, never the treatment's name:

- ``checkpoint``: non-reentrant ``torch.utils.checkpoint`` of the block (or of its ``submodule``,
  attention or MLP), RNG state preserved; ``keeps`` names an op-level policy for it
  (:mod:`remat.treat.selective`: ``selective``, ``attn-saved``);
- ``offload``: what is saved (under a checkpoint: its inputs) goes to pinned host memory
  (:mod:`remat.offload`); ``tiled``: the token-wise sub-modules run in chunks (:mod:`remat.treat.tiled`);
- ``segment``: a run of blocks checkpointed as one unit (:mod:`remat.treat.segments`).

Around each treated call: the block is handed what the untouched block sees
(:mod:`remat.treat.block_state`: KV caches as views, state written in place after the call), and a
recompute updates buffers once (:mod:`remat.treat.buffers_once`). Non-reentrant checkpointing gives
parameter gradients even when no input requires grad (LoRA over frozen embeddings), so
``enable_input_require_grads`` is not needed. Each treatment's meaning in full:
``docs/design/treatments.md``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from remat.treat import block_state, patches, segments, tiled
from remat.treat.buffers_once import buffers_once, state_slots
from remat.treat.cache_layout import has_cache, own_cache
from remat.treat.discovery import find_submodules
from remat.treat.hub_kernels import unwrap_hub_kernels
from remat.treat.selective import saves, saves_attention, selective_context

_TAG = "treatment"
_HUB_TAG = "treatment-hub-kernels"  # a treated block's modules' own forwards (remat.treat.hub_kernels)
_MARK = "_remat"  # on a treated block: its TreatmentState (what treatment_of reads)

@dataclass
class TreatmentState:
    """What a treated block (or the sub-module a treatment checkpoints) runs with: its record's
    decisions, as this target takes them, and what it learns over its calls."""

    treatment: str            # the plan's name for it (what treatment_of reports)
    checkpoint: bool = False  # its forward runs under a checkpoint (a BlockRecord's decisions, as for this target)
    keeps: Any = None         # ... with this op-level policy (selective.saves, saves_attention), or None
    offload: bool = False     # its saved tensors (a checkpoint's: its inputs) go to the engine
    tiled: bool = False       # its tiled sub-modules' recompute skips outputs nothing reads
    engine: Any = None        # the OffloadEngine of offloading treatments
    key: int = 0              # the block's index: the engine's record key
    buffers: tuple = ()       # the target's state slots (:func:`~remat.treat.buffers_once.state_slots`): those a forward writes, a recompute must not
    written: Optional[tuple] = None  # ... learned at the first forward: the buffers it wrote
    segment: Any = None       # segment treatments: the Segment shared by the run's blocks
    position: int = 0         # ... and this block's place in it
    guarded: set = field(default_factory=set)  # an op-level policy: call structures its in-place guard has passed
    writes_cache: bool = False  # write a KV cache back into the caller's in training (block_state.cache_reader)
    inputs: block_state.InputLedger = field(default_factory=block_state.InputLedger)  # learned of its arguments


_POLICIES = {"matmuls": saves, "attention": saves_attention}
"""A record's ``keeps``: the op-level policy (:mod:`remat.treat.selective`) of its checkpoint."""


def treatment_of(block: nn.Module) -> str:
    state = block.__dict__.get(_MARK)
    return state.treatment if state is not None else "keep"


def _changes_forward(record) -> bool:
    """Whether ``record`` runs something around the block's (or its sub-modules') forward: a tiling alone does not."""
    return record.checkpoint or record.offload


def check_treatment(block: nn.Module, record) -> None:
    """Raise the error :func:`apply_treatment` would raise, without changing ``block``. ``record``: a
    :class:`remat.planning.records.BlockRecord` (``remat.apply`` and the profiler resolve the plan's
    names into records; this module reads their fields, never the names)."""
    treatment, kind = record.treatment, record.submodule
    if _changes_forward(record) and callable(getattr(block, "backward_pass", None)):
        raise ValueError(f"{type(block).__name__} is a reversible layer: its model recomputes its activations in "
                         "backward itself (Reformer's reversible residual stream) and runs it without autograd, so "
                         f"{treatment!r} would do nothing; train it as it is, remat has no memory to give back here")
    if record.keeps is not None and record.keeps not in _POLICIES:
        raise ValueError(f"treatment {treatment!r} keeps {record.keeps!r}: no such op-level policy; expected one "
                         f"of {', '.join(_POLICIES)}")
    if record.tiled:
        tiled.check_tiling(block)
    if kind is not None and not find_submodules(block, kind):
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in block.named_children())
        raise ValueError(f"treatment {treatment!r}: no {kind} sub-module found in "
                         f"{type(block).__name__} (children: {children}); use 'full' or "
                         "'selective' for this block (where a model's blocks differ, as in hybrid "
                         "state-space models, give a treatment per block, {name: treatment}, or let "
                         "remat.plan choose)")


def apply_treatment(block: nn.Module, record, *, engine=None, segment=None, writes_cache: bool = False) -> None:
    """Treat ``block`` in place as ``record`` says; a block that already has a treatment gets the new one.

    ``record``: the block's :class:`remat.planning.records.BlockRecord` (its index is the offload
    engine's key for it, its ``tile_tokens`` the tiling's chunk). ``segment``: for a record in a
    segment, the :class:`~remat.treat.segments.Segment` its blocks share
    (:func:`remat.treat.segments.segments_of`). Every change goes through
    :mod:`remat.treat.patches`: the block's (or its attention/MLP sub-modules') ``forward``, and a
    ``_remat`` marker on the block holding the state. ``writes_cache``: the block writes what it adds
    to a KV cache back into the model's cache in a training forward too (a model that reads its cache
    there, :func:`remat.treat.block_state.cache_reader`); else it keeps it in a copy of its own.

    Raises ValueError: what :func:`check_treatment` raises; an offloading record without ``engine``, a
    segment's without ``segment``, a ``tile_tokens`` that is no positive integer."""
    check_treatment(block, record)
    treatment, key = record.treatment, record.index
    if record.offload and engine is None:
        raise ValueError(f"treatment {treatment!r} needs an offload engine; use remat.apply()")
    if record.segment is not None and segment is None:
        raise ValueError(f"treatment {treatment!r} needs the segment its blocks share; use remat.apply()")
    tiled.check_tile_tokens(record.tile_tokens)
    remove_treatment(block)
    marker = TreatmentState(treatment, engine=engine, key=key)
    if record.tiled:
        tiled.install_tiling(block, record.tile_tokens)
    if not _changes_forward(record):  # keep, or a tiling alone: the rest of the block keeps what it saves
        if record.tiled:
            patches.install_value(block, _MARK, marker, tag=_TAG)
        return
    if record.checkpoint:  # before the treatment's own patches: theirs run over these
        unwrap_hub_kernels(block, tag=_HUB_TAG)
    decisions = dict(checkpoint=record.checkpoint, keeps=_POLICIES.get(record.keeps), offload=record.offload,
                     tiled=record.tiled, engine=engine, key=key)
    placed = dict(segment=segment, position=record.position) if record.segment is not None else {}
    targets = [block]
    if record.submodule is not None:
        # a sub-module shared by several blocks (Zamba2's one attention layer in every hybrid
        # layer) is checkpointed once, by the first block that treats it, not nested once per block
        targets = [sub for _, sub in find_submodules(block, record.submodule)
                   if patches.patch_of(sub, "forward", tag=_TAG) is None]
        decisions["tiled"] = False  # the tiling is the block's
    for target in targets:
        # a sub-module's forward as a bound method: blocks compiled each alone share one guard
        patches.install(target, "forward", _treated_forward, tag=_TAG, bound=target is not block,
                        state=TreatmentState(treatment, **decisions, **placed, buffers=state_slots(target),
                                             writes_cache=writes_cache))
    patches.install_value(block, _MARK, marker, tag=_TAG)


def remove_treatment(block: nn.Module) -> None:
    """Undo :func:`apply_treatment`; a no-op on an untreated block."""
    patches.remove(block, tag=_TAG)
    patches.remove(block, tag=_HUB_TAG)   # under the treatment's own: undone after them
    tiled.remove_tiling(block)


def engine_of(model: nn.Module):
    """The offload engine :func:`remat.apply` attached to ``model``'s blocks, or None."""
    for patch in patches.patches(model, tag=_TAG):
        if patch.state is not None and getattr(patch.state, "engine", None) is not None:
            return patch.state.engine
    return None


def _treated_forward(patch: patches.Patch, *args, **kwargs):
    state: TreatmentState = patch.state
    self = patch.module
    if not torch.is_grad_enabled():
        return patch.call_previous(*args, **kwargs)
    if self.training and getattr(self, "gradient_checkpointing", False) is True:
        raise ValueError(
            f"{type(self).__name__} has Hugging Face gradient checkpointing switched on while remat "
            f"treats it ({state.treatment!r}): the block would be checkpointed twice. Call "
            "model.activation_checkpointing_disable() (transformers 4: gradient_checkpointing_disable(); "
            "Trainer: activation_checkpointing=False, or gradient_checkpointing=False in 4) and let remat do it.")
    # an instance forward under remat's (accelerate's device_map hooks) moves the inputs to the
    # block's device itself, after this point: only a bare block can tell a replica by its inputs
    if patch.previous is patches._MISSING:
        _refuse_replica(self, args, kwargs)
    forward = patch.call_previous
    compiling = torch.compiler.is_compiling()
    if compiling:
        if state.writes_cache and has_cache(args, kwargs):  # its cache views run eagerly
            return torch.compiler.disable(_treated_forward, recursive=True)(patch, *args, **kwargs)
        if self.training:
            forward, args, kwargs = own_cache(forward, args, kwargs)
    else:
        forward, args, kwargs = block_state.guarded(forward, args, kwargs, state.inputs, name=type(self).__name__,
                                                    write_back=state.writes_cache or not self.training)
    if state.segment is not None:  # the arguments as given: a segment keeps only its first block's
        if state.segment.size > 1 and _sharded_alone(self):
            raise ValueError(
                f"{type(self).__name__} is one FSDP2 unit of its own, but it is in a segment of "
                f"{state.segment.size} blocks: the segment's backward recomputes its earlier blocks after "
                "FSDP2 has resharded their parameters. Use 'full' (the same recompute, one block at a "
                "time), or call fully_shard on groups of the segment's blocks instead of on each block.")
        if state.buffers:   # compiled too: segments.call runs the segment (and its recompute) eagerly
            forward = buffers_once(forward, state)
        return segments.call(state.segment, state.position, forward, args, kwargs)
    # an op-level policy's in-place guard, eager only (under compile torch wants its own modes alone,
    # and reading the set of structures seen would make dynamo guard on it)
    structure = _call_structure(args, kwargs) if state.keeps is not None and not compiling else None
    function, args = _positional(forward, args, kwargs)
    if state.buffers and not compiling:
        function = buffers_once(function, state)
    if state.tiled and not compiling:
        function = tiled.CheckpointedCall(function)  # its recompute skips tiled outputs nothing reads
    # the tiled sub-modules carry their own patches; an offload sends what is saved here to the host
    # (under a checkpoint its inputs: the outputs an op-level policy keeps stay on the GPU)
    with state.engine.saved_tensors(state.key) if state.offload else contextlib.nullcontext():
        if not state.checkpoint:
            return function(*args)
        if state.keeps is None:
            return _checkpoint(function, args)
        # the in-place guard watches a block's first forward of each call structure: its per-op
        # dispatch adds to selective's forward host time on every call, and what it catches is in the code
        guard = structure is not None and structure not in state.guarded
        context = functools.partial(selective_context, guard=guard, keeps=state.keeps)
        out = _checkpoint(function, args, context_fn=context)
        if guard:
            state.guarded.add(structure)
        return out


def _call_structure(args: tuple, kwargs: dict) -> tuple:
    """What decides a block's code path, not its data: how many arguments, which keywords, which
    of them are None (a mask or a cache given or not)."""
    return len(args), tuple(sorted((key, value is None) for key, value in kwargs.items()))


def _checkpoint(function, args, **options):
    """Non-reentrant ``checkpoint`` of ``function(*args)`` that leaves nothing entered if the
    forward raises.

    Torch < 2.7 does not resume its checkpoint's generator when the forward raises, so what the
    generator entered (the checkpoint's saved-tensor hooks, ``context_fn``'s forward modes)
    stayed entered while the traceback lived: later ops of the thread ran under them (the next
    backward failed with "Trying to backward an extra time", the selective guard refused
    unrelated tensors). Here the generator, found in the traceback's ``checkpoint`` frame, is
    closed, which exits its ``with`` blocks; torch >= 2.7 has closed it already (a no-op then)."""
    try:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **options)
    except BaseException as error:
        _close_checkpoints(error.__traceback__)
        raise


_CHECKPOINT_CODE = getattr(checkpoint, "__wrapped__", checkpoint).__code__


def _close_checkpoints(tb) -> None:
    """Close the checkpoint generators of ``tb``'s ``checkpoint`` frames, innermost first."""
    generators = []
    while tb is not None:
        if tb.tb_frame.f_code is _CHECKPOINT_CODE:
            generators.append(tb.tb_frame.f_locals.get("gen"))
        tb = tb.tb_next
    for generator in reversed(generators):
        if generator is not None:
            generator.close()


def _refuse_replica(module: nn.Module, args, kwargs) -> None:
    """``nn.DataParallel`` copies ``__dict__`` into its replicas, so a replica would run this
    patch on the original module (device 0): refuse, with the fix, instead of a device error."""
    first = next((v for v in itertools.chain(args, kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if first is None or first.device.type != "cuda":
        return
    param = next(module.parameters(), None)
    if param is not None and param.device.type == "cuda" and param.device != first.device:
        raise ValueError(
            f"{type(module).__name__} (treated by remat) got inputs on {first.device} but its parameters are "
            f"on {param.device}: torch.nn.DataParallel replicas are not supported by remat's treatments. "
            "Use DistributedDataParallel or FSDP2 (apply remat before wrapping), or one GPU.")


def _sharded_alone(module: nn.Module) -> bool:
    """``module`` is an FSDP2 unit (``fully_shard`` was called on it; then FSDP2 is imported)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))


def _positional(forward, args: tuple, kwargs: dict):
    """``(function, inputs)`` such that ``function(*inputs)`` is ``forward(*args, **kwargs)``,
    every tensor keyword is one of ``inputs`` and each distinct tensor is there once.

    ``checkpoint`` saves and restores the RNG state only of the devices of its *positional*
    tensors; a sub-module called with keywords only (Hugging Face attention:
    ``self_attn(hidden_states=...)``) would otherwise recompute its dropout on the GPU with
    a different mask. As positional inputs, they are also the checkpoint's saved inputs, so
    ``full+offload`` moves them. A tensor passed twice (``mha(x, x, x)``) is one input:
    under saved-tensor hooks each saved input comes back as its own alias, and a recompute
    that sees ``query is not key`` takes another path than the forward did. Non-tensor
    arguments ride along in a closure.
    """
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    given = list(args) + [kwargs[k] for k in tensor_keys]
    inputs, slot = [], []
    for value in given:
        if not isinstance(value, torch.Tensor):
            slot.append(None)
            continue
        index = next((i for i, seen in enumerate(inputs) if seen is value), None)
        if index is None:
            index = len(inputs)
            inputs.append(value)
        slot.append(index)
    if not tensor_keys and len(inputs) == sum(s is not None for s in slot) and all(
            isinstance(a, torch.Tensor) for a in args):
        return (functools.partial(forward, **kwargs) if kwargs else forward), args
    rest = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    count = len(args)
    # the closure lives until the recompute: it must hold no tensor, or ``full+offload`` moves
    # the block's input to the host while this reference keeps the GPU copy alive
    constants = [None if s is not None else value for value, s in zip(given, slot)]
    del given

    def function(*flat):
        values = [constants[i] if s is None else flat[s] for i, s in enumerate(slot)]
        return forward(*values[:count], **rest, **dict(zip(tensor_keys, values[count:])))
    return function, tuple(inputs)
