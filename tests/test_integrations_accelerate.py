"""accelerate: ``Accelerator(mixed_precision="bf16").prepare(model)`` before or after
``remat.apply``; bf16 autocast stays on, the chunked head is called, and the gradients are
those of the same prepared model without remat (exact for the plain head; the chunked head
within bf16's own rounding of the head: 2e-2 relative, as remat.head documents for
bf16 against the plain path). (prepare, then remove: tests/test_patches.py.)
"""
import pytest
import torch

import remat
from remat.head import hf_model as head_module

accelerate = pytest.importorskip("accelerate")
from test_integrations_hf import VOCAB, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def accelerator():
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)   # an earlier Trainer fixed the precision
    return accelerate.Accelerator(mixed_precision="bf16", cpu=True)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _step(model):
    dtypes = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    loss = model(**_inputs()).loss
    loss.backward()
    hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, dtypes


def _counting_head(monkeypatch):
    calls = []
    original = head_module.chunked_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(head_module, "chunked_cross_entropy", counted)
    return calls


@pytest.mark.parametrize("order", ["prepare-then-apply", "apply-then-prepare"])
@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_prepare_and_apply_in_either_order_keep_autocast(accelerator, monkeypatch, order, head):
    reference = accelerator.prepare(tiny_llama().train())
    want_loss, want_grads, want_dtypes = _step(reference)
    assert want_dtypes == [torch.bfloat16]

    calls = _counting_head(monkeypatch)
    model = tiny_llama().train()
    if order == "prepare-then-apply":
        model = accelerator.prepare(model)
        wrapper = model.__dict__["forward"]
        remat.apply(model, "full", head=head)
    else:
        remat.apply(model, "full", head=head)
        model = accelerator.prepare(model)
        wrapper = model.__dict__["forward"]
    loss, grads, dtypes = _step(model)
    assert set(dtypes) == {torch.bfloat16}                  # autocast is on inside remat's blocks (recompute too)
    assert len(calls) == (1 if head == "chunked" else 0)    # the chunked head really ran
    assert grads.keys() == want_grads.keys()
    if head == "plain":
        assert torch.equal(loss, want_loss)
        for name in grads:
            assert torch.equal(grads[name], want_grads[name]), name
    else:
        torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=0)
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=2e-2, atol=2e-3, msg=name)
    remat.remove(model)
    if order == "apply-then-prepare":
        assert model.__dict__["forward"] is wrapper         # accelerate's wrapper outlives remat's patches
    assert not remat.treat.patches.patches(model)
    _, _, dtypes = _step(model)
    assert set(dtypes) == {torch.bfloat16}
