"""Fake-tensor runs: parameters swapped for fake tensors, SDPA run as the CUDA kernels would.

How: :func:`_swap_to_fake` replaces every parameter and buffer by a ``FakeTensor`` of
the same shape, stride and dtype (tied weights stay tied) and returns the undo, so a
model on the ``meta`` device, or one too large for the host, profiles with no memory and
no weights. :func:`_cuda_attention` stands in for ``F.scaled_dot_product_attention`` for
the length of a fake run, calling the CUDA flash or memory-efficient ops, whose shape
functions run on fake CPU tensors: a CPU-only profile then sees what the GPU kernels save
(output, log-sum-exp and the inputs) rather than what the CPU kernels save. (The chunked
head skips its probe of the model's logit transform on fake tensors itself.)
:class:`_KernelStandIns` stands in for two ops of the MoE experts in transformers that fake
tensors cannot run as the model does: ``aten._grouped_mm`` (their grouped matmul) takes the
dtypes its CPU kernel takes (its fake-tensor (meta) function copies the CUDA kernel's checks and
refuses anything but bf16, so an fp32 MoE that trains on the CPU could not be profiled), and
``aten.bincount`` with a ``minlength`` (tokens per expert, in transformers 5.x before its switch to
``histc``) is shaped ``minlength`` (its size depends on the values: no fake run could go on).

Why not run on the ``meta`` device: meta tensors share no storages, so the live-bytes
tracker could not tell a view from a new tensor; fake tensors keep storages.

Limits: only SDPA, the grouped matmul and ``bincount`` are redirected (a ``bincount`` whose ids
reach past ``minlength``, which expert routing never does, would be shaped too small); a model
calling its own attention kernels is measured with whatever those do on CPU. The flash
stand-in takes head sizes up to 256 without a mask, the efficient one equal query and key
heads; anything else falls back to the CPU
op. Hugging Face's packed-sequence check is told "not packed" unless the batch passes
``position_ids``.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


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


class _KernelStandIns(TorchDispatchMode):
    """Fake runs of ops whose meta function refuses what the model really runs.

    ``aten._grouped_mm``'s meta function mirrors the CUDA kernel's dtype check (bf16 only),
    while the CPU kernel (what an fp32 MoE on the CPU runs) takes fp32 and fp16 too. Here a
    grouped matmul of another dtype is shaped by the bf16 meta function and handed back in its
    own dtype: same shape, same strides, new storage, as the real kernel returns.
    ``aten.bincount(ids, minlength=n)`` (no weights) counts tokens per expert (transformers 5.x's experts
    before ``histc``): its length is ``max(n, max(ids) + 1)``, a value fake tensors do not have,
    and expert ids are below ``n``, so it is handed back as ``n`` counts. Enter it *below* the
    byte tracker (after the ``FakeTensorMode``, before the tracker) so the tracker sees only the
    op and its result, not the casts made here.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
        return func(*args, **kwargs)
