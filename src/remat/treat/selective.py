"""The op-level policies of ``selective`` and ``attn-saved``: which ops' outputs a block keeps, and
the guard that refuses a block a policy would give wrong gradients.

``selective`` keeps every matmul and attention kernel (:func:`saves`), so no matmul runs twice;
``attn-saved`` keeps the attention kernels alone (:func:`saves_attention`): at long context
attention is the one term of a block quadratic in the sequence, while its output is one hidden
state's bytes, so keeping it makes a recompute cost the block's linear part for little more
memory than ``full``.

How: :func:`selective_context` is the ``context_fn`` of the block's non-reentrant checkpoint
(:mod:`remat.treat.treatments`): torch's selective-checkpoint modes save the outputs of the named
ops and recompute everything else. A write in place into a kept output before anything reads it
(an unfused bias after a grouped matmul) is kept as well (:class:`_Policy`). In eager mode a
block's first forward of each call structure also runs under :class:`_KeptOutputGuard`, which
raises where an op writes into a kept output otherwise (through a view, or after a read): torch's
own check misses writes through an ``_unsafe_view``, and the recompute would apply them twice.

Which ops: every op that contracts a dimension as it reaches the dispatcher (``mm``, ``addmm``,
``bmm``, attention kernels, every functional overload; transformers' grouped MoE matmul and
torch's variable-length attention by name). They cost many FLOPs per output element, everything
else a few, so keeping exactly these gives the most memory back for the least recompute. Left out
on purpose: ``addr``, convolutions, ``flex_attention``. The set is named, not searched for:
composite ops never reach the dispatcher themselves.

Cost: every op passes through torch's selective modes in Python, several times ``keep``'s host
time; where the host sets the pace ``selective`` is slower than ``full`` and ``mlp`` faster than
both. Measurements (``benchmarks/results/issue12``, ``issue29``) and the full reasoning:
``docs/design/treatments.md``.
"""
from __future__ import annotations

import collections
import functools
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor  # already loaded by torch itself
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat import caches
from remat.treat.refusals import StepRefusal

_MUST_SAVE, _PREFER_RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


# aten ops that contract a dimension (the module docstring says why exactly these)
_MATMULS = ("mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
            "_trilinear", "_grouped_mm", "_foreach_mm", "mkldnn_linear")
_LOW_PRECISION = ("_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "_scaled_grouped_mm_v2", "_int_mm",
                  "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm_with_scales_and_zeros",
                  "_weight_int8pack_mm", "_dyn_quant_matmul_4bit", "_mixed_dtypes_linear", "_cslt_sparse_mm",
                  "_sparse_semi_structured_mm", "_sparse_semi_structured_addmm", "_sparse_semi_structured_linear")
_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps",
              "_flash_attention_forward", "_efficient_attention_forward", "_cudnn_attention_forward")
# other libraries' matmul ops, registered when the library is imported: matched by name
_LIBRARY_ATTENTION = frozenset({"torch_attn::_varlen_attn", "flash_attn::_flash_attn_forward",
                                "flash_attn::_flash_attn_varlen_forward", "flash_attn_3::_flash_attn_forward"})
_LIBRARY_OPS = frozenset({"transformers::grouped_mm_fallback"}) | _LIBRARY_ATTENTION


@caches.register
@functools.lru_cache(maxsize=1)
def saved_ops() -> frozenset:
    """The aten ops whose outputs the ``selective`` policy keeps: every functional overload of each
    matmul, low-precision or sparse matmul and attention kernel the installed torch has."""
    return _functional_overloads(_MATMULS + _LOW_PRECISION + _ATTENTION)


def _functional_overloads(names) -> frozenset:
    """Every functional overload of the aten ops ``names`` the installed torch has."""
    aten = torch.ops.aten
    packets = [getattr(aten, name) for name in names if hasattr(aten, name)]
    overloads = (getattr(packet, overload) for packet in packets for overload in packet.overloads())
    return frozenset(op for op in overloads if not op._schema.is_mutable)


# saves and saves_attention are plain functions, asked once per op (:func:`_decision` caches the
# answer): the treatment hands one to torch's checkpoint inside a ``functools.partial``, which dynamo
# must read as a constant, and an ``lru_cache`` wrapper it cannot (the checkpoint then breaks the
# graph and the block runs eager under ``model.compile()``)
def saves(func) -> bool:
    """Whether ``selective`` keeps the output of ``func`` (an op overload or a higher-order op)."""
    return func in saved_ops() or func.name() in _LIBRARY_OPS


@caches.register
@functools.lru_cache(maxsize=1)
def attention_ops() -> frozenset:
    """Every functional overload of the attention kernels the installed torch has."""
    return _functional_overloads(_ATTENTION)


def saves_attention(func) -> bool:
    """Whether ``attn-saved`` keeps the output of ``func``: attention kernels only."""
    return func in attention_ops() or func.name() in _LIBRARY_ATTENTION


def _drops_out(func, args, kwargs) -> bool:
    """An attention kernel called with dropout: its forward draws from the generator. Kept, its
    recompute would not draw, and every random op after it in the block (GPT-2's residual dropout)
    would take other masks than the forward did; so it is recomputed, from the same RNG state."""
    position = _dropout_position(func)
    if position is None:
        return False
    value = kwargs.get("dropout_p", args[position] if position < len(args) else 0.0)
    return isinstance(value, (int, float)) and value > 0


@caches.register
@functools.lru_cache(maxsize=None)
def _dropout_position(func):
    """Where ``func``'s schema takes ``dropout_p`` (None: it takes none); asked per kept op, so cached."""
    schema = getattr(func, "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    return names.index("dropout_p") if "dropout_p" in names else None


# what a policy does with an op (:func:`_decision`): recompute its output, keep it, keep it unless
# the call draws dropout (an attention kernel), or look closer, as the op writes in place
_RECOMPUTE, _KEEP, _KEEP_UNLESS_DROPOUT, _WRITES = "recompute", "keep", "keep unless dropout", "writes"
_DECISIONS = caches.register(collections.defaultdict(dict), "treat.selective._DECISIONS")  # per policy (``keeps``): {id(op): (op, decision)}


def _decision(keeps, func) -> str:
    """What the policy ``keeps`` does with ``func``, worked out the first time the policy meets the op.

    Every op of a selective forward asks this, so it is one dictionary lookup by ``id``: an op
    overload hashes through a Python ``__hash__``, and its schema is a C++ object behind Python
    properties. The entry holds the op itself, so no other object takes its id while the entry lives."""
    table = _DECISIONS[keeps]
    entry = table.get(id(func))
    if entry is None:
        entry = table[id(func)] = (func, _decide(keeps, func))
    return entry[1]


def _decide(keeps, func) -> str:
    if keeps(func):
        return _KEEP if _dropout_position(func) is None else _KEEP_UNLESS_DROPOUT
    if isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
        return _WRITES
    return _RECOMPUTE


def _keeps(keeps, func, args, kwargs) -> bool:
    decision = _decision(keeps, func)
    return decision is _KEEP or (decision is _KEEP_UNLESS_DROPOUT and not _drops_out(func, args, kwargs))


def _compiled_policy(keeps):
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if _keeps(keeps, func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class _Policy:
    """One checkpointed forward's policy in eager mode: keep what :func:`saves` names, and a
    write in place into one of those very outputs (``out = _grouped_mm(...); out.add_(bias)``:
    transformers' experts with biases, GPT-OSS). Recomputed, such a write would apply twice to
    the kept output, which already holds its result; kept as well, the recompute takes both
    results as the forward left them. That is exact only where nothing read the output before
    the write, which :class:`_KeptOutputGuard` checks. Torch refuses a kept output whose version
    changed since it was kept; once this policy keeps a write it tells the recompute mode to
    allow that.

    A write is matched to a kept output by storage, offset, shape and strides (a kept output
    lives until backward, so its storage is not reused meanwhile). Torch 2.13 calls the policy
    after the op, with its output in the context; older torch calls it before, so the output is
    read from what the caching mode stored, by the next call, and asks it again while
    recomputing, where it is answered as in the forward. Where neither way shows the output, no
    write is kept and the guard refuses the block."""

    def __init__(self, keeps):
        self.keeps = keeps  # :func:`saves` or :func:`saves_attention`
        self.decisions = _DECISIONS[keeps]  # what :func:`_decision` has worked out for it so far
        self.name = "selective" if keeps is saves else "attn-saved"  # the treatment, for messages
        # the caching mode's storage, and the recompute mode behind a weak reference: the caching
        # mode holds this policy, and a cycle would keep the storage, kept outputs included, alive
        # past the checkpoint's backward until Python's collector ran (older torch's recompute
        # mode holds the policy too)
        self.storage = None
        self.recompute = None
        self.kept = set()  # geometries of the outputs kept so far
        self.unseen = None  # a kept op whose output the policy has not seen yet (older torch)
        self.answers = collections.deque()  # the forward's answers for in-place ops, in order

    def __call__(self, ctx, func, *args, **kwargs):
        entry = self.decisions.get(id(func))  # :func:`_decision`, inlined: this runs for every op
        decision = entry[1] if entry is not None else _decision(self.keeps, func)
        if decision is _RECOMPUTE:
            return _PREFER_RECOMPUTE
        if decision is _KEEP or (decision is _KEEP_UNLESS_DROPOUT and not _drops_out(func, args, kwargs)):
            if not ctx.is_recompute:
                self._note_output(ctx, func)
            return _MUST_SAVE
        if decision is not _WRITES:  # an attention kernel that draws dropout
            return _PREFER_RECOMPUTE
        if ctx.is_recompute:  # torch < 2.13 asks again while recomputing: answer as the forward did
            keep = self.answers.popleft()
        else:
            keep = self.writes_kept(func, args)
            self.answers.append(keep)
        if keep:
            self.recompute().allow_cache_entry_mutation = True
            return _MUST_SAVE
        return _PREFER_RECOMPUTE

    def writes_kept(self, func, args) -> bool:
        """Whether ``func`` writes in place into a tensor that a kept op returned."""
        self._see_stored()
        return bool(self.kept) and any(isinstance(value, torch.Tensor) and _geometry(value) in self.kept
                                       for value in _written(func, args))

    def _note_output(self, ctx, func):
        if hasattr(ctx, "op_output"):
            output = ctx.op_output  # most kept ops return one tensor: no pytree walk for it
            self._note((output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0])
        else:
            self._see_stored()
            self.unseen = func

    def _see_stored(self):
        """Note the output of the last kept op, which torch < 2.13 ran after asking the policy,
        from the caching mode's storage (one list per op there)."""
        if self.unseen is not None:
            stored = self.storage.get(self.unseen)
            if isinstance(stored, list) and stored:
                self._note(leaf.val for leaf in tree_flatten(stored[-1])[0])
            self.unseen = None

    def _note(self, outputs):
        self.kept.update(_geometry(t) for t in outputs if isinstance(t, torch.Tensor))
        self.kept.discard(None)


def selective_context(guard: bool = True, keeps=saves):
    """Context pair for ``checkpoint(context_fn=...)``: save the outputs of the ops ``keeps`` names
    (:func:`saves`: matmuls and attention, ``selective``; :func:`saves_attention`, ``attn-saved``).

    With ``guard``, in eager mode, the forward also runs under :class:`_KeptOutputGuard`, which
    refuses a block that modifies a kept output in place where the recompute cannot give the
    forward's values back: torch's own check misses a mutation made through an ``_unsafe_view``
    (``torch.matmul`` on 4-D tensors returns one), and the recompute would then apply the
    mutation twice and silently change the gradients (transformers < 5 T5 does
    ``scores += position_bias``).
    """
    if _tracing():  # compiled, the graph is functional: no write lands in a kept output
        return create_selective_checkpoint_contexts(_compiled_policy(keeps))
    policy = _Policy(keeps)
    forward, recompute = create_selective_checkpoint_contexts(policy)
    policy.storage, policy.recompute = forward.storage, weakref.ref(recompute)
    if not guard:
        return forward, recompute
    return _Both(forward, _KeptOutputGuard(policy)), recompute


def _tracing() -> bool:
    """True under torch.compile: there torch wants SAC's own two modes, untouched (and
    torch 2.6 calls ``context_fn`` while AOT-tracing, where ``is_compiling()`` is False)."""
    from torch._guards import TracingContext
    return torch.compiler.is_compiling() or TracingContext.try_get() is not None


class _Both:
    """Enter two context managers as one (``context_fn`` must return exactly two)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        return self.outer.__exit__(*exc)


class _KeptOutputGuard(TorchDispatchMode):
    """Raise if an op writes in place into the storage of an output ``selective`` keeps, unless
    ``policy`` keeps the write too and nothing has read that output yet (then the recompute
    takes the forward's own values back: see :class:`_Policy`)."""

    def __init__(self, policy: _Policy):
        super().__init__()
        self.policy = policy
        self.kept = set()  # storages of kept outputs
        self.read = set()  # those of them some op has read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.kept:
            out = func(*args, **kwargs)
        else:
            if func._schema.is_mutable:
                for value in _written(func, args):
                    key = _storage_key(value)
                    if key in self.kept and (key in self.read or not self.policy.writes_kept(func, args)):
                        raise StepRefusal(
                            f"treatment {self.policy.name!r}: this block modifies in place ({func}) the output "
                            f"of a matmul/attention op that {self.policy.name} keeps for backward, {self._how(key)}; "
                            "recomputing it would apply the change twice and give wrong gradients. Use "
                            "'full', 'attention' or 'mlp' for this block (or a newer transformers, which "
                            "computes it out of place).")
            out = func(*args, **kwargs)
            # a read is an input that no output aliases: views and in-place writes are not reads
            inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0]} & self.kept
            self.read.update(inputs - {_storage_key(t) for t in tree_flatten(out)[0]})
        if _keeps(self.policy.keeps, func, args, kwargs):
            self.kept.update(_storage_key(t) for t in tree_flatten(out)[0])
            self.kept.discard(None)
        return out

    def _how(self, key) -> str:
        if key in self.read:
            return "after another op read it"
        if not self.policy.kept:
            return f"which {self.policy.name} cannot keep as well on this torch (its policy sees no op's output)"
        return "through a view of it"


def _written(func, args):
    """The arguments ``func`` writes into in place."""
    return [value for argument, value in zip(func._schema.arguments, args)
            if argument.alias_info is not None and argument.alias_info.is_write]


def _geometry(tensor):
    """A dense tensor's place in memory: its storage (the same for every alias of it, fake tensors
    included), offset, shape and strides; None for other layouts."""
    if tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride()
    except RuntimeError:  # a wrapper subclass without storage of its own
        return None


def _storage_key(value):
    """What identifies a tensor's storage: a real tensor's data pointer; a fake tensor's storage
    object (the planner's profiles: every alias of a fake tensor shares it, as the storage a real
    one points into, so the guard refuses on fake tensors what it refuses on real ones, and the
    planner leaves the treatment out); None for non-tensors and meta tensors."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" and not isinstance(value, FakeTensor):
        return None
    try:
        storage = value.untyped_storage()
        return ("fake", storage._cdata) if isinstance(value, FakeTensor) else storage.data_ptr()
    except RuntimeError:  # a wrapper subclass without storage of its own (a collective's pending result)
        return None
