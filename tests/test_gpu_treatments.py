"""Treatments on a CUDA GPU, bf16, the kernels users run (flash/efficient SDPA)."""
import copy

import pytest
import torch

import remat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model():
    from remat.presets import build_model, load_config
    config = load_config("llama-tiny")
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 256, 704, 4
    config.attention_dropout = 0.1
    return build_model(config, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("spec", ["full", "selective", "attention", "mlp", "every:2"])
def test_gpu_treatment_matches_untouched_copy(spec):
    model = _model()
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda")
    grads = []
    losses = []
    for m in (model, reference):
        torch.manual_seed(11)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([(n, p.grad) for n, p in m.named_parameters()])
    # the forward is the same computation, so the loss is bit-identical; backward kernels
    # (flash attention's dq accumulation) are not deterministic run to run, so gradients
    # are compared by relative norm error at bf16 rounding (bf16 operands: 1e-3..1e-2)
    assert torch.equal(*losses)
    for (name, g), (_, h) in zip(*grads):
        error = (g.float() - h.float()).norm() / h.float().norm().clamp_min(1e-12)
        assert error < 1e-2, (spec, name, float(error))
