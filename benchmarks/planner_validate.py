"""Validate the planner on a GPU: predicted vs measured peak and step time, OOM-free budgets.

For each model (built once, bf16, random weights): profile on the GPU (CUDA events,
allocator statistics, measured pinned-copy rates), then for every uniform treatment and
for solver plans at several budgets, apply the plan (``remat.apply`` replaces the previous
one), run 1 warm-up + ``--steps`` timed steps with the bench protocol
(``zero_grad(set_to_none=True)``; ``loss = model(input_ids=ids, labels=ids).loss``;
``loss.backward()``; peak = ``torch.cuda.max_memory_allocated()`` over the timed steps,
reset before them) and record prediction beside measurement.

Criteria (the issue's): peak within +-5%, step time within +-10%, measured peak <= budget.

    python benchmarks/planner_validate.py --out "$OUT"          # ~3-5 min on an H100
    PYTHONPATH=src python benchmarks/planner_validate.py --models llama-1b --out /tmp

Writes ``planner_validate.jsonl`` (one JSON record per row) into ``--out``, prints each
record as a JSON line and a table last.
"""
import argparse
import datetime
import gc
import importlib
import json
import os
import statistics
import time
from dataclasses import replace

import torch

import remat
from remat.plans import OFFLOADING_TREATMENTS
from remat.presets import build_model, load_config
from remat.simulator import simulate
from remat.solver import NoPlanFits, solve

GiB = 2**30
# name -> (preset, overrides, batch, seq)
MODELS = {
    "llama-1b": ("llama-1b", {}, 4, 4096),                    # the DESIGN.md bench model
    "qwen-1.5b": ("qwen-1.5b", {}, 2, 4096),                  # vocab 151936, 28 layers, tied head
    "llama-deep": ("llama-1b", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=32,
                                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000), 4, 4096),
}
UNIFORM = ("keep", "full", "selective", "attention", "mlp", "offload", "full+offload")


def copy_rates(size=1 * GiB):
    """Pinned host copy rates (bytes/s): device->host, host->device."""
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    out = []
    for dst, src in ((host, gpu), (gpu, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append(3 * size / (time.perf_counter() - t))
    del gpu, host
    torch.cuda.empty_cache()
    return out


def measure(model, ids, steps):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return peak, statistics.median(times), max(times) - min(times), float(loss)


def budgets_for(prof, treatments, count, capacity):
    """``count`` budgets from just above the smallest achievable peak up to eager's (or the card)."""
    try:
        solve(prof, 1, treatments=treatments)
        low = 1
    except NoPlanFits as e:
        low = e.smallest_peak
    high = min(simulate(prof, "keep").peak_bytes, capacity)
    return [int(low + (high - low) * f) + 64 * 2**20 for f in [i / (count - 1) for i in range(count)]]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--budgets", type=int, default=5, help="solver budgets per model (default 5)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "planner_validate.jsonl")
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=tv,
                remat=remat.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat())
    d2h, h2d = copy_rates()
    info.update(d2h_GBps=d2h / 1e9, h2d_GBps=h2d / 1e9)
    capacity = int(torch.cuda.get_device_properties(0).total_memory * 0.97)
    try:
        importlib.import_module("remat.offload")
        offload = True
    except ImportError as e:
        offload, info["offload_skipped"] = False, str(e)
    rows = []
    with open(path, "w") as f:
        def emit(record):
            record = dict(info, **record)
            rows.append(record)
            print(json.dumps(record), flush=True)
            f.write(json.dumps(record) + "\n")
            f.flush()

        for name in a.models.split(","):
            preset, overrides, batch, seq = MODELS[name]
            config = load_config(preset)
            for key, value in overrides.items():
                setattr(config, key, value)
            model = build_model(config, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
            t = time.perf_counter()
            prof = remat.profile(model, ids)
            prof = replace(prof, rates=replace(prof.rates, d2h_Bps=d2h, h2d_Bps=h2d))
            profile_s = time.perf_counter() - t
            treatments = [u for u in UNIFORM if u in prof.treatments(0) and (offload or u not in OFFLOADING_TREATMENTS)]
            runs = [(u, remat.plans.resolve(u, prof.block_names), None) for u in treatments]
            for budget in budgets_for(prof, treatments, a.budgets, capacity):
                try:
                    runs.append((f"plan@{budget / GiB:.2f}GiB", solve(prof, budget, treatments=treatments), budget))
                except NoPlanFits as e:
                    emit(dict(model=name, strategy=f"plan@{budget / GiB:.2f}GiB", error=str(e)[:300]))
            for strategy, plan, budget in runs:
                sim = simulate(prof, plan)
                record = dict(model=name, batch=batch, seq=seq, strategy=strategy, plan=plan.summary(),
                              budget_bytes=budget, predicted_peak_bytes=sim.peak_bytes,
                              predicted_step_s=sim.step_s, peak_at=sim.peak_at, profile_s=round(profile_s, 2))
                if sim.peak_bytes > capacity:
                    emit(dict(record, skipped="predicted peak over the card's memory"))
                    continue
                try:
                    remat.apply(model, plan)
                    peak, step_s, spread, loss = measure(model, ids, a.steps)
                except torch.cuda.OutOfMemoryError as e:
                    emit(dict(record, error=f"OOM: {str(e)[:200]}"))
                    remat.remove(model)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                record.update(peak_bytes=peak, step_s=step_s, step_spread_s=spread, loss=loss,
                              peak_error_pct=100 * (sim.peak_bytes - peak) / peak,
                              step_error_pct=100 * (sim.step_s - step_s) / step_s)
                if budget is not None:
                    record["within_budget"] = peak <= budget
                emit(record)
                remat.remove(model)
            del model, ids, prof
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{'model':<11} {'strategy':<16} {'pred GiB':>8} {'meas GiB':>8} {'err%':>6} {'pred s':>7} "
          f"{'meas s':>7} {'err%':>6} {'budget':>6}  plan")
    for r in rows:
        if "peak_bytes" not in r:
            print(f"{r['model']:<11} {r['strategy']:<16} {r.get('error') or r.get('skipped')}"[:150])
            continue
        ok = "" if r.get("within_budget") is None else ("ok" if r["within_budget"] else "OVER")
        print(f"{r['model']:<11} {r['strategy']:<16} {r['predicted_peak_bytes'] / GiB:8.2f} {r['peak_bytes'] / GiB:8.2f} "
              f"{r['peak_error_pct']:6.1f} {r['predicted_step_s']:7.3f} {r['step_s']:7.3f} {r['step_error_pct']:6.1f} "
              f"{ok:>6}  {r['plan']}")
    measured = [r for r in rows if "peak_bytes" in r]
    if measured:
        print(f"\npeak within 5%: {sum(abs(r['peak_error_pct']) <= 5 for r in measured)}/{len(measured)}; "
              f"step within 10%: {sum(abs(r['step_error_pct']) <= 10 for r in measured)}/{len(measured)}; "
              f"budgets kept: {sum(r.get('within_budget', True) for r in measured)}/{len(measured)}")


if __name__ == "__main__":
    main()
