"""Offload engine on the DESIGN.md bench model, with its anchors measured in the same process.

One GPU, one process: first the hardware ceilings (bf16 matmul rate; pinned copy bandwidth
device-to-host, host-to-device and both at once, 2 GiB buffers), then forward+backward steps of
the bench model (``llama-1b`` preset, bf16, SDPA, batch 4 x 4096, random ids, outputs dropped
before backward as the HF Trainer does) under each strategy:

- ``none``: eager, no checkpointing (the compute-only step);
- ``full``: ``remat.apply(m, "full")``;
- ``offload``: ``remat.apply(m, "offload")`` on every block;
- ``full+offload``: ``remat.apply(m, "full+offload")``;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, the anchor (slow:
  timed with fewer steps);
- ``offload@W`` (``--extra-windows-gib W,...``): ``offload`` with the engine's window set to W GiB,
  to show the peak / bus-time trade-off of the window.

Per strategy: peak (``max_memory_allocated`` after a reset), step time (median of timed steps),
tokens/s, ratio to eager, loss; for the offload strategies also the engine's counters per step
(bytes each way, achieved GB/s, copy time, exposed waits, bytes never moved, the window) and what
``remat.planning.offload_model.gpu_overhead_bytes`` says the engine adds at the head (where these steps peak),
from the bytes each block handed it. Then the issue's
criteria, each with its numbers and pass/fail:

- offload: throughput >= 0.60x eager; step <= 1.10 x max(eager step, bus time), where bus time =
  bytes D2H / measured D2H GB/s + bytes H2D / measured H2D GB/s (the engine moves the two directions
  in different phases of the step, forward and backward, so they add; the duplex figure is
  recorded beside it); peak <= 60% of eager's.
- full+offload: throughput >= 0.98x ``full``; peak lower than ``full``'s by >= 90% of the
  checkpoint bytes (the block inputs the hooks took, from the engine's ``bytes_packed``).

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=src python3 benchmarks/offload_bench.py --out "$OUT"
Writes ``offload_bench.json`` (info + rows + criteria) to ``--out``; prints one JSON line per
result and a table last. About 2 minutes on an H100.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import time

import torch

import remat
from remat.prove.bench import timed_steps
from remat.offload.engine import GiB
from remat.treat.treatments import engine_of
from remat.planning.offload_model import gpu_overhead_bytes
from remat.presets import build_model, load_config

from _args import bench_parser  # benchmarks/_args.py, beside this script

STRATEGIES = ("none", "full", "offload", "full+offload", "save_on_cpu")


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--slow-steps", type=int, default=2, help="timed steps for save_on_cpu (~2.7 s each)")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--max-pending-gib", type=float, default=None,
                   help="engine window (max_pending_bytes) in GiB (default: the engine's, the largest block's bytes)")
    p.add_argument("--extra-windows-gib", default="",
                   help="comma-separated windows in GiB: one more offload row each, named offload@W")
    p.add_argument("--prefetch-blocks", type=int, default=None)
    p.add_argument("--min-mib", type=float, default=None, help="engine min_bytes in MiB")
    return p.parse_args(argv)


def ceilings() -> dict:
    dev = "cuda"
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(20):
        x @ y
    e1.record()
    torch.cuda.synchronize()
    res = {"bf16_tflops": 20 * 2 * 8192 ** 3 / (e0.elapsed_time(e1) / 1e3) / 1e12}
    del x, y
    n = 2 * GiB
    g = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    for name, dst, src in (("d2h_GBps", h, g), ("h2d_GBps", g, h)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        e0.record()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        e1.record()
        torch.cuda.synchronize()
        res[name] = 5 * n / (e0.elapsed_time(e1) / 1e3) / 1e9
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    g2, h2 = torch.empty_like(g), torch.empty(n, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        with torch.cuda.stream(s1):
            h.copy_(g, non_blocking=True)
        with torch.cuda.stream(s2):
            g2.copy_(h2, non_blocking=True)
    torch.cuda.synchronize()
    res["duplex_GBps"] = 5 * 2 * n / (time.perf_counter() - t) / 1e9
    del g, h, g2, h2
    _free()
    return res


def _free():
    # PyTorch's cache of pinned host blocks is kept: the next offload strategy's pool reuses it
    # instead of pinning ~28 GB again (~15 s)
    gc.collect()
    torch.cuda.empty_cache()


def run(strategy: str, args) -> dict:
    _free()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(load_config(args.model), device="cuda", dtype=torch.bfloat16)
    base, _, window_gib = strategy.partition("@")
    if base in ("full", "offload", "full+offload"):
        remat.apply(model, base)
    engine = engine_of(model)
    if engine is not None:
        if window_gib or args.max_pending_gib is not None:
            engine.max_pending_bytes = int(float(window_gib or args.max_pending_gib) * GiB)
        if args.prefetch_blocks is not None:
            engine.prefetch_blocks = args.prefetch_blocks
        if args.min_mib is not None:
            engine.min_bytes = int(args.min_mib * 2 ** 20)
    static = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        if strategy == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    slow = strategy == "save_on_cpu"
    warmup, steps = (1, args.slow_steps) if slow else (args.warmup, args.steps)
    first = None
    for i in range(warmup):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = first if first is not None else time.perf_counter() - t
    if engine is not None:
        engine.stats()  # settle the warm-up's events before resetting
        engine.reset_stats()
        allocations_before = engine.pool.allocations
    torch.cuda.reset_peak_memory_stats()
    times, loss = timed_steps(step, steps)
    step_s = statistics.median(times)
    row = {
        "strategy": strategy, "peak_GiB": torch.cuda.max_memory_allocated() / GiB,
        "reserved_peak_GiB": torch.cuda.max_memory_reserved() / GiB, "static_GiB": static / GiB,
        "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times), "steps": steps,
        "tok_s": args.batch * args.seq / step_s, "first_step_s": first, "loss": float(loss),
    }
    if engine is not None:
        s = engine.stats()
        summed = ("bytes_", "tensors_", "slots")
        per_step = {k: (v / steps if k.startswith(summed) or k.endswith("_s") or k == "compute_waits" else v)
                    for k, v in s.items()
                    if v is not None and k != "bytes_packed_by_block"}
        per_step["bytes_packed_by_block"] = {k: v / steps for k, v in s["bytes_packed_by_block"].items()}
        per_step["pinned_allocations_timed"] = engine.pool.allocations - allocations_before
        per_step["hidden_copy_s"] = max(0.0, per_step["d2h_s"] + per_step["h2d_s"]
                                        - per_step["compute_wait_s"] - per_step["host_wait_s"])
        per_step["min_bytes"] = engine.min_bytes
        per_step["prefetch_blocks"] = engine.prefetch_blocks
        by_block = per_step["bytes_packed_by_block"]
        model_bytes = gpu_overhead_bytes([int(by_block[k]) for k in sorted(by_block)], engine.max_pending_bytes,
                                         engine.prefetch_blocks)
        row["engine_overhead_GiB"] = {"window": model_bytes["window"] / GiB, "head": model_bytes["head"] / GiB,
                                      "forward_max": max(model_bytes["forward"], default=0) / GiB,
                                      "backward_max": max(model_bytes["backward"], default=0) / GiB}
        row["engine_per_step"] = per_step
    del model, engine, ids
    _free()
    return row


def criteria(rows: dict, ceil: dict) -> dict:
    out = {}
    eager = rows.get("none")
    off = rows.get("offload")
    if eager and off:
        e = off["engine_per_step"]
        bus_s = e["bytes_d2h"] / (ceil["d2h_GBps"] * 1e9) + e["bytes_h2d"] / (ceil["h2d_GBps"] * 1e9)
        bound = max(eager["step_s"], bus_s)
        out["offload"] = {
            "throughput_ratio": eager["step_s"] / off["step_s"], "throughput_ratio_min": 0.60,
            "throughput_pass": eager["step_s"] / off["step_s"] >= 0.60,
            "bus_time_s": bus_s,
            "bus_time_duplex_s": (e["bytes_d2h"] + e["bytes_h2d"]) / (ceil["duplex_GBps"] * 1e9),
            "compute_step_s": eager["step_s"], "bound_s": bound, "step_s": off["step_s"],
            "step_over_bound": off["step_s"] / bound, "bus_limit_pass": off["step_s"] <= 1.10 * bound,
            "peak_ratio": off["peak_GiB"] / eager["peak_GiB"], "peak_ratio_max": 0.60,
            "peak_pass": off["peak_GiB"] <= 0.60 * eager["peak_GiB"],
        }
    full, fo = rows.get("full"), rows.get("full+offload")
    if full and fo:
        checkpoint_gib = fo["engine_per_step"]["bytes_packed"] / GiB
        saved = full["peak_GiB"] - fo["peak_GiB"]
        out["full+offload"] = {
            "throughput_ratio_vs_full": full["step_s"] / fo["step_s"], "throughput_ratio_min": 0.98,
            "throughput_pass": full["step_s"] / fo["step_s"] >= 0.98,
            "checkpoint_GiB": checkpoint_gib, "peak_saved_GiB": saved,
            "peak_saved_fraction_of_checkpoint": saved / checkpoint_gib if checkpoint_gib else None,
            "peak_pass": saved >= 0.90 * checkpoint_gib,
        }
    return out


def _write(out: str, info: dict, rows: dict) -> dict:
    crit = criteria(rows, info)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "offload_bench.json"), "w") as f:
        json.dump({"info": info, "rows": list(rows.values()), "criteria": crit}, f, indent=1)
        f.write("\n")
    return crit


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("offload_bench needs a CUDA GPU")
    chosen = [s for s in STRATEGIES if not args.only or s in args.only.split(",")]
    chosen += [f"offload@{w.strip()}" for w in args.extra_windows_gib.split(",") if w.strip()]
    import transformers
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "remat": remat.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args)}
    info.update(ceilings())
    print(json.dumps({"info": info}), flush=True)
    rows = {}
    for strategy in chosen:
        rows[strategy] = run(strategy, args)
        if "none" in rows:
            rows[strategy]["vs_eager"] = rows["none"]["step_s"] / rows[strategy]["step_s"]
            rows[strategy]["peak_vs_eager"] = rows[strategy]["peak_GiB"] / rows["none"]["peak_GiB"]
        print(json.dumps(rows[strategy]), flush=True)
        _write(args.out, info, rows)  # after each row: a run cut short keeps what it measured
    crit = _write(args.out, info, rows)
    print(json.dumps({"criteria": crit}), flush=True)
    print(f"\n{'strategy':<14}{'peak GiB':>10}{'step s':>9}{'tok/s':>10}{'vs eager':>10}"
          f"{'GB/step d2h':>13}{'h2d':>7}{'GB/s d2h':>10}{'h2d':>7}{'wait s':>8}")
    for r in rows.values():
        e = r.get("engine_per_step")
        moved = (f"{e['bytes_d2h'] / 1e9:>13.1f}{e['bytes_h2d'] / 1e9:>7.1f}"
                 f"{e.get('d2h_GBps', 0) or 0:>10.1f}{e.get('h2d_GBps', 0) or 0:>7.1f}"
                 f"{e['compute_wait_s'] + e['host_wait_s']:>8.3f}") if e else ""
        print(f"{r['strategy']:<14}{r['peak_GiB']:>10.1f}{r['step_s']:>9.3f}{r['tok_s']:>10.0f}"
              f"{r.get('vs_eager', float('nan')):>10.2f}{moved}")
    for name, c in crit.items():
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})


if __name__ == "__main__":
    main()
