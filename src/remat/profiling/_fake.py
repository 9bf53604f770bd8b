"""Fake-tensor runs: parameters swapped for fake tensors, SDPA run as the CUDA kernels would.

How: :func:`_swap_to_fake` replaces every parameter and buffer by a ``FakeTensor`` of the same shape,
stride and dtype (tied weights stay tied) and returns the undo, so a model on the ``meta`` device, or
one too large for the host, profiles with no memory and no weights. :func:`_cuda_attention` stands in
for ``F.scaled_dot_product_attention`` with the CUDA flash or memory-efficient ops, whose shape
functions run on fake CPU tensors, so a CPU-only profile sees what the GPU kernels save (output,
log-sum-exp, the inputs). :func:`_kernel_stand_in` covers two ops of transformers' MoE experts that
fake tensors cannot run as the model does: ``aten._grouped_mm`` takes the dtypes its CPU kernel takes
(its meta function refuses anything but bf16), and ``aten.bincount`` with a ``minlength`` is shaped
``minlength`` (its size depends on values). :class:`ValuedFakeMode` keeps the values of the batch's
integer tensors, so the steps that read them (a vision-language model's image-token merge, M-RoPE
positions) run for real and are recorded for the plan's notes; :func:`_tensors_of_values` lets
``torch.tensor([...])`` read such values; :func:`fake_attributes_restored` takes back the fake tensors
a forward leaves on modules (Qwen2-VL's ``rope_deltas``). All of these are replaced only for the
length of a fake run, and put back.

Why not the ``meta`` device: meta tensors share no storages, so the live-bytes tracker could not tell
a view from a new tensor; fake tensors keep storages.

Limits: values derived from weights or activations are never known (a forward that reads one raises,
as MoE routing on transformers 4.x does); only SDPA, the grouped matmul and ``bincount`` are
redirected (a ``bincount`` past ``minlength`` would be shaped too small); a model calling its own
attention kernels is measured with what those do on the CPU. The flash stand-in takes head sizes up
to 256 without a mask, the efficient one equal query and key heads; anything else falls back to the
CPU op. Hugging Face's packed-sequence check is told "not packed" unless the batch has ``position_ids``.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map

from remat import caches
from remat.profiling._fake_memo import KernelMemo, plain_view
from remat.profiling._meters import METADATA_QUERIES, tensors_of


@contextlib.contextmanager
def _cuda_attention(packed: bool, padded: bool = False):
    """Run SDPA as the CUDA kernels would, on fake CPU tensors.

    The CPU kernels differ in what they save (CPU flash expands grouped K/V heads; the
    math fallback materialises the attention matrix); the CUDA flash and memory-efficient
    ops have shape functions that run on fake tensors of any device, so a CPU-only
    profile sees the GPU's saved tensors: output, log-sum-exp and the inputs.
    Hugging Face cannot read fake position ids to see that a batch is not packed, and
    would build a [batch, 1, seq, seq] mask that the real run skips: unless the batch
    passes ``position_ids``, it is told there is no packing. Transformers 4.x asks whether
    the attention mask is all ones: :func:`_mask_checks` answers as the real mask would
    (``padded``: whether the batch's mask, read before it became fake, has a zero).
    """
    original = F.scaled_dot_product_attention
    masking = sys.modules.get("transformers.masking_utils")
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if find_packed is not None and not packed:
        masking.find_packed_sequence_indices = lambda *args, **kwargs: None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        aten = torch.ops.aten
        if attn_mask is None and query.shape[-1] <= 256 and query.shape[-1] == value.shape[-1]:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                             False, scale=scale)[0]
        if key.shape[-3] == query.shape[-3]:
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(~bias, float("-inf"))
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                 is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        with _mask_checks(padded):
            yield
    finally:
        F.scaled_dot_product_attention = original
        if find_packed is not None:
            masking.find_packed_sequence_indices = find_packed


def padded_mask(batch) -> bool:
    """Whether the batch's ``attention_mask`` masks a token; read before the batch turns fake
    (a mask on the ``meta`` device, or none, counts as all ones)."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if not isinstance(mask, torch.Tensor) or mask.device.type == "meta" or mask.dim() != 2:
        return False
    return not bool((mask != 0).all())


@contextlib.contextmanager
def _mask_checks(padded: bool):
    """Transformers 4.x's "is the 2-D attention mask all ones?" checks (``torch.all``, a value a
    fake tensor does not have), answered from ``padded`` for fake masks: the causal one
    (``AttentionMaskConverter._ignore_causal_mask_sdpa``) and the bidirectional one
    (``_prepare_4d_attention_mask_for_sdpa``, imported by name into each encoder's module, so
    replaced there too). Transformers 5 asks neither of a fake tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    utils = sys.modules.get("transformers.modeling_attn_mask_utils")
    converter = getattr(utils, "AttentionMaskConverter", None)
    ignore = converter.__dict__.get("_ignore_causal_mask_sdpa") if converter is not None else None
    prepare = getattr(utils, "_prepare_4d_attention_mask_for_sdpa", None)

    def fake_mask(mask):
        return isinstance(mask, FakeTensor) and mask.dim() == 2

    def ignore_causal_mask(attention_mask, *args, **kwargs):
        # all ones: what the real run decides with no mask; padded: the mask is kept
        if fake_mask(attention_mask):
            return False if padded else ignore.__func__(None, *args, **kwargs)
        return ignore.__func__(attention_mask, *args, **kwargs)

    def prepare_for_sdpa(mask, dtype, tgt_len=None):
        if fake_mask(mask):
            return converter._expand_mask(mask=mask, dtype=dtype, tgt_len=tgt_len) if padded else None
        return prepare(mask, dtype, tgt_len)

    holders = [] if prepare is None else [
        m for name, m in list(sys.modules.items())
        if (m is utils or name.startswith("transformers.models.")) and getattr(m, "_prepare_4d_attention_mask_for_sdpa",
                                                                                None) is prepare]
    if ignore is not None:
        converter._ignore_causal_mask_sdpa = staticmethod(ignore_causal_mask)
    for module in holders:
        module._prepare_4d_attention_mask_for_sdpa = prepare_for_sdpa
    try:
        yield
    finally:
        if ignore is not None:
            converter._ignore_causal_mask_sdpa = ignore
        for module in holders:
            module._prepare_4d_attention_mask_for_sdpa = prepare


def _swap_to_fake(model: nn.Module, fake_mode):
    """Replace parameters and buffers by fake CPU tensors; returns the undo function."""
    saved = []
    memo = {}
    with fake_mode:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    key = id(value)
                    if key not in memo:  # tied weights stay tied
                        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
                        if kind == "_parameters":
                            fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                        memo[key] = fake
                    saved.append((table, name, value))
                    table[name] = memo[key]

    def undo():
        for table, name, value in saved:
            table[name] = value
    return undo


# torch < 2.8 has no grouped matmul (nor a model that calls it): nothing to redirect there
_GROUPED_MM = torch.ops.aten._grouped_mm.default if hasattr(torch.ops.aten, "_grouped_mm") else None


_BINCOUNT = torch.ops.aten.bincount.default


def _kernel_stand_in(func, args, kwargs):
    """The fake result of an op whose meta function refuses what the model really runs, or None where
    ``func`` is not one (run it as it is). Called by :class:`ValuedFakeMode` with itself active, under the
    byte tracker, so the tracker sees only the op and its result, not the casts made here.

    ``aten._grouped_mm``'s meta function mirrors the CUDA kernel's dtype check (bf16 only),
    while the CPU kernel (what an fp32 MoE on the CPU runs) takes fp32 and fp16 too. Here a
    grouped matmul of another dtype is shaped by the bf16 meta function and handed back in its
    own dtype: same shape, same strides, new storage, as the real kernel returns.
    ``aten.bincount(ids, minlength=n)`` (no weights) counts tokens per expert (transformers 5.x's experts
    before ``histc``): its length is ``max(n, max(ids) + 1)``, a value fake tensors do not have,
    and expert ids are below ``n``, so it is handed back as ``n`` counts.
    """
    if func is _GROUPED_MM:
        bound = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args), **kwargs)
        a, b = bound["self"], bound["mat2"]
        if a.dtype != torch.bfloat16 and a.dtype == b.dtype and a.is_floating_point():
            out_dtype = bound.pop("out_dtype", None) or a.dtype
            bias = bound.get("bias")
            shaped = func(a.to(torch.bfloat16), b.to(torch.bfloat16), bound.get("offs"),
                          None if bias is None else bias.to(torch.bfloat16))
            return torch.empty_strided(shaped.shape, shaped.stride(), dtype=out_dtype, device=shaped.device)
    if func is _BINCOUNT:
        bound = dict(zip(("self", "weights", "minlength"), args), **kwargs)
        if bound.get("minlength", 0) > 0 and bound.get("weights") is None:
            return torch.zeros(bound["minlength"], dtype=torch.int64, device=bound["self"].device)
    return None


VALUE_LIMIT = 2**22
"""Elements (of its storage) up to which a tensor keeps its values in a fake run
(:class:`ValuedFakeMode`): the token ids, masks and image grids of any training batch (4M tokens)
and what the model derives from them alone, but never a quadratic mask of a long sequence."""

# integer factories whose values the model's bookkeeping reads (``arange`` positions, ``zeros`` to
# fill); ``empty`` is left out: its values are undefined, as on a GPU
_FACTORIES = {torch.ops.aten.arange, torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.full,
              torch.ops.aten.scalar_tensor}
_READS_VALUES = object()  # a fake kernel that could not run without its inputs' values
_RANDOM_LIMIT = 16  # random numbers drawn from no input up to which a fake run takes them as 1.0


def _small(t: torch.Tensor) -> bool:
    """A small tensor on the CPU: one that may keep its values (see :data:`VALUE_LIMIT`)."""
    return (not t.is_complex() and t.device.type == "cpu"
            and t.untyped_storage().nbytes() <= VALUE_LIMIT * t.element_size())


class ValuedFakeMode(FakeTensorMode):
    """Fake tensors, except that the batch's integer data keeps its values: the steps of a
    forward that read them (the image-token merge, M-RoPE positions, a vision tower's image
    lengths) run for real, on small tensors; everything else stays fake.

    How: a ``FakeTensor`` can carry a real ``constant``, and ``FakeTensorMode`` runs an op for
    real when every fake input has one (torch uses this for ``torch.tensor(3)``), handing back a
    constant when the output is small enough. Values enter with the batch's integer tensors
    (:meth:`valued`: ids, masks, image grids; never pixels) and integer factories (``arange``,
    ``zeros``), and flow through every op whose inputs all have values while its outputs stay
    within :data:`VALUE_LIMIT` elements (torch: one element): the fake kernel runs first, values
    hidden, and only a small result is computed for real (a ``seq x seq`` mask of a long
    sequence stays fake). Weights and activations never have values, so no model math runs for
    real: only the bookkeeping derived from the batch's ids. Every op whose fake kernel cannot run
    without values (``.item()``, ``nonzero``, boolean indexing, ``repeat_interleave`` by counts) is
    recorded in :attr:`reads`, by the model's module and method that asked (:meth:`watch`), for
    the profile's notes.

    Why not ``FakeTensorMode(shape_env=...)`` with unbacked symbolic sizes: the sizes that follow
    (image tokens, positions per image) would stay symbols, which the byte tracker cannot add
    up; and the step cannot be skipped, the blocks' inputs (M-RoPE positions) are made by it.
    A random number drawn from no input (LayerDrop's ``torch.rand([])``) is 1.0: every layer runs.

    Limits: values derived from floating-point tensors (MoE routing on transformers 4.x) are
    unknown: such a forward raises. A value written into a tensor by an op without values is
    forgotten (torch invalidates the constant).
    """

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self._memo = KernelMemo(self)
        self.reads = {}          # "module (Class.method)" -> number of value reads there
        self._names = {}         # id(module) -> qualified name, of the model watched

    def watch(self, model: nn.Module) -> None:
        """Attribute value reads to ``model``'s modules (by qualified name)."""
        self._names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}

    def valued(self, tensor: torch.Tensor):
        """A fake copy of ``tensor`` that keeps its values (integer data of the batch), or None
        where it cannot (floating point, on ``meta``, larger than :data:`VALUE_LIMIT`)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.is_floating_point() \
                or tensor.is_complex() or tensor.numel() > VALUE_LIMIT:
            return None
        with unset_fake_temporarily():
            real = tensor.detach().to("cpu", copy=True)  # a copy: a model's in-place op must not write the batch
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return super().may_turn_const(t) or (not self.is_our_fake(t) and _small(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA_QUERIES:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is _GROUPED_MM or func is _BINCOUNT:
            with self:   # this mode again, for the stand-in's own ops (dispatch runs with it popped)
                out = _kernel_stand_in(func, args, kwargs)
            if out is not None:
                return out
        tensors = tensors_of((args, kwargs))
        has_values = [isinstance(a, FakeTensor) and a.constant is not None for a in tensors]
        makes_new, seeded, view = _kind(func)
        if any(has_values) and makes_new and not seeded:
            return self._with_values(func, types, args, kwargs, tensors, all(has_values))
        if not tensors and seeded:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel() <= _RANDOM_LIMIT:
                return self._drawn_high(out)
            return out
        if tensors and makes_new and not any(has_values):
            key = self._memo.key(func, args, kwargs)
            if key is not None:
                out = self._memo.replay(key)
                return out if out is not None else self._memo.dispatched(
                    key, partial(super().__torch_dispatch__, func, types, args, kwargs), tensors)
        if view and tensors and args and isinstance(args[0], FakeTensor) and not any(has_values):
            key = self._memo.key(func, args, kwargs)
            if key is not None:
                out = self._memo.replay_view(key, args[0])
                return out if out is not None else self._memo.dispatched_view(
                    key, partial(super().__torch_dispatch__, func, types, args, kwargs), args[0])
        # views keep their base's values, in-place ops write them or forget them: torch's own rules
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if (not tensors and func.overloadpacket in _FACTORIES and isinstance(out, torch.Tensor)
                and not out.is_floating_point() and _small(out)):
            with no_dispatch():
                real = func(*args, **kwargs)
            return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)
        return out

    def _with_values(self, func, types, args, kwargs, tensors, every):
        """An op that makes new tensors from inputs of which some have values (``every``: all).

        Its fake kernel runs first, values hidden: the product of two small masks can be large.
        A kernel that needs the values (``.item()``, ``nonzero``, a boolean index) is a read: it
        runs as torch runs it with values (for real where every input has them) and is recorded.
        Otherwise, where every input has values and every output is small, the op runs for real
        and its outputs keep their values; else the fake outputs stand."""
        held = [(t, t.constant) for t in tensors if isinstance(t, FakeTensor) and t.constant is not None]
        for t, _ in held:
            t.constant = None
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = _READS_VALUES
        finally:
            for t, constant in held:
                t.constant = constant
        if out is _READS_VALUES:
            self._read()
            return super().__torch_dispatch__(func, types, args, kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not every or not outputs or not all(not t.is_complex() and t.numel() <= VALUE_LIMIT for t in outputs):
            return out
        real_args, real_kwargs = tree_map(lambda a: a.constant if isinstance(a, FakeTensor) else a, (args, kwargs))
        with no_dispatch():
            real = func(*real_args, **real_kwargs)
        return tree_map(lambda t: self.fake_tensor_converter.from_real_tensor(self, t, make_constant=True)
                        if isinstance(t, torch.Tensor) else t, real)

    def _drawn_high(self, out: torch.Tensor) -> torch.Tensor:
        """A few random numbers drawn from nothing (LayerDrop's ``torch.rand([])`` per layer) are
        taken as 1.0, the top of ``rand``'s range: every layer runs, the step that costs the most
        memory, and the profile goes on instead of stopping at the comparison. Recorded as a read."""
        where = f"{self._caller()}: random draws taken as 1.0 (layer drop: every layer runs)"
        self.reads[where] = self.reads.get(where, 0) + 1
        with unset_fake_temporarily():
            real = torch.ones(out.shape, dtype=out.dtype)
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)

    def _read(self) -> None:
        where = self._caller()
        self.reads[where] = self.reads.get(where, 0) + 1

    def _caller(self) -> str:
        """The innermost method of a watched module on the stack: ``name (Class.method)``, block
        indices as ``*`` (every block reads the same way)."""
        frame = sys._getframe(2)  # past this method and _read: a frame reading its own locals is a cycle
        try:
            while frame is not None:
                name = self._names.get(id(frame.f_locals.get("self")))
                if name is not None:
                    name = ".".join("*" if part.isdigit() else part for part in name.split(".")) or "the model"
                    return f"{name} ({getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)})"
                frame = frame.f_back
            return "outside the model's modules"
        finally:
            del frame  # a frame held past its return keeps the model's tensors alive


@contextlib.contextmanager
def _tensors_of_values(mode: Optional["ValuedFakeMode"] = None):
    """``torch.tensor`` of a list that holds tensors with values (Qwen2-VL's
    ``torch.tensor([positions.max() + 1 - length, ...])``) reads their values as numbers first:
    ``torch.tensor`` copies its elements' memory directly, which a fake tensor does not have.
    With ``mode``, a ``tolist()`` of one of its tensors with values reads them at once (one read
    recorded, where the model asked) instead of element by element: ``FakeTensor.tolist`` calls
    ``.item()`` per element, each a value read through every dispatch mode (Qwen2-VL's M-RoPE
    positions: 12,000 of them a step), and each its own ``.item()`` of the same value."""
    original = torch.tensor
    original_tolist = FakeTensor.tolist

    def tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            data = tree_map(lambda v: v.tolist() if isinstance(v, FakeTensor) and v.constant is not None else v, data)
        return original(data, *args, **kwargs)

    def tolist(self):
        if mode is not None and self.fake_mode is mode and self.constant is not None:
            mode._read()
            with no_dispatch():
                return self.constant.tolist()
        return original_tolist(self)

    torch.tensor = tensor
    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        torch.tensor = original
        FakeTensor.tolist = original_tolist


@contextlib.contextmanager
def _conversions_in_place():
    """``module.to(dtype)`` that changes nothing (Switch Transformers' router casts its classifier to
    the dtype it already has, every forward) leaves a fake-parameter module as it is: torch swaps a
    fake parameter with its converted self (``swap_tensors``), which fails while the profile holds
    references to it ("Couldn't swap Linear.weight")."""
    original = nn.Module._apply

    def _apply(module, fn, recurse=True):
        with torch.no_grad():
            same = all(fn(t) is t for t in itertools.chain(module.parameters(recurse), module.buffers(recurse)))
        return module if same else original(module, fn, recurse)
    nn.Module._apply = _apply
    try:
        yield
    finally:
        nn.Module._apply = original


def _makes_new(func) -> bool:
    """Whether ``func`` returns new tensors (no view of, nor write to, its inputs)."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


_KINDS = caches.register({}, "profiling._fake._KINDS")


def _kind(func) -> tuple:
    """``(makes new tensors, draws random numbers, a plain view)`` of an op (:func:`_makes_new`, its
    ``nondeterministic_seeded`` tag, :func:`~remat.profiling._fake_memo.plain_view`), read once per op:
    :class:`ValuedFakeMode` asks on every op."""
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = (_makes_new(func), torch.Tag.nondeterministic_seeded in func.tags, plain_view(func))
    return kind


def fake_attributes_restored(model: nn.Module):
    """Undo for the plain attributes a fake forward leaves on ``model``'s modules: a fake tensor
    that a forward stored (Qwen2-VL keeps its M-RoPE ``rope_deltas``) is put back to what was there
    before (or removed). Parameters and buffers are :func:`_swap_to_fake`'s."""
    before = {id(m): (m, dict(m.__dict__)) for m in model.modules()}

    def undo():
        for module, attributes in before.values():
            for key, value in list(module.__dict__.items()):
                if isinstance(value, FakeTensor):
                    if key in attributes:
                        module.__dict__[key] = attributes[key]
                    else:
                        del module.__dict__[key]
    return undo
