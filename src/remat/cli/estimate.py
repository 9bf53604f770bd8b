"""``remat estimate``: predicted peak and speed of every uniform treatment and head mode.

One profile (see :mod:`remat.profiling.profiler`), then :func:`remat.simulate` per strategy, so
the whole table costs about as much as one plan. With ``--budget`` the planned plan is
the last row, or, when nothing fits, a line naming the smallest budget that does.

``--json`` prints one JSON object on stdout and nothing else: the model and shapes,
``rows`` (one object per strategy, bytes and seconds as numbers) and, with
``--budget``, ``budget`` (``fits``, and the plan, or the smallest budget that fits and
its plan). A row's peak is what the simulator predicts with copies on time; where an
offloading row could peak higher when copies run late, the table's last column says so
(``bound_bytes`` in JSON; the same as ``peak_bytes`` when nothing is offloaded).
"""
from __future__ import annotations

from remat.cli.plan import (add_model_arguments, check_model_arguments, describe, no_fit_message, profile_from_args,
                            progress, solve_from_args, treatments_from_args, working)

HELP = "predicted peak and speed of every strategy (no GPU or weights needed)"
EXAMPLES = """examples:
  remat estimate --model llama-1b --batch 4 --seq 4096
  remat estimate --model llama-70b --batch 1 --seq 8192 --gpu h200 --fsdp 8 --budget 120GiB
  remat estimate --model llama-tiny --batch 2 --seq 128 --budget 4MiB --json
"""


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--budget", help="also plan for this budget (e.g. 24GiB) and show it last")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")


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


def _row(strategy, head, s) -> dict:
    stages = s.stages()
    return dict(strategy=strategy, head=head, peak_bytes=s.peak_bytes, bound_bytes=s.bound_bytes, step_s=s.step_s,
                tokens_per_s=s.tokens_per_s, peak_at=s.peak_at,
                **{f"{k}_s": round(v["seconds"], 5) for k, v in stages.items()})


def run(args) -> int:
    import json

    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits
    from remat.units import format_size, parse_budget
    budget = None if args.budget is None else parse_budget(args.budget)
    check_model_arguments(args)
    say = progress()
    prof, _, _ = profile_from_args(args, say)
    treatments = treatments_from_args(prof, args)
    with working(say, f"simulating {len(treatments)} treatments with each head"):
        table = rows(prof, treatments)
    summary, no_fit = None, None
    if budget is not None:
        try:
            plan = solve_from_args(prof, budget, treatments, say)
            label = plan.head if plan.head == "plain" else f"chunked({plan.chunk_tokens})"
            table.append(dict(_row(f"plan@{args.budget}", label, simulate(prof, plan)),
                              blocks=describe(plan)))
            summary = dict(budget_bytes=budget, fits=True, plan=plan.to_dict())
        except NoPlanFits as e:
            no_fit = no_fit_message(e, budget, args)
            summary = dict(budget_bytes=budget, fits=False, smallest_budget_bytes=e.smallest_peak,
                           smallest_plan=e.plan.to_dict(), message=no_fit)
    if args.json:
        print(json.dumps(dict(model=args.model, batch=args.batch, seq=args.seq, dtype=args.dtype,
                              optimizer=args.optimizer, fsdp=args.fsdp, gpu=prof.rates.name,
                              static_bytes=prof.static_bytes, rows=table, budget=summary)))
        return 0
    fastest = max(r["tokens_per_s"] for r in table) or 1.0
    print(f"{args.model}: batch {args.batch} x {args.seq}, {args.dtype}, optimizer {args.optimizer}, "
          f"rates {prof.rates.name}, static {format_size(prof.static_bytes)}")
    print(f"{'strategy':<16} {'head':<15} {'peak':>11} {'step s':>7} {'fwd/head/bwd s':>17} "
          f"{'tokens/s':>10} {'rel':>5}  peak set by")
    for r in table:
        stages = "/".join(f"{r.get(k + '_s', 0.0):.3f}" for k in ("forward", "head", "backward"))
        late = (f"; up to {format_size(r['bound_bytes'])} if copies run late"
                if r["bound_bytes"] != r["peak_bytes"] else "")
        print(f"{r['strategy']:<16} {r['head']:<15} {format_size(r['peak_bytes']):>11} "
              f"{r['step_s']:>7.3f} {stages:>17} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / fastest:>5.2f}  "
              f"{r['peak_at']}{late}")
    if summary and summary["fits"]:
        print(f"plan blocks: {table[-1]['blocks']}")
    if no_fit:
        print(f"plan@{args.budget}: {no_fit}")
    return 0
