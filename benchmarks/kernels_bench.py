"""remat's plans over Liger's kernels beside the stack users run with one flag, on one GPU, in one process.

llama-1b preset (16 layers, hidden 2048, vocab 128256), bf16, batch 4 x 4096, AdamW; a smaller card
emulated with ``torch.cuda.set_per_process_memory_fraction`` where a row names one. Rows, in this
order (the class-wide Liger patch comes after the rows that must not see it):

- ``fp32_ref``: stock modules in fp32 with HF checkpointing: the reference gradients (one step, no timing);
- ``remat@14`` (card 15.5 GiB) and ``remat@12`` (card 13.5 GiB): a stock model, ``remat.plan(budget,
  optimizer="adamw", kernels=("stock", "liger"))``, then ``remat.apply``: Liger's kernels installed per
  block instance where the plan chose them (one profile, made in the first of them, serves both budgets);
- ``liger_hf`` (card 15.5 GiB): ``apply_liger_kernel_to_llama()`` (rope, rms_norm, swiglu, fused linear
  cross-entropy) before building, then ``gradient_checkpointing_enable()``: what ``use_liger_kernel=True``
  with ``gradient_checkpointing=True`` runs;
- ``liger_keep`` (no card): the same Liger model without checkpointing, the ceiling of these kernels;
- ``liger_remat@14`` (card 15.5 GiB): the Liger-patched model, ``remat.plan(budget="14GiB")`` as it is;
- ``fake_8b@131072``: a Llama-3.1-8B-shaped Liger-patched model with LoRA r16 on all linears, on the GPU,
  planned with ``device="fake"`` at 131,072 tokens for 76 GiB (no step): before issue 39 this crashed
  (a Triton kernel handed a fake tensor).

Each trained row: peak allocated and reserved, tokens/s (median of 3 steps after 2 warm-ups), the plan
and its prediction, and its gradient error: ``||g - g_fp32|| / ||g_fp32||`` over every parameter's
gradient of one step on the same batch from the same weights (the reference's, rounded to bf16; Liger +
HF's own error is the bar).
One failing row records its error and the rest go on. JSON lines in ``$OUT/kernels_bench.jsonl``,
a table last. Targets (issue 39): ``remat@14`` >= 0.92 x ``liger_keep`` tokens/s; ``remat@12`` >=
``liger_hf`` tokens/s; every row's gradient error <= ``liger_hf``'s.

Usage (repository root, one H200; liger-kernel from its wheel):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src OUT=/tmp/out python3 benchmarks/kernels_bench.py
``ROWS=remat@14,liger_keep`` runs a subset.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import remat  # noqa: E402
from remat.presets import build_model, load_config  # noqa: E402

GiB = 2 ** 30
OUT = os.environ.get("OUT", ".")
B, S = 4, 4096
ALL = ("fp32_ref", "remat@14", "remat@12", "liger_hf", "liger_keep", "liger_remat@14", "fake_8b@131072")
ROWS = [r for r in os.environ.get("ROWS", ",".join(ALL)).split(",") if r]
CARDS = {"remat@14": 15.5, "remat@12": 13.5, "liger_hf": 15.5, "liger_remat@14": 15.5}
BUDGETS = {"remat@14": os.environ.get("BUDGET14", "14GiB"), "remat@12": "12GiB", "liger_remat@14": "14GiB"}
RESULTS = []
REFERENCE = {}   # parameter name -> the fp32 reference gradient, on the host
INIT = {}        # the weights every row starts from (bf16 values), on the host
PROFILE = {}


def emit(rec):
    RESULTS.append(rec)
    print(json.dumps(rec), flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "kernels_bench.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def card(gib):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / total) if gib else 1.0)


def batch():
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128000, (B, S), device="cuda", generator=g)
    return {"input_ids": ids, "labels": ids}


def build(dtype=torch.bfloat16):
    return build_model(load_config("llama-1b"), device="cuda", dtype=dtype, seed=0).train()


def grad_error(model):
    """``||g - g_ref|| / ||g_ref||`` of one step's gradients on the batch (the reference's, fp32, on the host)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    del loss
    diff = ref = 0.0
    for name, p in model.named_parameters():
        want = REFERENCE.get(name)
        if want is None or p.grad is None:
            continue
        for start in range(0, want.numel(), 2 ** 26):   # a slice at a time: the card is small
            w = want.view(-1)[start:start + 2 ** 26].to("cuda", non_blocking=True)
            g = p.grad.view(-1)[start:start + 2 ** 26].float()
            diff += float((g - w).pow(2).sum())
            ref += float(w.pow(2).sum())
    model.zero_grad(set_to_none=True)
    return (diff / ref) ** 0.5 if ref else None


def timed(model, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    data = batch()
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**data).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step = statistics.median(times[2:])
    return dict(peak_GiB=round(torch.cuda.max_memory_allocated() / GiB, 2),
                reserved_GiB=round(torch.cuda.max_memory_reserved() / GiB, 2), step_s=round(step, 4),
                tok_s=round(B * S / step))


def described(plan, seconds):
    vals = list(plan.blocks.values())
    return dict(plan=plan.summary(), treatments={v: vals.count(v) for v in sorted(set(vals))}, head=plan.head,
                kernels=plan.kernels if isinstance(plan.kernels, (str, type(None))) else dict(plan.kernels),
                plan_s=round(seconds, 1), predicted_peak_GiB=round(plan.notes["predicted_peak_bytes"] / GiB, 2),
                predicted_tok_s=plan.notes.get("predicted_tokens_per_s"),
                kernels_stock=len(plan.notes.get("kernels_stock") or {}))


def row(name, setup, dtype=torch.bfloat16, train=True):
    """One row: a fresh llama-1b (``train``: its gradient error and timed steps; else ``setup`` alone)."""
    rec = dict(row=name, card_GiB=CARDS.get(name), budget=BUDGETS.get(name))
    model = None
    try:
        card(CARDS.get(name))
        model = build(dtype) if train else None
        if train and INIT:
            model.load_state_dict(INIT)   # every row from the same weights
        rec.update(setup(model) or {})
        if train and name != "fp32_ref":
            rec["grad_error"] = grad_error(model)
            rec.update(timed(model))
    except torch.OutOfMemoryError as error:
        rec["error"] = f"oom: {str(error)[:200]}"
    except Exception as error:  # noqa: BLE001 - one row's failure is recorded, the others run
        rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        card(None)
        rec.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
        emit(rec)


def reference(model):
    """The fp32 reference gradients, from weights rounded to bf16 (the rows' weights: the error is the compute's)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    INIT.update({k: v.to(torch.bfloat16).cpu() for k, v in model.state_dict().items()})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    REFERENCE.update({n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None})
    return dict(loss=float(loss))


def planned(budget, kernels=("stock", "liger")):
    def setup(model):
        started = time.perf_counter()
        if kernels and "profile" not in PROFILE:   # one profile for both budgets (the first row's card)
            PROFILE["profile"] = remat.profile(model, batch(), optimizer="adamw", kernels=kernels)
        plan = remat.plan(model, batch(), budget, optimizer="adamw", kernels=kernels,
                          profiled=PROFILE.get("profile") if kernels else None)
        remat.apply(model, plan)
        return described(plan, time.perf_counter() - started)
    return setup


def hf_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def fake_8b(_):
    from peft import LoraConfig, get_peft_model
    config = load_config("llama-8b")
    model = get_peft_model(build_model(config, device="cuda", dtype=torch.bfloat16),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    try:
        ids = torch.zeros(1, 131072, dtype=torch.long, device="cuda")
        started = time.perf_counter()
        plan = remat.plan(model, {"input_ids": ids, "labels": ids}, "76GiB", optimizer="adamw", device="fake")
        return dict(described(plan, time.perf_counter() - started), liger_mlp=type(
            model.base_model.model.model.layers[0].mlp).__name__)
    finally:
        del model


def table():
    by = {r["row"]: r for r in RESULTS}
    print(f"\n{'row':<18}{'card':>6}{'peak':>8}{'resv':>8}{'tok/s':>9}{'vs keep':>9}{'grad err':>10}  plan")
    keep = by.get("liger_keep", {}).get("tok_s")
    for r in RESULTS:
        if r["row"] == "fp32_ref":
            continue
        speed = f"{r['tok_s'] / keep:.3f}" if keep and r.get("tok_s") else "-"
        err = f"{r['grad_error']:.2e}" if r.get("grad_error") is not None else "-"
        print(f"{r['row']:<18}{r.get('card_GiB') or '-':>6}{r.get('peak_GiB', '-'):>8}{r.get('reserved_GiB', '-'):>8}"
              f"{r.get('tok_s', '-'):>9}{speed:>9}{err:>10}  {r.get('error') or r.get('plan', '')}")
    hf = by.get("liger_hf", {})
    checks = []
    if keep and by.get("remat@14", {}).get("tok_s"):
        checks.append(("remat@14 >= 0.92 x liger_keep", by["remat@14"]["tok_s"] >= 0.92 * keep))
    if hf.get("tok_s") and by.get("remat@12", {}).get("tok_s"):
        checks.append(("remat@12 >= liger_hf", by["remat@12"]["tok_s"] >= hf["tok_s"]))
    if hf.get("grad_error") is not None:
        for r in RESULTS:
            if r.get("grad_error") is not None and r["row"] != "liger_hf":
                checks.append((f"{r['row']} grad error <= liger_hf's", r["grad_error"] <= hf["grad_error"] * 1.0001))
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")


if __name__ == "__main__":
    started = time.perf_counter()
    if "fp32_ref" in ROWS:
        row("fp32_ref", reference, dtype=torch.float32)
    for name in ("remat@14", "remat@12"):
        if name in ROWS:
            row(name, planned(BUDGETS[name]))
    if any(r.startswith(("liger", "fake")) for r in ROWS):
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    if "liger_hf" in ROWS:
        row("liger_hf", hf_checkpointing)
    if "liger_keep" in ROWS:
        row("liger_keep", lambda m: None)
    if "liger_remat@14" in ROWS:
        row("liger_remat@14", planned("14GiB", kernels=None))
    if "fake_8b@131072" in ROWS:
        row("fake_8b@131072", fake_8b, train=False)
    table()
    print(f"total {time.perf_counter() - started:.0f} s")
