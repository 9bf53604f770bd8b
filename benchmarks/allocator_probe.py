"""What the caching allocator and the optimizer's step add above a plan's allocated peak (one GPU).

Parts (the first argument; one process each so that one part's cache does not colour the next):
  toggle   can expandable segments be switched on at run time, after CUDA holds memory?
  optim    bytes torch.optim.AdamW's step allocates above parameters + gradients + states
           (foreach, the GPU default; fused; for-loop), llama-1b preset in bf16
  card     llama-1b 4 x 4096, AdamW, remat.plan(budget=BUDGET) made once, then trained for 5 steps
           under caps of CAPS GiB, with and without expandable segments; planning's own peak too
Each part prints JSON lines and appends them to $OUT/allocator_probe.jsonl.
"""
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.environ.get("REMAT_SRC", "src"))
import remat  # noqa: E402
from remat.presets import build_model, load_config  # noqa: E402

GiB = 2 ** 30
OUT = os.environ.get("OUT", ".")


def emit(rec):
    rec = dict(rec, gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    print(json.dumps(rec), flush=True)
    with open(os.path.join(OUT, "allocator_probe.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def set_allocator(setting: str):
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def cap(gib: float):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / total) if gib else 1.0)


def toggle():
    a = torch.empty(300 * 2 ** 20, dtype=torch.uint8, device="cuda")
    set_allocator("expandable_segments:True")
    b = torch.empty(300 * 2 ** 20, dtype=torch.uint8, device="cuda")
    segs = [(s["total_size"] // 2 ** 20, s.get("is_expandable"), s.get("stream")) for s in torch.cuda.memory_snapshot()]
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    emit(dict(part="toggle", segments=segs, settings=getter() if getter else None))
    del a, b


def optim():
    torch.manual_seed(0)
    model = build_model(load_config("llama-1b"), device="cuda", dtype=torch.bfloat16).train()
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, 128000, (1, 512), device="cuda")
    for kind, kw in (("foreach", dict(foreach=True)), ("fused", dict(fused=True)), ("forloop", dict(foreach=False))):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **kw)
        rows = []
        for step in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            rows.append(dict(step=step, before=before, peak_above=torch.cuda.max_memory_allocated() - before,
                             after_above=torch.cuda.memory_allocated() - before))
            opt.zero_grad(set_to_none=True)
        emit(dict(part="optim", kind=kind, param_bytes=params, steps=rows,
                  temporaries_over_params=round(rows[1]["peak_above"] / params, 4)))
        del opt
        gc.collect()
        torch.cuda.empty_cache()


def card():
    budget = os.environ.get("BUDGET", "14GiB")
    caps = [float(c) for c in os.environ.get("CAPS", "15.5,14").split(",")]
    B, S = 4, 4096
    torch.manual_seed(0)
    model = build_model(load_config("llama-1b"), device="cuda", dtype=torch.bfloat16).train()
    ids = torch.randint(0, 128000, (B, S), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    plan = remat.plan(model, dict(input_ids=ids, labels=ids), budget=budget, optimizer="adamw")
    vals = list(plan.blocks.values())
    emit(dict(part="card", what="planning", budget=budget, plan_s=round(time.perf_counter() - t, 1),
              planning_peak=round(torch.cuda.max_memory_allocated() / GiB, 3),
              planning_reserved=round(torch.cuda.max_memory_reserved() / GiB, 3),
              plan={v: vals.count(v) for v in set(vals)}, head=str(plan.head),
              predicted=round(plan.notes["predicted_peak_bytes"] / GiB, 3), peak_at=plan.notes.get("peak_at")))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for expandable in (False, True):
        set_allocator(f"expandable_segments:{expandable}")
        for gib in caps:
            rec = dict(part="card", what="train", budget=budget, cap=gib, expandable=expandable)
            m = opt = None
            try:
                torch.manual_seed(0)
                m = build_model(load_config("llama-1b"), device="cuda", dtype=torch.bfloat16).train()
                remat.apply(m, plan)
                opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
                cap(gib)
                torch.cuda.reset_peak_memory_stats()
                ts = []
                for i in range(5):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    m(input_ids=ids, labels=ids).loss.backward()
                    torch.cuda.synchronize()
                    if i == 1:
                        rec["fwd_bwd_peak"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                rec.update(peak=round(torch.cuda.max_memory_allocated() / GiB, 3),
                           reserved=round(torch.cuda.max_memory_reserved() / GiB, 3),
                           tok_s=round(B * S / statistics.median(ts[2:])))
            except torch.OutOfMemoryError as e:
                rec.update(error="oom", detail=str(e)[:200], peak=round(torch.cuda.max_memory_allocated() / GiB, 3),
                           reserved=round(torch.cuda.max_memory_reserved() / GiB, 3))
            del m, opt
            gc.collect()
            cap(0)
            torch.cuda.empty_cache()
            emit(rec)


if __name__ == "__main__":
    {"toggle": toggle, "optim": optim, "card": card}[sys.argv[1]]()
