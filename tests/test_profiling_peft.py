"""PEFT/LoRA models plan (frozen embeddings), plans move between a PEFT wrapper and its base
model, and a head that cannot be profiled is reported, never swallowed (issue 10)."""
import pytest
import torch

import remat
from remat.profiling.profiler import profile

from test_profiling_models import ResidualMLP
from test_profiling_side_effects import tiny_llama


def lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_lora_over_frozen_embeddings_plans_both_heads():
    model = lora(tiny_llama())
    assert not model.get_input_embeddings().weight.requires_grad
    ids = torch.randint(0, 128, (2, 16))
    prof = profile(model, ids, gpu="h100")
    assert {h.mode for h in prof.heads} == {"plain", "chunked"}, prof.notes
    plan = remat.plan(model, ids, "1GiB", gpu="h100")
    remat.apply(model, plan)
    model(input_ids=ids, labels=ids).loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)


def test_a_base_model_plan_applies_to_its_peft_wrapper_and_back():
    base = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    plan = remat.plan(base, ids, "1GiB", gpu="h100", treatments=["full", "selective"])
    assert set(plan.blocks) == {f"model.layers.{i}" for i in range(3)}
    wrapped = lora(base)
    remat.apply(wrapped, plan)                  # names mapped: model.layers.N -> base_model.model.model.layers.N
    moved = remat.current_plan(wrapped)
    assert set(moved.blocks) == {f"base_model.model.model.layers.{i}" for i in range(3)}
    assert set(remat.api.treatments(wrapped).values()) <= {"full", "selective"}
    wrapped(input_ids=ids, labels=ids).loss.backward()
    back = tiny_llama()
    remat.apply(back, moved)                    # and back onto a base model
    assert dict(remat.current_plan(back).blocks) == dict(plan.blocks)
    with pytest.raises(ValueError, match="another model"):
        remat.apply(back, remat.Plan({"model.layers.7": "full"}))


def test_a_head_that_fails_is_a_warning_and_the_plan_goes_on(monkeypatch):
    import remat.head as head

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(head, "enable_chunked_head", broken)
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    with pytest.warns(UserWarning, match="chunked head could not be profiled.*boom"):
        prof = profile(model, ids, gpu="h100")
    assert [h.mode for h in prof.heads] == ["plain"]
    assert "boom" in prof.notes["chunked"]


def test_no_head_mode_profiled_is_a_clear_error():
    model = ResidualMLP()
    batch = torch.randn(4, 8, 16)
    with pytest.warns(UserWarning, match="plain head could not be profiled"):
        with pytest.raises(ValueError, match="could not profile .* in any mode.*plain"):
            remat.plan(model, batch, "1GiB", loss_fn=lambda m, b: m(b))  # not a scalar: backward fails
