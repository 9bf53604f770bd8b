"""The chunked head under ``torch.compile`` (issue 11): same loss and gradients as eager.

The head's interception and loss run outside the compiled graphs on purpose (see
:mod:`remat.head`); the model's forward up to ``lm_head`` is compiled. Backend
``aot_eager`` (dynamo and AOTAutograd, no code generation): inductor's CPU compile of this
tiny Llama took over 4 minutes on the 2-core test machine; tests/test_gpu_head.py runs
the same three ways with inductor on CUDA.
"""
from __future__ import annotations

import copy

import pytest
import torch

import remat

BACKEND = "aot_eager"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _steps(model, ids, labels):
    """Two training steps; the second must run what the first compiled, without recompiling."""
    import torch._dynamo
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    assert out.logits is None
    named = getattr(model, "_orig_mod", model).named_parameters()
    return out.loss.detach(), {n: p.grad.detach() for n, p in named}


@pytest.mark.parametrize("how", ["model.compile", pytest.param("torch.compile", marks=pytest.mark.slow),
                                 pytest.param("per-block", marks=pytest.mark.slow)])
def test_compiled_chunked_head_matches_eager(how):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    eager = remat.apply(_tiny_llama(), "keep", head="chunked", chunk_tokens=7)
    model = copy.deepcopy(eager)
    backend = CompileCounterWithBackend(BACKEND)
    if how == "model.compile":
        model.compile(backend=backend)
    elif how == "torch.compile":
        model = torch.compile(model, backend=backend)
    else:
        for layer in model.model.layers:
            layer.compile(backend=backend)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    loss, grads = _steps(model, ids, labels)
    assert backend.op_count >= 40, backend.op_count  # the decoder layers ran compiled
    ref_loss, ref_grads = _steps(eager, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
