"""What a compiled profile says, beside what compiled uniform plans measure (issue 11's 32 GiB gap).

On an H100 the planner's ``remat+compile@32GiB`` plan (16x selective, chunked head) measured
1.023x eager, below eager remat at the same budget (1.051x) and below ``Module.compile()``
alone (1.054x at 34.88 GiB): the compiled profile did not make ``keep`` look worth its memory.
This script shows, in one process on the bench model (``llama-1b`` preset, bf16, 4 x 4096):

- the compiled profile itself (``remat.profile(model, batch, compile=True)``), written whole to
  ``--out/profile_compiled.json`` and printed as a table: per treatment the forward and backward
  seconds, the bytes kept to backward and the two peaks; per head option its seconds and peak;
- ``eager`` and ``compile_1`` (``torch.compile`` alone) as anchors;
- uniform plans run compiled (``--uniform``, default ``keep+chunked,selective+chunked,keep``:
  ``remat.apply(model, spec, head=...)`` then ``model.compile()``), each beside
  ``remat.simulate``'s prediction from the compiled profile: where a prediction misses, the
  profile (not the solver) is wrong;
- the planner's compiled plans at ``--budgets`` from that one profile.

Rows are measured by :func:`remat.prove.bench.measure` (the bench's protocol: fresh model, two
warm-up steps that compile, five timed). Records go to ``--out/compile_probe.jsonl``.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 benchmarks/compile_probe.py --out "$OUT" --budgets 32GiB,45GiB
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import bench_parser  # noqa: E402  benchmarks/_args.py, beside this script

import remat  # noqa: E402
from remat.presets import build_model, load_config  # noqa: E402
from remat.head.chunked_loss import default_chunk_tokens  # noqa: E402
from remat.prove.bench import _relate, environment, measure  # noqa: E402
from remat.prove.strategies import Strategy, _compiled  # noqa: E402
from remat.units import format_size, parse_budget  # noqa: E402


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.set_defaults(model="llama-1b", batch=4, seq=4096)
    p.add_argument("--budgets", default="32GiB,45GiB", help="compiled plans at these budgets")
    p.add_argument("--uniform", default="keep+chunked,selective+chunked,keep",
                   help="uniform specs run compiled; '+chunked' adds the chunked head")
    p.add_argument("--anchors", default="eager,compile_1", help="anchor rows (eager, compile_1)")
    return p.parse_args(argv)


def _split(spec: str):
    return (spec[: -len("+chunked")], "chunked") if spec.endswith("+chunked") else (spec, "plain")


def _uniform_compiled(spec: str, prof):
    treatment, head = _split(spec)

    def prepare(model, batch):
        chunk = default_chunk_tokens(model.config.vocab_size) if head == "chunked" else None
        sim = remat.simulate(prof, treatment, head=head, chunk_tokens=chunk)  # the chunk apply uses
        remat.apply(model, treatment, head="chunked" if head == "chunked" else None)
        model.compile()
        notes = {"predicted_peak_bytes": int(sim.peak_bytes), "predicted_step_s": round(sim.step_s, 5)}
        return model, contextlib.nullcontext, None, notes
    return prepare


def _planned_compiled(budget: int, prof):
    def prepare(model, batch):
        plan = remat.plan(model, batch, budget, compile=True, profiled=prof)
        remat.apply(model, plan)
        model.compile()
        return model, contextlib.nullcontext, plan
    return prepare


def profile_table(prof) -> list:
    """One line per block-class treatment and head option: seconds and bytes as the planner reads them."""
    lines = [f"{'treatment':<14} {'fwd ms':>8} {'bwd ms':>8} {'kept':>10} {'fwd peak':>10} {'bwd peak':>10}"]
    for index, costs in enumerate(prof.classes):
        for name, c in costs.items():
            lines.append(f"{name:<14} {c.fwd_s * 1e3:8.2f} {c.bwd_s * 1e3:8.2f} {format_size(c.kept):>10} "
                         f"{format_size(c.fwd_peak):>10} {format_size(c.bwd_peak):>10}"
                         + (f"  (class {index})" if len(prof.classes) > 1 else ""))
    for h in prof.heads:
        what = h.mode + (f"({h.chunk_tokens})" if h.mode == "chunked" else "")
        fields = {k: v for k, v in vars(h).items() if k not in ("mode", "chunk_tokens")}
        lines.append(f"head {what:<14} " + ", ".join(
            f"{k}={v * 1e3:.2f}ms" if k.endswith("_s") else f"{k}={format_size(v)}" for k, v in fields.items()))
    return lines


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    config = load_config(args.model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1234)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    os.makedirs(args.out, exist_ok=True)
    shared = dict(environment(device), model=args.model, batch=args.batch, seq=args.seq, dtype="bfloat16")

    def build():
        return build_model(config, device=device, dtype=dtype)

    model = build()
    prof = remat.profile(model, batch, compile=True)
    del model
    torch.cuda.empty_cache()
    with open(os.path.join(args.out, "profile_compiled.json"), "w") as f:
        json.dump(prof.to_dict(), f, default=str)
    print("\n".join(profile_table(prof)), flush=True)
    print("calibration:", prof.notes.get("calibration"), flush=True)

    anchors = {"eager": Strategy("eager", "anchor", lambda m, b: (m, contextlib.nullcontext, None)),
               "compile_1": Strategy("compile_1", "anchor", _compiled(1.0), compiled=True)}
    rows = [anchors[a] for a in args.anchors.split(",") if a]
    rows += [Strategy(f"remat+compile:{s}", "remat", _uniform_compiled(s, prof), compiled=True)
             for s in args.uniform.split(",") if s]
    rows += [Strategy(f"remat+compile@{b}", "remat", _planned_compiled(parse_budget(b), prof),
                      budget_bytes=parse_budget(b), compiled=True) for b in args.budgets.split(",") if b]
    records = []
    for strategy in rows:
        record = dict(shared, **measure(build, strategy, batch, warmup=args.warmup, steps=args.steps))
        _relate(record, records)
        records.append(record)
        with open(os.path.join(args.out, "compile_probe.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        print(_line(record), flush=True)


def _line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['strategy']}: {r.get('status')} {r.get('reason', '')[:200]}"
    predicted = ""
    if "predicted_step_s" in r:
        predicted = (f" | predicted {format_size(r['predicted_peak_bytes'])}, {r['predicted_step_s']:.4f} s"
                     f" (time err {r['step_s'] / r['predicted_step_s'] - 1:+.1%})")
    return (f"{r['strategy']}: {format_size(r['peak_bytes'])}, {r['step_s']:.4f} s, "
            f"{r.get('vs_eager', 1.0):.3f}x eager{predicted} {r.get('plan', '')}")


if __name__ == "__main__":
    main()
