"""A small plan on its card (benchmarks/results/issue38/small_card_h200.md): plan at static + half of keep, then three
AdamW steps uncapped, printing the allocated and reserved peaks beside the plan's prediction and card.

    PYTHONPATH=src python3 benchmarks/small_card_gpu.py
"""
import gc, sys, torch

import remat
from remat.presets import build_model, load_config
from remat.units import format_size as f
torch.manual_seed(0)
config = load_config("llama-tiny")
config.num_hidden_layers, config.hidden_size, config.intermediate_size = 4, 512, 2048
config.num_attention_heads = config.num_key_value_heads = 8; config.head_dim = 64
model = build_model(config, device="cuda", dtype=torch.bfloat16).train()
ids = torch.randint(0, model.config.vocab_size, (4, 2048), device="cuda")
batch = {"input_ids": ids, "labels": ids}
static = torch.cuda.memory_allocated()
unplanned = remat.plan(model, batch, 64 * 2**30, optimizer="adamw")
print("static", f(static), "unplanned", unplanned.summary(), f(unplanned.notes["predicted_peak_bytes"]))
budget = static + (unplanned.notes["predicted_peak_bytes"] - static) // 2
plan = remat.plan(model, batch, budget, optimizer="adamw")
print("budget", f(budget), "plan", plan.summary(), "pred", f(plan.notes["predicted_peak_bytes"]), "card", f(plan.notes["card_bytes"]), "peak_at", plan.notes.get("peak_at"))
remat.apply(model, plan)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(3):
    torch.cuda.reset_peak_memory_stats()
    model(**batch).loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    print("step", step, "peak alloc", f(torch.cuda.max_memory_allocated()), "reserved", f(torch.cuda.max_memory_reserved()))
