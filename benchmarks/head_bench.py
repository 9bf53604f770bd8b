"""Chunked LM head on the DESIGN.md bench model, with its anchors measured in the same process.

One GPU, one process: forward+backward steps of the bench model (``llama-1b`` preset, bf16, SDPA,
batch 4 x 4096, random ids, ``labels=ids``, outputs dropped before backward as the HF Trainer does)
under each strategy:

- ``none``: eager, no checkpointing (anchor);
- ``hf_full``: ``model.gradient_checkpointing_enable(use_reentrant=False)`` (anchor);
- ``full``: ``remat.apply(m, "full")``;
- ``full+chunked``: ``remat.apply(m, "full", head="chunked")`` (default chunk, plus the sizes in
  ``--chunks`` as ``full+chunked:N``);
- ``chunked``: ``remat.apply(m, "keep", head="chunked")``, the head alone.

Per strategy: peak (``max_memory_allocated`` after a reset, over the timed steps), static bytes
(allocated before a step), step time (median and spread), tokens/s, ratio to eager and to
``hf_full``, loss and its relative difference to eager's, and for chunked rows the chunk size
(the planner predicts the head's peak from a profile of it, not from a formula). Then the issue's
criteria with their numbers and pass/fail: ``full+chunked`` peak <= 12 GiB at >= 0.97x ``hf_full``;
``chunked`` alone: peak drop against ``none``.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=src python3 benchmarks/head_bench.py --out "$OUT"
Writes ``head_bench.json`` (info + rows + criteria) to ``--out``; prints one JSON line per result
and a table last. About 2 minutes on an H100.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import statistics

import torch

import remat
from remat.api import current_plan
from remat.prove.bench import timed_steps
from remat.treat.chunked_loss import default_chunk_tokens
from remat.integrations.presets import build_model, load_config

from _args import bench_parser  # benchmarks/_args.py, beside this script

GiB = 2 ** 30
PEAK_LIMIT_GIB = 12.0
SPEED_VS_HF_FULL = 0.97


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--chunks", default="1024,4096,8192", help="extra chunk sizes for full+chunked")
    p.add_argument("--only", default="", help="comma-separated subset of strategy names")
    return p.parse_args(argv)


def strategies(chunks):
    def none(m):
        pass

    def hf_full(m):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    todo = {"none": none, "hf_full": hf_full, "full": lambda m: remat.apply(m, "full"),
            "full+chunked": lambda m: remat.apply(m, "full", head="chunked"),
            "chunked": lambda m: remat.apply(m, "keep", head="chunked")}
    for c in chunks:
        todo[f"full+chunked:{c}"] = lambda m, c=c: remat.apply(m, "full", head="chunked", chunk_tokens=c)
    return todo


def run(name, setup, args, config):
    gc.collect()
    torch.cuda.empty_cache()
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    setup(model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to("cuda")

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss  # the outputs die here, before backward
        loss.backward()
        return loss.detach()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, loss = timed_steps(step, args.steps)
    peak = torch.cuda.max_memory_allocated()
    med = statistics.median(times)
    row = dict(strategy=name, peak_GiB=peak / GiB, static_GiB=static / GiB, step_s=med,
               step_s_min=min(times), step_s_max=max(times), tok_s=args.batch * args.seq / med,
               loss=float(loss), model=args.model, batch=args.batch, seq=args.seq)
    plan = current_plan(model)
    if plan is not None and plan.head == "chunked":
        row.update(chunk_tokens=plan.chunk_tokens or default_chunk_tokens(config.vocab_size))
    del model, ids, loss
    gc.collect()
    torch.cuda.empty_cache()
    return row


def criteria(rows):
    by = {r["strategy"]: r for r in rows if "error" not in r}
    out = []
    none, hf, fc, ch = by.get("none"), by.get("hf_full"), by.get("full+chunked"), by.get("chunked")
    if fc and hf:
        speed = fc["tok_s"] / hf["tok_s"]
        out.append(dict(criterion=f"full+chunked peak <= {PEAK_LIMIT_GIB} GiB and >= {SPEED_VS_HF_FULL}x hf_full",
                        peak_GiB=fc["peak_GiB"], hf_full_peak_GiB=hf["peak_GiB"], speed_vs_hf_full=speed,
                        passed=fc["peak_GiB"] <= PEAK_LIMIT_GIB and speed >= SPEED_VS_HF_FULL))
    if ch and none:
        out.append(dict(criterion="chunked head alone: peak drop against eager (reported)",
                        peak_GiB=ch["peak_GiB"], none_peak_GiB=none["peak_GiB"],
                        drop_GiB=none["peak_GiB"] - ch["peak_GiB"], speed_vs_none=ch["tok_s"] / none["tok_s"]))
    if none:
        worst = max((abs(r["loss"] - none["loss"]) / abs(none["loss"]) for r in by.values()), default=0.0)
        out.append(dict(criterion="every loss within 1e-2 relative of eager's (bf16)", worst_rel=worst,
                        passed=worst <= 1e-2))
    return out


def main(argv=None):
    args = parse_args(argv)
    import transformers
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                transformers=transformers.__version__, remat=remat.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                args=vars(args))
    print(json.dumps(info), flush=True)
    config = load_config(args.model)
    todo = strategies([int(c) for c in args.chunks.split(",") if c])
    names = [n for n in args.only.split(",") if n] or list(todo)
    rows = []
    for name in names:
        try:
            rows.append(run(name, todo[name], args, config))
        except Exception as e:  # an OOM or a refusal is itself a result; keep going
            rows.append(dict(strategy=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    by = {r["strategy"]: r for r in rows if "error" not in r}
    for r in rows:
        if "error" not in r:
            for ref in ("none", "hf_full"):
                if ref in by:
                    r[f"vs_{ref}"] = r["tok_s"] / by[ref]["tok_s"]
            if "none" in by:
                r["loss_rel_vs_none"] = abs(r["loss"] - by["none"]["loss"]) / abs(by["none"]["loss"])
    checks = criteria(rows)
    for c in checks:
        print(json.dumps(c), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "head_bench.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, criteria=checks), f, indent=1)
    print(f"{'strategy':22s} {'peak GiB':>9s} {'tok/s':>8s} {'vs none':>8s} {'vs hf':>7s} {'loss':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']:22s} {r['error'][:70]}")
            continue
        print(f"{r['strategy']:22s} {r['peak_GiB']:9.2f} {r['tok_s']:8.0f} {r.get('vs_none', float('nan')):8.3f} "
              f"{r.get('vs_hf_full', float('nan')):7.3f} {r['loss']:9.5f}")
    for c in checks:
        verdict = "" if "passed" not in c else ("PASS" if c["passed"] else "FAIL")
        print(f"{verdict:4s} {c['criterion']}: " + ", ".join(
            f"{k}={v:.3f}" for k, v in c.items() if isinstance(v, float)))


if __name__ == "__main__":
    main()
