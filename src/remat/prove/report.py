"""Bench records -> a markdown table and a memory/throughput frontier plot.

The plot puts peak GiB on x and tokens/s on y, so "up and to the left" is better:
anchors are grey circles, remat's rows are blue squares, budgets are dashed vertical
lines, and eager's throughput is a dotted horizontal line. Everything is labelled, so the
picture reads without the table. matplotlib is optional: without it only the table is
written, and the command says so.
"""
from __future__ import annotations

from typing import Optional

from remat.units import format_size

GiB = 2 ** 30


def markdown(records: list, title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    first = records[0] if records else {}
    if first:
        lines.append(f"{first.get('model')} batch {first.get('batch')} x {first.get('seq')} "
                     f"{first.get('dtype')}, {first.get('gpu') or first.get('device')}, torch "
                     f"{first.get('torch')}, transformers {first.get('transformers')}, remat "
                     f"{first.get('remat')}, {first.get('date')}")
        lines.append("")
    lines.append("| strategy | budget | peak | predicted peak | tokens/s (spread) | vs eager | "
                 "predicted step s | loss = eager | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        budget = format_size(r["budget_bytes"]) if r.get("budget_bytes") else ""
        if r.get("status") != "ok":
            lines.append(f"| {r['strategy']} | {budget} | {r.get('status')} | | | | | | "
                         f"{_cell(r.get('reason', ''))} |")
            continue
        predicted = format_size(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else ""
        pred_time = f"{r['predicted_step_s']:.3f}" if r.get("predicted_step_s") else ""
        spread = (f"{r['tokens_per_s']:.0f} ({r['tokens_per_s'] * r['step_s'] / r['step_s_max']:.0f}"
                  f"–{r['tokens_per_s'] * r['step_s'] / r['step_s_min']:.0f})")
        vs = f"{r['vs_eager']:.3f}" if "vs_eager" in r else ""
        equal = "" if "loss_equal_eager" not in r else ("yes" if r["loss_equal_eager"]
                                                        else f"diff {r['loss_diff_eager']:.2g}")
        notes = []
        if r.get("budget_bytes"):
            notes.append("under budget" if r["peak_bytes"] <= r["budget_bytes"] else "OVER BUDGET")
        if r.get("plan"):
            notes.append(r["plan"])
        lines.append(f"| {r['strategy']} | {budget} | {format_size(r['peak_bytes'])} | {predicted} | {spread} | {vs} | "
                     f"{pred_time} | {equal} | {_cell('; '.join(notes))} |")
    return "\n".join(lines) + "\n"


def budget_table(records: list) -> str:
    """At each budget: the fastest stock strategy that fits beside remat's plan for it."""
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    eager = next((r for r in records if r["strategy"] == "eager" and r.get("status") == "ok"), None)
    if not budgets or eager is None:
        return ""
    anchors = [r for r in records if r["kind"] == "anchor" and r.get("status") == "ok"]
    lines = ["| budget | best stock strategy that fits | remat | remat peak | remat vs best stock |",
             "|---|---|---|---|---|"]
    for budget in budgets:
        fits = [r for r in anchors if r["peak_bytes"] <= budget]
        best = max(fits, key=lambda r: r["tokens_per_s"], default=None)
        mine = next((r for r in records if r.get("budget_bytes") == budget and r["kind"] == "remat"), None)
        best_text = f"{best['strategy']} {best['vs_eager'] if 'vs_eager' in best else 1.0:.3f}x" if best else "none fits"
        if mine is None or mine.get("status") != "ok":
            mine_text, peak, versus = (mine or {}).get("status", "not run"), "", ""
        else:
            mine_text = f"{mine['vs_eager']:.3f}x eager"
            over = mine["peak_bytes"] > budget
            peak = format_size(mine["peak_bytes"]) + (" OVER BUDGET" if over else "")
            versus = f"{mine['tokens_per_s'] / best['tokens_per_s']:.3f}x" if best else "only remat fits"
        lines.append(f"| {format_size(budget)} | {best_text} | {mine_text} | {peak} | {versus} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:160]


def plot(records: list, path: str, title: str = "") -> Optional[str]:
    """Write the frontier PNG; returns None on success or the reason it was not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'remat[plot]')"
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return "no strategy ran"
    scale, unit = (GiB, "GiB") if max(r["peak_bytes"] for r in ok) >= GiB else (2 ** 20, "MiB")
    eager = next((r for r in ok if r["strategy"] == "eager"), None)
    norm = eager["tokens_per_s"] if eager else 1.0
    ys = {id(r): r["tokens_per_s"] / norm for r in ok}
    # a far-off point (save_on_cpu at 0.14x) would squash the rest: clip the axis, mark it below
    floor = _axis_floor(sorted(ys.values()))
    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    styles = {"anchor": dict(marker="o", color="0.45", label="stock strategies"),
              "remat": dict(marker="s", color="tab:blue", label="remat")}
    placed = []
    for kind, style in styles.items():
        rows = sorted((r for r in ok if r["kind"] == kind), key=lambda r: r["peak_bytes"])
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
    if eager:
        ax.axhline(1.0, color="0.6", linestyle=":", linewidth=1)
    for budget in sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")}):
        ax.axvline(budget / scale, color="tab:blue", linestyle="--", linewidth=0.8, alpha=0.4)
        ax.annotate(f"budget {budget / scale:g}", (budget / scale, 1.0), xytext=(2, -2), textcoords="offset points",
                    xycoords=("data", "axes fraction"), va="top", fontsize=7, color="tab:blue", alpha=0.7)
    ax.set_xlabel(f"peak memory ({unit})  — lower is better")
    ax.set_ylabel(f"throughput vs eager (eager = {norm:,.0f} tokens/s)" if eager else "tokens / s")
    ax.set_ylim(bottom=floor - 0.02 if floor > 0 else 0)
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
