"""Bench records -> markdown tables, the worst of repeated runs, and (from :mod:`remat.prove.plot`) the plot.

The tables: every row (:func:`markdown`), the best stock strategy beside remat's best row at each budget
(:func:`budget_table`), the worst-of-N frontier per budget with its targets (:func:`frontier_table`).
:func:`combine_runs` makes one worst-case record per strategy from N fresh-process runs, and
:func:`monotone_violations` says where a measured frontier goes down as the budget goes up.
:func:`plot` draws the memory/throughput frontier (:mod:`remat.prove.plot`: a record's reserved peak
beside its allocated one, an emulated card and the rows that ran out of memory on it; matplotlib is
optional: without it only the tables are written, and the command says so).
"""
from __future__ import annotations

from typing import Optional

from remat.prove.plot import group, plot  # noqa: F401  (plot: the frontier PNG, remat.prove.report.plot)
from remat.units import format_size

GiB = 2 ** 30


def markdown(records: list, title: str = "") -> str:
    """The records as a markdown table: allocated and reserved peaks side by side, each row's card
    (where the run emulated one), its ratio to eager and to its ceiling, and "oom" where the card
    ran out (with the phase and the peaks reached)."""
    lines = [f"## {title}", ""] if title else []
    first = records[0] if records else {}
    if first:
        lines.append(f"{first.get('model')} batch {first.get('batch')} x {first.get('seq')} "
                     f"{first.get('dtype')}, {first.get('gpu') or first.get('device')}, torch "
                     f"{first.get('torch')}, transformers {first.get('transformers')}, remat "
                     f"{first.get('remat')}, {first.get('date')}" + _setting(records))
        lines.append("")
    carded = any("card_bytes" in r for r in records)
    lines.append("| strategy |" + (" card |" if carded else "") + " budget | peak allocated | peak reserved | "
                 "predicted peak | tokens/s (spread) | vs eager | vs ceiling | predicted step s | loss = eager | notes |")
    lines.append("|---" * (12 if carded else 11) + "|")
    for r in records:
        budget = format_size(r["budget_bytes"]) if r.get("budget_bytes") else ""
        card = [_card_text(r)] if carded else []
        if r.get("status") != "ok":
            status = f"**{r.get('status')}**" if r.get("status") == "oom" else str(r.get("status"))
            if r.get("phase") and r.get("status") in ("oom", "error"):
                status += f" ({r['phase']})"
            reached = [format_size(r[k]) + " at oom" if r.get(k) else "" for k in
                       ("oom_peak_bytes", "oom_reserved_peak_bytes")]
            lines.append("| " + " | ".join([r["strategy"], *card, budget, status if not reached[0] else
                                             f"{status}: {reached[0]}", reached[1], "", "", "", "", "", "",
                                             _cell(r.get("reason", ""))]) + " |")
            continue
        predicted = format_size(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else ""
        pred_time = f"{r['predicted_step_s']:.3f}" if r.get("predicted_step_s") else ""
        spread = (f"{r['tokens_per_s']:.0f} ({r['tokens_per_s'] * r['step_s'] / r['step_s_max']:.0f}"
                  f"–{r['tokens_per_s'] * r['step_s'] / r['step_s_min']:.0f})")
        vs = f"{r['vs_eager']:.3f}" if "vs_eager" in r else ""
        vs_ceiling = f"{r['vs_ceiling']:.3f}" if "vs_ceiling" in r else ""
        reserved = format_size(r["reserved_peak_bytes"]) if r.get("reserved_peak_bytes") else ""
        equal = "" if "loss_equal_eager" not in r else ("yes" if r["loss_equal_eager"]
                                                        else f"diff {r['loss_diff_eager']:.2g}")
        notes = []
        if r.get("budget_bytes"):
            notes.append("under budget" if r["peak_bytes"] <= r["budget_bytes"] else "OVER BUDGET")
            if r.get("reserved_peak_bytes") and r["reserved_peak_bytes"] > r["budget_bytes"]:
                notes.append("reserved over budget")
        if r.get("plan"):
            notes.append(r["plan"])
        if isinstance(r.get("verified"), dict) and len(r["verified"]["tries"]) > 1:
            over = r["verified"]["tries"][:-1]
            notes.append(f"solved again after {len(over)} plan(s) measured over budget in planning "
                         f"({', '.join(format_size(t['peak_bytes']) for t in over)})")
        if r.get("plans_differ"):
            notes.append("plans differ across runs")
        if r.get("method"):
            notes.append(r["method"])
        if r.get("compiled") and r.get("warmup_s") is not None:
            notes.append(f"compile + warm-up {r['warmup_s']:.0f} s")
        lines.append("| " + " | ".join([r["strategy"], *card, budget, format_size(r["peak_bytes"]), reserved, predicted,
                                         spread, vs, vs_ceiling, pred_time, equal, _cell("; ".join(notes))]) + " |")
    ceilings = sorted({r["ceiling"] for r in records if r.get("ceiling")})
    if ceilings:
        lines += ["", "vs ceiling: tokens/s as a fraction of the fastest no-recompute row that ran ("
                  + ", ".join(ceilings) + "; compiled rows against a compiled one)."]
    return "\n".join(lines) + "\n"


def _setting(records: list) -> str:
    """What the run was measured under: the card, the optimizer, the allocator's settings."""
    said = []
    cards = {r["card_bytes"] for r in records if r.get("card_bytes")}
    if cards:
        said.append("card " + "/".join(format_size(c) for c in sorted(cards)) + " (allocator capped; rows marked "
                    "'whole GPU' ran uncapped)")
    optimizers = {r.get("optimizer", "none") for r in records}
    if optimizers != {"none"}:
        said.append("optimizer " + "/".join(sorted(optimizers)))
    confs = {r.get("alloc_conf") for r in records if r.get("alloc_conf")}
    if confs:
        said.append("PYTORCH_CUDA_ALLOC_CONF=" + "/".join(sorted(confs)))
    return "; " + "; ".join(said) if said else ""


def _card_text(record: dict) -> str:
    if "card_bytes" not in record:
        return ""
    return format_size(record["card_bytes"]) if record["card_bytes"] else "whole GPU"


def budget_table(records: list) -> str:
    """At each budget: the fastest stock strategy that fits beside remat's best row for it.

    remat's row is the faster of ``remat@<budget>`` (eager) and ``remat+compile@<budget>`` among
    those whose measured peak is within the budget (the faster of all, marked OVER BUDGET, if
    none is); the stock strategies are every ``anchor`` row, compiled ones included."""
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    eager = next((r for r in records if r["strategy"] == "eager" and r.get("status") == "ok"), None)
    if not budgets or eager is None:
        return ""
    anchors = [r for r in records if r["kind"] == "anchor" and r.get("status") == "ok"]
    lines = ["| budget | best stock strategy that fits | remat (eager) | remat+compile | remat | remat peak | "
             "remat vs best stock |", "|---|---|---|---|---|---|---|"]
    for budget in budgets:
        fits = [r for r in anchors if r["peak_bytes"] <= budget]
        best = max(fits, key=lambda r: r["tokens_per_s"], default=None)
        mine = [r for r in records if r.get("budget_bytes") == budget and r["kind"] == "remat"]
        eager_plan = next((r for r in mine if not r.get("compiled")), None)
        compiled_plan = next((r for r in mine if r.get("compiled")), None)
        chosen = best_within(mine, budget)
        best_text = f"{best['strategy']} {_ratio(best):.3f}x" if best else "none fits"
        if chosen is None:
            mine_text, peak, versus = "not run" if not mine else "/".join(r.get("status", "?") for r in mine), "", ""
        else:
            mine_text = f"{chosen['strategy']} {_ratio(chosen):.3f}x"
            peak = format_size(chosen["peak_bytes"]) + (" OVER BUDGET" if chosen["peak_bytes"] > budget else "")
            versus = f"{chosen['tokens_per_s'] / best['tokens_per_s']:.3f}x" if best else "only remat fits"
        lines.append(f"| {format_size(budget)} | {best_text} | {_row_text(eager_plan, budget)} | "
                     f"{_row_text(compiled_plan, budget)} | {mine_text} | {peak} | {versus} |")
    return "\n".join(lines) + "\n"


def best_within(rows: list, budget: int) -> Optional[dict]:
    """The fastest ``ok`` row whose peak is within ``budget``; else the fastest ``ok`` row; else None."""
    ok = [r for r in rows if r.get("status") == "ok"]
    fits = [r for r in ok if r["peak_bytes"] <= budget]
    return max(fits or ok, key=lambda r: r["tokens_per_s"], default=None)


def _ratio(record: dict) -> float:
    return record.get("vs_eager", 1.0 if record.get("strategy") == "eager" else float("nan"))


def _row_text(record: Optional[dict], budget: int) -> str:
    if record is None:
        return ""
    if record.get("status") != "ok":
        return str(record.get("status"))
    over = " OVER" if record["peak_bytes"] > budget else ""
    return f"{_ratio(record):.3f}x, {format_size(record['peak_bytes'])}{over}"


# --- repeated runs: worst of N, and whether the measured frontier is monotone --------------

def combine_runs(runs: list) -> list:
    """One record per strategy from N runs' records (lists of dicts, as in bench.jsonl): the worst.

    A strategy that failed in any run (oom, error, skipped, or missing) is that failure in the
    combined record (``reason`` names the run); otherwise the record of its slowest run (by the
    same-process ratio to eager, else tokens/s), with the largest peak of all runs (and that
    run's predicted peak: where plans differ, the pair stays one plan's), the spread
    over all runs and per-run lists (``vs_eager_runs``, ``peak_bytes_runs``, ``plans``) beside
    it. ``plans_differ`` says whether the planner chose different plans across runs."""
    order, by = [], {}
    for records in runs:
        for r in records:
            if r["strategy"] not in by:
                order.append(r["strategy"])
                by[r["strategy"]] = [None] * len(runs)
    for index, records in enumerate(runs):
        for r in records:
            by[r["strategy"]][index] = r
    out = []
    for name in order:
        rows = by[name]
        present = [r for r in rows if r is not None]
        ok = [r for r in present if r.get("status") == "ok"]
        base = dict(present[0], n_runs=len(runs), runs_ok=len(ok))
        failed = [(i, r) for i, r in enumerate(rows) if r is None or r.get("status") != "ok"]
        if failed:
            index, bad = failed[0]
            base.update(status=bad.get("status") if bad else "missing",
                        reason=f"run {index + 1} of {len(runs)}: " + (bad.get("reason", "") if bad else "not run"))
            out.append(base)
            continue
        key = (lambda r: r["vs_eager"]) if all("vs_eager" in r for r in ok) else (lambda r: r["tokens_per_s"])
        worst = min(ok, key=key)
        combined = dict(worst, n_runs=len(runs), runs_ok=len(ok))
        highest = max(ok, key=lambda r: r["peak_bytes"])
        peak = highest["peak_bytes"]
        combined.update(peak_bytes=peak, peak_GiB=peak / GiB, step_s_min=min(r["step_s_min"] for r in ok),
                        step_s_max=max(r["step_s_max"] for r in ok),
                        tokens_per_s_runs=[r["tokens_per_s"] for r in ok],
                        peak_bytes_runs=[r["peak_bytes"] for r in ok])
        if "vs_eager" in worst:
            combined["vs_eager_runs"] = [r["vs_eager"] for r in ok]
        if any(r.get("plan") for r in ok):
            combined["plans"] = [r.get("plan") for r in ok]
            combined["plans_differ"] = len(set(combined["plans"])) > 1
        for k in ("predicted_peak_bytes", "predicted_step_s"):
            if any(k in r for r in ok):
                combined[f"{k}_runs"] = [r.get(k) for r in ok]
        if "predicted_peak_bytes" in highest:  # beside the largest peak, that run's own prediction
            combined["predicted_peak_bytes"] = highest["predicted_peak_bytes"]
        out.append(combined)
    return out


def monotone_violations(records: list, tolerance: float = 0.01) -> list:
    """Where the measured frontier goes down as the budget goes up (beyond ``tolerance``).

    Checked per series: remat's eager plans, remat+compile plans, and remat's best row per
    budget (:func:`best_within`); a point is a violation when its ratio to eager is below
    ``(1 - tolerance)`` times the best ratio at any smaller budget. Rows that did not run
    are left out here (the table shows them)."""
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    series = {"remat": {}, "remat+compile": {}, "best": {}}
    for budget in budgets:
        mine = [r for r in records if r.get("budget_bytes") == budget and r.get("kind") == "remat"]
        for r in mine:
            if r.get("status") == "ok":
                series[group(r)][budget] = r
        chosen = best_within(mine, budget)
        if chosen is not None:
            series["best"][budget] = chosen
    out = []
    for name, points in series.items():
        best_budget, best_ratio = None, float("-inf")
        for budget in sorted(points):
            ratio = points[budget].get("vs_eager", float("nan"))
            if best_budget is not None and ratio < (1 - tolerance) * best_ratio:
                out.append(dict(series=name, budget_bytes=budget, vs_eager=ratio, strategy=points[budget]["strategy"],
                                smaller_budget_bytes=best_budget, smaller_vs_eager=best_ratio))
            if ratio > best_ratio:
                best_budget, best_ratio = budget, ratio
    return out


def frontier_table(records: list, targets: Optional[dict] = None, stock_margin: float = 1.03) -> str:
    """Per budget, from worst-of-N records: remat's eager and compiled plans (the worst ratio and
    every run's), the best stock strategy that fits, and the targets where ``targets`` gives them
    (``{budget_bytes: {"remat": ratio, "remat+compile": ratio}}``; remat's best must also be
    ``stock_margin`` times the best stock strategy that fits)."""
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    if not budgets:
        return ""
    anchors = [r for r in records if r.get("kind") == "anchor" and r.get("status") == "ok"]
    lines = ["| budget | remat (eager): worst, runs | remat+compile: worst, runs | best stock that fits | "
             "remat best vs stock | plans stable | targets |", "|---|---|---|---|---|---|---|"]
    for budget in budgets:
        mine = [r for r in records if r.get("budget_bytes") == budget and r.get("kind") == "remat"]
        cells, verdicts = [], []
        for name in ("remat", "remat+compile"):
            row = next((r for r in mine if group(r) == name), None)
            cells.append(_runs_text(row, budget))
            target = (targets or {}).get(budget, {}).get(name)
            if target is not None:
                verdicts.append(f"{name} >= {target:g}: {_verdict(row, budget, target)}")
        best = max((r for r in anchors if r["peak_bytes"] <= budget), key=lambda r: r["tokens_per_s"], default=None)
        chosen = best_within(mine, budget)
        if chosen is not None and chosen["peak_bytes"] <= budget:
            versus = chosen.get("vs_eager", 0) / best.get("vs_eager", 1.0) if best else None
            versus_text = f"{versus:.3f}x" if versus is not None else "only remat fits"
            if targets and budget in targets:
                verdicts.append(f"vs stock >= {stock_margin:g}: "
                                f"{'PASS' if versus is None or versus >= stock_margin else 'FAIL'}")
        else:
            versus_text = "no remat row within budget"
        stable = {r.get("plans_differ") for r in mine if "plans_differ" in r}
        stable_text = "no (plans differ)" if True in stable else ("yes" if stable else "")
        best_text = f"{best['strategy']} {_ratio(best):.3f}x" if best else "none fits"
        lines.append(f"| {format_size(budget)} | {cells[0]} | {cells[1]} | {best_text} | {versus_text} | "
                     f"{stable_text} | {'; '.join(verdicts)} |")
    return "\n".join(lines) + "\n"


def _verdict(row: Optional[dict], budget: int, target: float) -> str:
    """PASS or FAIL, or why there is nothing to judge: a series these runs did not measure, or a
    row some run did not reach (its worst of N is unknown, which is neither a pass nor a fail)."""
    if row is None:
        return "not run"
    if row.get("status") == "missing":
        return "not shown (missing in a run)"
    ok = row.get("status") == "ok" and row["peak_bytes"] <= budget and row.get("vs_eager", 0) >= target
    return "PASS" if ok else "FAIL"


def _runs_text(row: Optional[dict], budget: int) -> str:
    if row is None:
        return ""
    if row.get("status") != "ok":
        return f"{row.get('status')} ({_cell(row.get('reason', ''))[:60]})"
    runs = ", ".join(f"{v:.3f}" for v in row.get("vs_eager_runs", []))
    over = " OVER BUDGET" if row["peak_bytes"] > budget else ""
    return f"{_ratio(row):.3f}x ({runs}), {format_size(row['peak_bytes'])}{over}"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:160]
