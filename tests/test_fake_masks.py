"""Transformers 4.x's attention-mask checks on fake tensors (``remat.profiling._fake._mask_checks``).

Transformers 4.x asks ``torch.all(mask == 1)`` of the 2-D attention mask to skip the mask for
SDPA, in ``AttentionMaskConverter._ignore_causal_mask_sdpa`` (causal models) and in
``_prepare_4d_attention_mask_for_sdpa`` (encoders, which import it by name). A fake tensor has no
values, so a fake-tensor profile of such a model failed on every model given an attention mask
(torch 2.6 + transformers 4.51: 23 of the zoo's models). Transformers 5 has neither function, so
this test installs stand-ins written as 4.51's are, with a model module that imported the
function by name, and checks the answers, from the real mask, and the restore.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.profiling import padded_mask
# private: the emulation alone, on stand-ins of transformers 4.x's checks (transformers 5 has none): that a
# real mask still reaches the original check no fake profile can show, its every mask being fake
from remat.profiling._fake import _mask_checks


class _Converter:
    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length, sliding_window=None,
                                 is_training=False):
        if attention_mask is None:
            return is_training
        return bool(torch.all(attention_mask == 1))  # reads a value: fails on a fake tensor

    @staticmethod
    def _expand_mask(mask, dtype, tgt_len=None):
        return mask[:, None, None, :].expand(mask.shape[0], 1, tgt_len or mask.shape[1], mask.shape[1]).to(dtype)


def _prepare_4d_attention_mask_for_sdpa(mask, dtype, tgt_len=None):
    if torch.all(mask == 1):
        return None
    return _Converter._expand_mask(mask, dtype, tgt_len)


@pytest.fixture
def transformers4(monkeypatch):
    utils = types.ModuleType("transformers.modeling_attn_mask_utils")
    utils.AttentionMaskConverter = _Converter
    utils._prepare_4d_attention_mask_for_sdpa = _prepare_4d_attention_mask_for_sdpa
    encoder = types.ModuleType("transformers.models.fake_encoder.modeling_fake_encoder")
    encoder._prepare_4d_attention_mask_for_sdpa = _prepare_4d_attention_mask_for_sdpa  # imported by name
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, encoder.__name__, encoder)
    return utils, encoder


@pytest.mark.parametrize("padded", [False, True])
def test_mask_checks_answer_from_the_real_mask_and_restore(transformers4, padded):
    utils, encoder = transformers4
    original_ignore = _Converter.__dict__["_ignore_causal_mask_sdpa"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        mask = torch.ones(2, 8, dtype=torch.long)
        embeds = torch.empty(2, 8, 4)
        with pytest.raises(Exception):  # what the profile met before: no value to answer with
            _Converter._ignore_causal_mask_sdpa(mask, embeds, 0, is_training=True)
        with _mask_checks(padded):
            ignored = utils.AttentionMaskConverter._ignore_causal_mask_sdpa(mask, embeds, 0, is_training=True)
            expanded = encoder._prepare_4d_attention_mask_for_sdpa(mask, torch.float32)
    assert ignored is (not padded)  # an all-ones mask is skipped for SDPA's causal path, a padded one kept
    assert (expanded is None) is (not padded)
    if padded:
        assert tuple(expanded.shape) == (2, 1, 8, 8)
    assert _Converter.__dict__["_ignore_causal_mask_sdpa"] is original_ignore
    assert encoder._prepare_4d_attention_mask_for_sdpa is _prepare_4d_attention_mask_for_sdpa
    assert utils._prepare_4d_attention_mask_for_sdpa is _prepare_4d_attention_mask_for_sdpa
    # real tensors still go to the original checks
    with _mask_checks(padded):
        assert encoder._prepare_4d_attention_mask_for_sdpa(torch.ones(2, 8), torch.float32) is None


def test_padded_mask_reads_the_real_mask():
    assert padded_mask({"attention_mask": torch.tensor([[1, 1, 0]])}) is True
    assert padded_mask({"attention_mask": torch.ones(2, 3, dtype=torch.long)}) is False
    assert padded_mask({"input_ids": torch.zeros(2, 3, dtype=torch.long)}) is False      # no mask: all ones
    assert padded_mask({"attention_mask": torch.ones(2, 3, device="meta")}) is False      # no values to read
    assert padded_mask(torch.zeros(2, 3)) is False
