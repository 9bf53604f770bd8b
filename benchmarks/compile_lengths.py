"""A run whose sequence length changes every step: does the chunked head's fused kernel stay on?

The chunked head runs each chunk's softmax and gradient as one fused kernel
(:mod:`remat.head.xent_kernel`: a Triton kernel whose grid is the rows, or where it does not
build one compiled by inductor for a padded, shape-stable chunk). A kernel compiled per shape
would recompile at every new length (2.4-3.6 s each on an H200) and, at dynamo's recompile limit, fall back to the slower
eager ops for the rest of the process (issue 11). This script trains the bench model on
``--lengths`` sequence lengths spread between ``--min-len`` and ``--max-len`` (20 between 512
and 8192 by default, most of them not multiples of anything), one length per step in a shuffled
order, twice over:

- pass 1 meets every length for the first time: its extra time over pass 2 is what compiling
  cost (``first_pass_overhead_s``); dynamo's own count of compile time
  (``torch._dynamo.utils.compilation_time_metrics``, every frame compiled in the run) is
  recorded beside it (``dynamo_compile_s``), with the number of graphs compiled;
- the fused path stayed on when no shape fell back to the eager ops (``EAGER_SHAPES`` of
  :mod:`remat.head.xent_kernel` is empty and remat warned nothing); ``fused_kernel`` says which
  kernel ran (Triton's compile time is not in dynamo's count: the pass-1 overhead has it);
- the plan is made for the longest length (``remat.plan(..., heads=["chunked"])``, with
  ``compile=True`` under ``--plan-compile``) and every step's peak is measured: the peak at
  the longest length must be within the plan's budget.

``--compile`` also runs ``model.compile()`` after ``remat.apply`` (the model's own compile
time then counts too; it is reported separately only through the pass-1 overhead).

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 benchmarks/compile_lengths.py --out "$OUT"
Writes ``compile_lengths.json`` (info, plan, per-step rows, criteria) to ``--out``.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import statistics
import time
import warnings

import torch

import remat
from remat.presets import build_model, load_config
from remat.units import format_size, parse_budget

from _args import bench_parser  # benchmarks/_args.py, beside this script

COMPILE_LIMIT_S = 15.0


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.set_defaults(batch=2)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--lengths", type=int, default=20, help="distinct sequence lengths (default 20)")
    p.add_argument("--budget", default="25GiB", help="the plan's budget, for the longest length")
    p.add_argument("--plan-compile", action="store_true", help="remat.plan(..., compile=True)")
    p.add_argument("--compile", action="store_true", help="model.compile() after remat.apply")
    return p.parse_args(argv)


def lengths(low: int, high: int, count: int) -> list:
    """``count`` distinct lengths from ``low`` to ``high`` inclusive, evenly spread, then made odd
    where they are not the ends (odd lengths are the worst case for a padded last chunk)."""
    if count < 2 or high <= low:
        raise ValueError(f"need at least 2 lengths and --max-len > --min-len; got {count}, {low}..{high}")
    out = []
    for i in range(count):
        n = round(low + i * (high - low) / (count - 1))
        if 0 < i < count - 1 and n % 2 == 0:
            n += 1
        out.append(n)
    return sorted(set(out))


def compile_metrics() -> dict:
    from torch._dynamo.utils import compilation_time_metrics, counters
    return dict(frames_s=sum(compilation_time_metrics.get("_compile.compile_inner", [])),
                frames=len(compilation_time_metrics.get("_compile.compile_inner", [])),
                graphs=counters["stats"]["unique_graphs"])


def main(argv=None):
    args = parse_args(argv)
    import transformers
    from remat.head import xent_kernel

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    budget = parse_budget(args.budget)
    info = dict(gpu=torch.cuda.get_device_name() if cuda else None, torch=torch.__version__,
                transformers=transformers.__version__, remat=remat.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), args=vars(args))
    print(json.dumps(info), flush=True)
    config = load_config(args.model)
    model = build_model(config, device=device, dtype=dtype)
    all_lengths = lengths(args.min_len, args.max_len, args.lengths)
    generator = torch.Generator().manual_seed(0)

    def batch_of(seq):
        ids = torch.randint(0, config.vocab_size, (args.batch, seq), generator=generator).to(device)
        return {"input_ids": ids, "labels": ids}

    torch._dynamo.reset()
    before = compile_metrics()
    plan_kwargs = {"heads": ["chunked"], **({"compile": True} if args.plan_compile else {})}
    start = time.perf_counter()
    plan = remat.plan(model, batch_of(max(all_lengths)), budget, **plan_kwargs)
    plan_s = time.perf_counter() - start
    remat.apply(model, plan)
    if args.compile:
        model.compile()
    after_plan = compile_metrics()  # planning may compile (profiling the compiled treatments)
    record = dict(info=info, lengths=all_lengths, budget_bytes=budget, plan=plan.summary(), plan_s=plan_s,
                  predicted_peak_bytes=plan.notes.get("predicted_peak_bytes"), rows=[])
    order = all_lengths[:]
    random.Random(0).shuffle(order)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for pass_index in (1, 2):
            for seq in order:
                batch = batch_of(seq)
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                loss = model(**batch).loss
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                row = dict(pass_=pass_index, seq=seq, step_s=time.perf_counter() - t, loss=float(loss.detach()),
                           peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                del loss, batch
    end = compile_metrics()
    first = {r["seq"]: r["step_s"] for r in record["rows"] if r["pass_"] == 1}
    second = {r["seq"]: r["step_s"] for r in record["rows"] if r["pass_"] == 2}
    overhead = sum(max(0.0, first[s] - second[s]) for s in first)
    remat_warnings = [str(w.message) for w in caught if "remat" in str(w.message)]
    eager_shapes = {str(k): v for k, v in xent_kernel.EAGER_SHAPES.items()}
    fused = "triton" if xent_kernel.KERNEL.get("triton") else "inductor" if xent_kernel.KERNEL.get("fn") else None
    kernel_made = fused is not None
    longest = max(all_lengths)
    peak_longest = max((r["peak_bytes"] or 0) for r in record["rows"] if r["seq"] == longest) if cuda else None
    record.update(
        first_pass_overhead_s=overhead,
        dynamo_compile_s=end["frames_s"] - after_plan["frames_s"], dynamo_frames=end["frames"] - after_plan["frames"],
        graphs=end["graphs"] - after_plan["graphs"], planning_compile_s=after_plan["frames_s"] - before["frames_s"],
        steady_step_s_median=statistics.median(second.values()), eager_shapes=eager_shapes, fused_kernel=fused,
        remat_warnings=remat_warnings, peak_bytes_longest=peak_longest,
        peak_bytes_max=max((r["peak_bytes"] or 0) for r in record["rows"]) if cuda else None)
    compile_s = max(overhead, record["dynamo_compile_s"])
    record["criteria"] = [
        dict(criterion="the fused kernel stays on for every length (no shape fell back to eager ops)",
             kernel_made=kernel_made,  # the fused kernel exists on CUDA only: n/a elsewhere
             passed=None if not cuda else (kernel_made and not eager_shapes
                                           and not any("could not be compiled" in w for w in remat_warnings))),
        dict(criterion=f"total compile time under {COMPILE_LIMIT_S:g} s (max of pass-1 overhead and dynamo's count)",
             compile_s=compile_s, passed=compile_s < COMPILE_LIMIT_S),
        dict(criterion="peak at the longest length within the plan's budget", peak_bytes=peak_longest,
             budget_bytes=budget, passed=None if peak_longest is None else peak_longest <= budget),
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_lengths.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"plan {plan.summary()} for {args.batch} x {longest} within {format_size(budget)} ({plan_s:.0f} s to plan)")
    print(f"compile: pass-1 overhead {overhead:.1f} s, dynamo {record['dynamo_compile_s']:.1f} s over "
          f"{record['dynamo_frames']} frames; steady step {record['steady_step_s_median']:.3f} s")
    for c in record["criteria"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["passed"]]
        print(f"{verdict:4s} {c['criterion']}")


if __name__ == "__main__":
    main()
