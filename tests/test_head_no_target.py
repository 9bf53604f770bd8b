"""The chunked head on a batch with no valid target (issue 10).

Common in SFT with completion-only masks: every label -100, a sequence of length 1 (its
only label is shifted out), or the Trainer's ``num_items_in_batch=0``. The model's own
path gives loss nan and gradients that are finite zeros; the chunked head must give the
same loss and the same zeros, so an optimizer step leaves the weights finite.
"""
from __future__ import annotations

import copy

import pytest
import torch

import remat


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)  # config defaults otherwise (use_cache on)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
CASES = {
    "all_labels_ignored": (IDS, torch.full_like(IDS, -100), {}),
    "sequence_length_1": (IDS[:, :1], IDS[:, :1], {}),
    "num_items_in_batch_0": (IDS, torch.full_like(IDS, -100), {"num_items_in_batch": 0}),
    "num_items_in_batch_0_tensor": (IDS, torch.full_like(IDS, -100), {"num_items_in_batch": torch.tensor(0)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [4, None])
def test_no_valid_target_gives_the_models_loss_and_zero_gradients(case, chunk):
    ids, labels, kwargs = CASES[case]
    reference = _tiny_llama()
    model = remat.apply(copy.deepcopy(reference), "keep", head="chunked", chunk_tokens=chunk)
    loss, grads = _step(model, ids, labels, **kwargs)
    ref_loss, ref_grads = _step(reference, ids, labels, **kwargs)
    assert torch.isnan(ref_loss) and torch.isnan(loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None and torch.equal(ref_grad, torch.zeros_like(ref_grad)), name  # the premise
        assert grads[name] is not None and torch.equal(grads[name], ref_grad), name
    # one optimizer step: the weights stay finite (AdamW with a zero gradient only decays them)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_num_items_in_batch_0_with_valid_targets_gives_the_models_loss_and_finite_gradients():
    """``sum / 0``: the model's loss is inf and its gradients are not finite; ours are zeros."""
    reference = _tiny_llama()
    model = remat.apply(copy.deepcopy(reference), "keep", head="chunked", chunk_tokens=4)
    loss, grads = _step(model, IDS, IDS, num_items_in_batch=0)
    ref_loss, _ = _step(reference, IDS, IDS, num_items_in_batch=0)
    assert torch.isinf(ref_loss) and torch.equal(loss, ref_loss)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_op_with_no_valid_target(dtype):
    from remat.head.chunked_loss import chunked_cross_entropy
    h = torch.randn(10, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(16, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(16, dtype=dtype, requires_grad=True)
    loss = chunked_cross_entropy(h, w, b, torch.full((10,), -100), chunk_tokens=3)
    loss.backward()
    assert torch.isnan(loss)
    for t in (h, w, b):
        assert torch.equal(t.grad, torch.zeros_like(t))
