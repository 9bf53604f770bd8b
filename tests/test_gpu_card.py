"""On a GPU: planning stays inside its budget, and the plan trains on a card of the size it names.

A card is emulated with ``torch.cuda.set_per_process_memory_fraction`` (the caching allocator frees
its cache and retries before it raises, as a real card of that size does).
"""
import gc

import pytest
import torch

import remat
from remat.presets import build_model, load_config
from remat.treat import allocator

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _cap(nbytes):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total) if nbytes else 1.0)


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = load_config("llama-tiny")
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 4, 512, 2048
    config.num_attention_heads = config.num_key_value_heads = 8
    config.head_dim = 64
    yield build_model(config, device="cuda", dtype=torch.bfloat16).train()
    _cap(0)
    gc.collect()
    torch.cuda.empty_cache()


def test_planning_allocates_no_more_than_the_budget_and_the_plan_trains_on_its_card(model):
    ids = torch.randint(0, model.config.vocab_size, (4, 2048), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    static = torch.cuda.memory_allocated()
    unplanned = remat.plan(model, batch, 64 * 2**30, optimizer="adamw")
    budget = static + (unplanned.notes["predicted_peak_bytes"] - static) // 2   # half of what keep-like plans take
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    plan = remat.plan(model, batch, budget, optimizer="adamw")
    assert torch.cuda.max_memory_allocated() <= budget
    assert plan.notes["card_bytes"] <= budget
    remat.apply(model, plan)
    assert allocator.holds(model) or allocator.expandable_possible() is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _cap(plan.notes["card_bytes"])
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    assert peak <= budget
    assert abs(peak - plan.notes["predicted_peak_bytes"]) <= 0.01 * peak
    remat.remove(model)
    assert not allocator.holds(model)


def test_a_budget_below_what_the_process_holds_is_refused_in_words_not_a_cuda_oom(model):
    held = torch.cuda.memory_allocated()
    ids = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
    with pytest.raises(remat.NoPlanFits, match="already holds"):
        remat.plan(model, {"input_ids": ids, "labels": ids}, max(1, held // 2))
