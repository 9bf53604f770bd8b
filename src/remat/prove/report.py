"""Bench records -> a markdown table and a memory/throughput frontier plot.

The plot puts peak GiB on x and tokens/s on y, so "up and to the left" is better:
anchors are grey circles, remat's eager rows blue squares, remat+compile rows orange
diamonds, budgets are dashed vertical lines, and eager's throughput is a dotted horizontal line.
Where the records have a reserved peak (CUDA), a hollow marker on the same line shows it beside the
allocated one; an emulated card is a red vertical line, and a row that ran out of memory on it a red
cross at the bottom, named. Everything is labelled, so the picture reads without the table. matplotlib is optional: without it only the table is
written, and the command says so.
"""
from __future__ import annotations

from typing import Optional

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


def group(record: dict) -> str:
    """Which series a row is drawn in: ``stock``, ``remat`` (eager) or ``remat+compile``."""
    if record.get("kind") != "remat":
        return "stock"
    return "remat+compile" if record.get("compiled") else "remat"


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


def plot(records: list, path: str, title: str = "", predicted: bool = False) -> Optional[str]:
    """Write the frontier PNG; returns None on success or the reason it was not drawn. ``predicted``:
    the records are the planner's predictions, not measurements, and the axes say so."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'remat[plot]')"
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return "no strategy ran"
    largest = max(max(r["peak_bytes"], r.get("reserved_peak_bytes") or 0) for r in ok)
    scale, unit = (GiB, "GiB") if largest >= GiB else (2 ** 20, "MiB")
    eager = next((r for r in ok if r["strategy"] == "eager"), None)
    norm = eager["tokens_per_s"] if eager else 1.0
    # a row's own same-process ratio where it has one (worst-of-N records carry the worst ratio)
    ys = {id(r): r.get("vs_eager", r["tokens_per_s"] / norm) for r in ok}
    # a far-off point (save_on_cpu at 0.14x) would squash the rest: clip the axis, mark it below
    floor = _axis_floor(sorted(ys.values()))
    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    styles = {"stock": dict(marker="o", color="0.45", label="stock strategies"),
              "remat": dict(marker="s", color="tab:blue", label="remat (eager)"),
              "remat+compile": dict(marker="D", color="tab:orange", label="remat + torch.compile")}
    placed = []
    for kind, style in styles.items():
        rows = sorted((r for r in ok if group(r) == kind), key=lambda r: r["peak_bytes"])
        if not rows:
            continue
        xs = [r["peak_bytes"] / scale for r in rows]
        ax.scatter(xs, [max(ys[id(r)], floor) for r in rows], s=55, zorder=3, **style)
        frontier = _frontier([(x, ys[id(r)]) for x, r in zip(xs, rows)])
        ax.step([x for x, _ in frontier], [max(y, floor) for _, y in frontier], where="post",
                color=style["color"], alpha=0.35, linewidth=1.5)
        for x, r in zip(xs, rows):
            y = ys[id(r)]
            text = r["strategy"] if y >= floor else f"{r['strategy']} ({y:.2f}x) ↓"
            ax.annotate(text, (x, max(y, floor)), textcoords="offset points", xytext=_offset(x, y, placed, ax),
                        fontsize=7.5, color=style["color"])
        # the reserved peak beside the allocated one: what the card must hold
        reserved = [(x, r) for x, r in zip(xs, rows) if r.get("reserved_peak_bytes")]
        for x, r in reserved:
            y = max(ys[id(r)], floor)
            ax.plot([x, r["reserved_peak_bytes"] / scale], [y, y], color=style["color"], alpha=0.4, linewidth=1)
        if reserved:
            ax.scatter([r["reserved_peak_bytes"] / scale for _, r in reserved],
                       [max(ys[id(r)], floor) for _, r in reserved], s=40, zorder=3, facecolors="none",
                       edgecolors=style["color"], marker=style["marker"])
    if any(r.get("reserved_peak_bytes") for r in ok):
        ax.scatter([], [], s=40, facecolors="none", edgecolors="0.3", marker="o", label="hollow: reserved peak")
    cards = sorted({r["card_bytes"] for r in records if r.get("card_bytes")})
    for size in cards:
        ax.axvline(size / scale, color="tab:red", linewidth=1.2, alpha=0.7)
        ax.annotate(f"card {format_size(size)}", (size / scale, 0.96), xytext=(3, 0), textcoords="offset points",
                    xycoords=("data", "axes fraction"), fontsize=7.5, color="tab:red")
    failed = [r for r in records if r.get("status") == "oom"]
    for index, r in enumerate(failed):  # where a card ran out: at the card (or the peak it reached)
        x = (r.get("card_bytes") or r.get("oom_reserved_peak_bytes") or 0) / scale
        ax.scatter([x], [floor + 0.01], marker="x", color="tab:red", s=50, zorder=4,
                   label="out of memory on the card" if index == 0 else None)
        ax.annotate(f"{r['strategy']}: oom", (x, floor + 0.01), textcoords="offset points",
                    xytext=(-5, 6 + 9 * index), ha="right", fontsize=7, color="tab:red")
    if eager:
        ax.axhline(1.0, color="0.6", linestyle=":", linewidth=1)
    for budget in sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")}):
        ax.axvline(budget / scale, color="tab:blue", linestyle="--", linewidth=0.8, alpha=0.4)
        ax.annotate(f"budget {format_size(budget)}", (budget / scale, 1.0), xytext=(2, -2), textcoords="offset points",
                    xycoords=("data", "axes fraction"), va="top", fontsize=7, color="tab:blue", alpha=0.7)
    said = "predicted " if predicted else ""
    ax.set_xlabel(f"{said}peak memory ({unit}): allocated (filled), reserved (hollow)  — lower is better"
                  if any(r.get("reserved_peak_bytes") for r in ok) else f"{said}peak memory ({unit})  — lower is better")
    ax.set_ylabel(f"{said}throughput vs eager (eager = {norm:,.0f} tokens/s{', predicted' if predicted else ''})"
                  if eager else f"{said}tokens / s")
    ax.set_ylim(bottom=floor - 0.02 if floor > 0 else 0, top=max(ys.values()) * 1.04 + 0.02)  # room for labels
    first = ok[0]
    ax.set_title(title or f"{first.get('model')}, batch {first.get('batch')} x {first.get('seq')}, "
                          f"on {first.get('gpu') or first.get('device')}: up and to the left is better")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def _axis_floor(values: list) -> float:
    """Bottom of the y axis: below the cluster, leaving out a lone far-off slow point."""
    if len(values) > 2 and values[0] < 0.5 * values[1]:
        return max(0.0, values[1] - 0.08)
    return 0.0


def _frontier(points: list) -> list:
    """The upper-left staircase: each point faster than every point using less memory."""
    best, out = float("-inf"), []
    for x, y in sorted(points):
        if y > best:
            best = y
            out.append((x, y))
    return out


def _offset(x: float, y: float, placed: list, ax) -> tuple:
    """A label offset (points) that avoids labels already placed nearby (a greedy nudge)."""
    span_x = max(ax.get_xlim()[1], 1e-9)
    dy = 4
    for px, py, pdy in placed:
        if abs(px - x) < 0.06 * span_x and abs(py - y) < 0.02:
            dy = min(dy, pdy - 9)
    placed.append((x, y, dy))
    return (5, dy)
