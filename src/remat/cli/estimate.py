"""``remat estimate``: predicted peak and speed of every uniform treatment and head mode.

One profile (see :mod:`remat.profiling.profiler`), then :func:`remat.simulate` per strategy, so
the whole table costs about as much as one plan. With ``--budget`` the planned plan is
the last row.
"""
from __future__ import annotations

from remat.cli.plan import add_model_arguments, describe, profile_from_args, treatments_from_args

HELP = "predicted peak and speed of every strategy (no GPU or weights needed)"
EXAMPLES = """examples:
  remat estimate --model llama-1b --batch 4 --seq 4096
  remat estimate --model llama-70b --batch 1 --seq 8192 --gpu h200 --budget 120GiB
"""


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--budget", help="also plan for this budget (e.g. 24GiB) and show it last")
    parser.add_argument("--json", action="store_true", help="one JSON line per row")


def rows(prof, treatments) -> list:
    from remat.planning.simulator import simulate
    out = []
    for head in prof.heads:
        if head.mode == "chunked" and head is not prof.head("chunked"):
            continue  # one chunk size per table: the profiled largest
        label = head.mode if head.mode == "plain" else f"chunked({head.chunk_tokens})"
        for t in treatments:
            s = simulate(prof, t, head=head.mode, chunk_tokens=head.chunk_tokens)
            out.append(_row(t, label, s))
    return out


def _row(strategy, head, s, **extra) -> dict:
    stages = s.stages()
    return dict(strategy=strategy, head=head, peak_bytes=s.peak_bytes, bound_bytes=s.bound_bytes, step_s=s.step_s,
                tokens_per_s=s.tokens_per_s, peak_at=s.peak_at,
                **{f"{k}_s": round(v["seconds"], 5) for k, v in stages.items()}, **extra)


def run(args) -> int:
    import json

    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits, solve
    from remat.units import format_size, parse_size
    prof = profile_from_args(args)
    treatments = treatments_from_args(prof, args)
    table = rows(prof, treatments)
    if args.budget:
        budget = parse_size(args.budget)
        try:
            plan = solve(prof, budget, treatments=treatments)
            label = plan.head if plan.head == "plain" else f"chunked({plan.chunk_tokens})"
            table.append(_row(f"plan@{args.budget}", label, simulate(prof, plan), blocks=describe(plan)))
        except NoPlanFits as e:
            table.append(dict(strategy=f"plan@{args.budget}", head="-", peak_bytes=e.smallest_peak,
                              bound_bytes=e.smallest_peak, step_s=0.0, tokens_per_s=0.0,
                              peak_at=f"does not fit (smallest budget that fits: {format_size(e.smallest_peak)})"))
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    fastest = max(r["tokens_per_s"] for r in table) or 1.0
    print(f"{args.model}: batch {args.batch} x {args.seq}, {args.dtype}, optimizer {args.optimizer}, "
          f"rates {prof.rates.name}, static {format_size(prof.static_bytes)}")
    print(f"{'strategy':<16} {'head':<15} {'peak':>11} {'at most':>11} {'step s':>7} {'fwd/head/bwd s':>17} "
          f"{'tokens/s':>10} {'rel':>5}  peak set by")
    for r in table:
        stages = "/".join(f"{r.get(k + '_s', 0.0):.3f}" for k in ("forward", "head", "backward"))
        bound = format_size(r["bound_bytes"]) if r["bound_bytes"] != r["peak_bytes"] else ""
        print(f"{r['strategy']:<16} {r['head']:<15} {format_size(r['peak_bytes']):>11} {bound:>11} "
              f"{r['step_s']:>7.3f} {stages:>17} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / fastest:>5.2f}  "
              f"{r['peak_at']}")
    if any(r.get("blocks") for r in table):
        print(f"plan blocks: {table[-1]['blocks']}")
    return 0
