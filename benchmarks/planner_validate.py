"""Validate the planner on a GPU: predicted vs measured peak and step time, OOM-free budgets.

For each model (built once, bf16, random weights): profile on the GPU (CUDA events,
allocator statistics, measured pinned-copy rates), then for every uniform treatment and
for solver plans at several budgets, apply the plan (``remat.apply`` replaces the previous
one), run 1 warm-up + ``--steps`` timed steps with the bench protocol
(``zero_grad(set_to_none=True)``; ``loss = model(input_ids=ids, labels=ids).loss``;
``loss.backward()``; peak = ``torch.cuda.max_memory_allocated()`` over the timed steps,
reset before them) and record prediction beside measurement.

Criteria (the issue's): peak within +-5%, step time within +-10%, measured peak <= budget.

Each uniform row also carries ``stages``: the forward (embeddings and blocks), head and
backward seconds of one more step timed with CUDA events from module and tensor hooks, and
the median per-block forward/backward seconds inside that step, beside the profile's
(``predicted_stages``, ``profile_block_s``): where a step-time error comes from. Offload
rows carry the engine's statistics per step (bytes moved, never moved, waits).

    PYTHONPATH=src python3 benchmarks/planner_validate.py --out "$OUT"   # ~3.5 min on an H200
    PYTHONPATH=src python benchmarks/planner_validate.py --models llama-1b --out /tmp

Writes ``planner_validate.jsonl`` (one JSON record per row) into ``--out``, prints each
record as a JSON line and a table last.
"""
import argparse
import datetime
import functools
import gc
import importlib
import json
import os
import statistics
import time

import torch

import remat
from remat.prove.bench import timed_steps
from remat.treat.discovery import discover
from remat.planning.plans import OFFLOADING_TREATMENTS
from remat.presets import build_model, load_config
from remat.planning.simulator import simulate
from remat.planning.solver import NoPlanFits, solve

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


def step_once(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def engine(model):
    try:
        from remat.treat.treatments import engine_of
    except ImportError:
        return None
    return engine_of(model)


def measure(model, ids, steps):
    step = functools.partial(step_once, model, ids)
    step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if engine(model) is not None:
        engine(model).reset_stats()
    times, loss = timed_steps(step, steps)
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    stats = None
    if engine(model) is not None:
        raw = engine(model).stats()
        keys = ("bytes_packed", "bytes_d2h", "bytes_h2d", "bytes_never_moved", "d2h_s", "h2d_s", "host_wait_s",
                "compute_wait_s", "window_bytes", "max_pending_bytes")
        stats = {k: (raw[k] / steps if k.endswith("_s") or k.startswith("bytes") else raw[k])
                 for k in keys if k in raw and raw[k] is not None}
    return peak, statistics.median(times), max(times) - min(times), float(loss), stats


def staged_step(model, ids, blocks):
    """One step with CUDA events at the stage boundaries and around every block (fwd and bwd)."""
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    fwd_start, fwd_end, bwd_start = {}, {}, {}
    marks = {}
    handles = []

    def pre(i, module, args, kwargs):
        e = ev()
        e.record()
        fwd_start[i] = e
        x = args[0] if args else kwargs.get("hidden_states")
        if i == 0 and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda g: record("blocks_bwd_end"))

    def post(i, module, args, kwargs, out):
        e = ev()
        e.record()
        fwd_end[i] = e
        y = out if isinstance(out, torch.Tensor) else out[0]
        if y.requires_grad:
            def at_grad(g, i=i):
                e = ev()
                e.record()
                bwd_start[i] = e
            y.register_hook(at_grad)

    def record(name):
        e = ev()
        e.record()
        marks[name] = e

    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(functools.partial(pre, i), with_kwargs=True))
        handles.append(block.register_forward_hook(functools.partial(post, i), with_kwargs=True))
    try:
        torch.cuda.synchronize()
        record("start")
        step_once(model, ids)
        record("end")
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    n = len(blocks)
    t = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
    fwd = [t(fwd_start[i], fwd_end[i]) for i in range(n)]
    # block i's backward: from the gradient reaching its output to it reaching its input
    ends = [bwd_start[i - 1] if i else marks["blocks_bwd_end"] for i in range(n)]
    bwd = [t(bwd_start[i], ends[i]) for i in range(n)]
    return {"forward": t(marks["start"], fwd_end[n - 1]), "head": t(fwd_end[n - 1], bwd_start[n - 1]),
            "backward": t(bwd_start[n - 1], marks["end"]), "embeddings_fwd": t(marks["start"], fwd_start[0]),
            "embeddings_bwd": t(marks["blocks_bwd_end"], marks["end"]),
            "block_fwd_median": statistics.median(fwd), "block_bwd_median": statistics.median(bwd),
            "block_fwd": [round(x, 5) for x in fwd], "block_bwd": [round(x, 5) for x in bwd]}


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
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the extra step with per-stage events on uniform rows")
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
        importlib.import_module("remat.offload.engine")
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
            prof = remat.profile(model, ids)  # measures its own copy rates
            profile_s = time.perf_counter() - t
            treatments = [u for u in UNIFORM if u in prof.treatments(0) and (offload or u not in OFFLOADING_TREATMENTS)]
            runs = [(u, remat.planning.plans.resolve(u, prof.block_names), None) for u in treatments]
            for budget in budgets_for(prof, treatments, a.budgets, capacity):
                try:
                    runs.append((f"plan@{budget / GiB:.2f}GiB", solve(prof, budget, treatments=treatments), budget))
                except NoPlanFits as e:
                    emit(dict(model=name, strategy=f"plan@{budget / GiB:.2f}GiB", error=str(e)[:300]))
            blocks = [m for _, m in discover(model).blocks(model)]
            for strategy, plan, budget in runs:
                sim = simulate(prof, plan)
                costs = [prof.cost(i, t) for i, t in enumerate(plan.blocks.values())]
                record = dict(model=name, batch=batch, seq=seq, strategy=strategy, plan=plan.summary(),
                              budget_bytes=budget, predicted_peak_bytes=sim.peak_bytes,
                              predicted_bound_bytes=sim.bound_bytes, predicted_step_s=sim.step_s,
                              peak_at=sim.peak_at, profile_s=round(profile_s, 2),
                              profile_rates={"d2h_GBps": prof.rates.d2h_Bps / 1e9, "h2d_GBps": prof.rates.h2d_Bps / 1e9},
                              calibration=prof.notes.get("calibration"),
                              predicted_stages={k: round(v["seconds"], 5) for k, v in sim.stages().items()},
                              profile_block_s=[round(statistics.median(c.fwd_s for c in costs), 5),
                                               round(statistics.median(c.bwd_s for c in costs), 5)],
                              predicted_offload={"offload_bytes": sim.offload_bytes, "moved_bytes": sim.moved_bytes,
                                                 "exposed_copy_s": round(sim.exposed_copy_s, 5)})
                if sim.peak_bytes > capacity:
                    emit(dict(record, skipped="predicted peak over the card's memory"))
                    continue
                try:
                    remat.apply(model, plan)
                    peak, step_s, spread, loss, stats = measure(model, ids, a.steps)
                    if budget is None and a.stages:
                        try:
                            record["stages"] = staged_step(model, ids, blocks)
                        except Exception as e:  # a diagnostic: never lose the row for it
                            record["stages_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                except torch.cuda.OutOfMemoryError as e:
                    emit(dict(record, error=f"OOM: {str(e)[:200]}"))
                    remat.remove(model)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                if stats:
                    record["engine"] = stats
                record.update(peak_bytes=peak, step_s=step_s, step_spread_s=spread, loss=loss,
                              peak_error_pct=100 * (sim.peak_bytes - peak) / peak,
                              step_error_pct=100 * (sim.step_s - step_s) / step_s)
                if budget is not None:
                    record["within_budget"] = peak <= budget
                emit(record)
                remat.remove(model)
            del model, ids, prof, blocks, runs  # the blocks list would keep the model alive into the next profile
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
