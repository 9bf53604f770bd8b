"""The memory/throughput frontier plot of bench records, drawn to be read at a glance.

Peak memory is on x and throughput (each row's ratio to no checkpointing, measured in its own run)
on y, so up and to the left is better. Four series: stock strategies (grey circles), stock
``torch.compile`` rows (grey diamonds), remat's eager plans (blue squares) and remat's plans under
``torch.compile`` (orange diamonds), each remat series with its frontier drawn as a staircase.
Budgets are dashed vertical lines, named with their unit ("10 GiB") on an axis above the plot, where
no point or label can cover them; no checkpointing's speed is a dotted horizontal line.

Rows are named as users know them (:data:`DISPLAY_NAMES`: ``hf_full`` is "HF gradient
checkpointing", ``compile_0.5`` "torch.compile, memory budget 0.5"), and a remat plan by its budget
and series ("10 GiB plan"), the series told by colour and the legend. Every label carries its ratio.

Labels are placed, not nudged: once the axes are laid out, each label tries positions around its
point, nearest first (right, left, above, below, then further out with a leader line), and takes
the first whose box overlaps no label already placed, no marker and not the legend, inside the
axes; :func:`overlaps` checks a drawn figure for any that remain (a test runs
it on the committed records). A far-off point (``save_on_cpu``, far below the rest) is drawn at the bottom
edge with its ratio and an arrow, so it does not squash the rest.

matplotlib is optional: without it :func:`plot` returns why it drew nothing.
"""
from __future__ import annotations

import re
from typing import Optional

GiB = 2 ** 30

DISPLAY_NAMES = {
    "eager": "no checkpointing",
    "hf_full": "HF gradient checkpointing",
    "hf_reentrant": "HF gradient checkpointing (reentrant)",
    "every2": "checkpoint every 2nd layer",
    "sac": "HF + op-level SAC",
    "save_on_cpu": "save_on_cpu (offload all)",
    "hf_every2": "HF checkpointing, every_n_layers=2",
    "hf_offload": "HF checkpointing, offload=True",
    "liger": "Liger fused loss",
    "cce": "Apple cut cross-entropy",
    "compile_1": "torch.compile",
    "compile_1+mask_skip": "torch.compile + remat's mask fix",
}
"""The names users know for the bench's strategy names (:mod:`remat.prove.strategies`); see
:func:`display_name` for the patterns (``compile_<b>``, ``remat:<spec>``, ``remat@<budget>``)."""


def display_name(strategy: str) -> str:
    """A strategy's name as a person reads it: ``hf_full`` -> ``HF gradient checkpointing``,
    ``compile_0.5`` -> ``torch.compile, memory budget 0.5``, ``remat:full+chunked`` -> ``remat
    full + chunked head``, ``remat@10GiB`` -> ``10 GiB plan``; unknown names are returned as given."""
    if strategy in DISPLAY_NAMES:
        return DISPLAY_NAMES[strategy]
    compiled = re.fullmatch(r"compile_([0-9.]+)", strategy)
    if compiled:
        return f"torch.compile, memory budget {compiled.group(1)}"
    planned = re.fullmatch(r"remat(\+compile)?@(.+)", strategy)
    if planned:
        budget = re.sub(r"([0-9.]+)\s*([KMGT]i?B)", r"\1 \2", planned.group(2))
        return f"{budget} plan" if budget != "auto" else "plan at the free memory"
    if strategy.startswith("remat:"):
        spec = strategy[len("remat:"):].replace("+chunked", " + chunked head")
        return f"remat {spec}" if not spec.startswith("keep + ") else f"remat {spec[len('keep + '):]} only"
    return strategy


def group(record: dict) -> str:
    """Which series a row is drawn in: ``stock``, ``stock+compile``, ``remat`` (eager) or ``remat+compile``."""
    if record.get("kind") != "remat":
        return "stock+compile" if record.get("compiled") or str(record.get("strategy")).startswith("compile_") \
            else "stock"
    return "remat+compile" if record.get("compiled") else "remat"


SERIES = {
    "stock": dict(marker="o", color="0.45", label="stock strategies"),
    "stock+compile": dict(marker="D", color="0.45", label="stock torch.compile", facecolors="none"),
    "remat": dict(marker="s", color="tab:blue", label="remat (eager)"),
    "remat+compile": dict(marker="D", color="tab:orange", label="remat + torch.compile"),
}


def plot(records: list, path: str, title: str = "", predicted: bool = False, note: str = "") -> Optional[str]:
    """Write the frontier PNG of ``records`` to ``path``; returns None on success or the reason it was not
    drawn. ``predicted``: the records are the planner's predictions, not measurements, and the axes say
    so. ``note``: a line under the plot (where the records come from)."""
    try:
        figure, _ = draw(records, title=title, predicted=predicted, note=note)
    except ImportError:
        return "matplotlib is not installed (pip install 'remat[plot]')"
    if figure is None:
        return "no strategy ran"
    import matplotlib.pyplot as plt
    figure.savefig(path)
    plt.close(figure)
    return None


def draw(records: list, title: str = "", predicted: bool = False, note: str = "") -> tuple:
    """``(figure, labels)``: the frontier of ``records`` drawn and its point labels placed (the
    matplotlib ``Text`` of each), or ``(None, [])`` when no row ran. Raises ImportError without
    matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return None, []
    largest = max(max(r["peak_bytes"], r.get("reserved_peak_bytes") or 0) for r in ok)
    scale, unit = (GiB, "GiB") if largest >= GiB else (2 ** 20, "MiB")
    eager = next((r for r in ok if r["strategy"] == "eager"), None)
    norm = eager["tokens_per_s"] if eager else 1.0
    ys = {id(r): r.get("vs_eager", r["tokens_per_s"] / norm) for r in ok}  # a row's own same-run ratio
    floor = _axis_floor(sorted(ys.values()))
    figure, ax = plt.subplots(figsize=(11, 6.6), dpi=120)
    points, stairs = [], []  # (x, y drawn, row, series); the frontiers' staircases, which labels keep off
    for kind, style in SERIES.items():
        rows = sorted((r for r in ok if group(r) == kind), key=lambda r: r["peak_bytes"])
        if not rows:
            continue
        style = dict(style)
        face = style.pop("facecolors", None)
        xs = [r["peak_bytes"] / scale for r in rows]
        drawn = [max(ys[id(r)], floor) for r in rows]
        ax.scatter(xs, drawn, s=55, zorder=3, edgecolors=style["color"], facecolors=face or style["color"],
                   linewidths=1.5, **{k: v for k, v in style.items() if k != "color"})
        if kind.startswith("remat"):
            frontier = [(x, max(y, floor)) for x, y in _frontier([(x, ys[id(r)]) for x, r in zip(xs, rows)])]
            ax.step([x for x, _ in frontier], [y for _, y in frontier], where="post",
                    color=style["color"], alpha=0.35, linewidth=1.5, zorder=2)
            stairs.append([p for (x0, y0), (x1, _) in zip(frontier, frontier[1:]) for p in ((x0, y0), (x1, y0))]
                          + frontier[-1:])
        points += [(x, y, r, kind) for x, y, r in zip(xs, drawn, rows)]
        reserved = [(x, y, r) for x, y, r in zip(xs, drawn, rows) if r.get("reserved_peak_bytes")]
        for x, y, r in reserved:   # the reserved peak beside the allocated one: what the card must hold
            ax.plot([x, r["reserved_peak_bytes"] / scale], [y, y], color=style["color"], alpha=0.4, linewidth=1)
        if reserved:
            ax.scatter([r["reserved_peak_bytes"] / scale for *_, r in reserved], [y for _, y, _ in reserved], s=40,
                       zorder=3, facecolors="none", edgecolors=style["color"], marker=style.get("marker", "o"))
    if any(r.get("reserved_peak_bytes") for r in ok):
        ax.scatter([], [], s=40, facecolors="none", edgecolors="0.3", marker="o", label="hollow: reserved peak")
    for size in sorted({r["card_bytes"] for r in records if r.get("card_bytes")}):
        ax.axvline(size / scale, color="tab:red", linewidth=1.2, alpha=0.7, zorder=1)
        ax.annotate(f"card {_size(size)}", (size / scale, 0.96), xytext=(3, 0), textcoords="offset points",
                    xycoords=("data", "axes fraction"), fontsize=7.5, color="tab:red")
    for index, r in enumerate(r for r in records if r.get("status") == "oom"):
        x = (r.get("card_bytes") or r.get("oom_reserved_peak_bytes") or 0) / scale   # where the card ran out
        ax.scatter([x], [floor + 0.01], marker="x", color="tab:red", s=50, zorder=4,
                   label="out of memory on the card" if index == 0 else None)
        ax.annotate(f"{display_name(r['strategy'])}: oom", (x, floor + 0.01), textcoords="offset points",
                    xytext=(-5, 6 + 9 * index), ha="right", fontsize=7, color="tab:red")
    if eager:
        ax.axhline(1.0, color="0.6", linestyle=":", linewidth=1, zorder=1)
    top = max(ys.values())
    low = min(max(y, floor) for y in ys.values())
    span = max(top - low, 0.05)
    ax.set_ylim(bottom=max(0.0, low - 0.08 * span - 0.02), top=top + 0.06 * span + 0.03)  # room for labels
    cards = [r["card_bytes"] / scale for r in records if r.get("card_bytes")]
    ax.set_xlim(left=0, right=max([x for x, *_ in points] + [largest / scale] + cards) * 1.1)
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    said = "predicted " if predicted else ""
    ax.set_xlabel(f"{said}peak memory ({unit}): lower is better")
    ax.set_ylabel(f"{said}throughput vs no checkpointing (1.0 = {norm:,.0f} tokens/s"
                  f"{', predicted' if predicted else ''})" if eager else f"{said}tokens / s")
    first = ok[0]
    ax.set_title(title or f"{first.get('model')}, batch {first.get('batch')} x {first.get('seq')}, "
                          f"on {first.get('gpu') or first.get('device')}: up and to the left is better")
    ax.grid(alpha=0.3)
    legend = ax.legend(loc="lower right", fontsize=8.5, framealpha=0.95)
    if note:
        import textwrap
        note = "\n".join(textwrap.wrap(note, 190))
        figure.text(0.01, 0.01, note, fontsize=7, color="0.35", va="bottom")
    lines = note.count("\n") + 1 if note else 0
    for budget in budgets:
        ax.axvline(budget / scale, color="tab:blue", linestyle="--", linewidth=0.8, alpha=0.4, zorder=1)
    if budgets:  # named above the axes, where no point or label can sit on them
        top_axis = ax.secondary_xaxis("top")
        top_axis.set_xticks([b / scale for b in budgets], labels=[_size(b) for b in budgets], fontsize=7.5,
                            color="tab:blue")
        top_axis.tick_params(colors="tab:blue", length=3)
        top_axis.set_xlabel("budgets the plans were made for (dashed)", fontsize=8, color="tab:blue")
    labels = [ax.annotate(_label(r, ys[id(r)], floor), (x, y), fontsize=7.5, color=SERIES[kind]["color"],
                          textcoords="offset points", xytext=(0, 0), zorder=4,
                          arrowprops=dict(arrowstyle="-", color=SERIES[kind]["color"], alpha=0.5, linewidth=0.7,
                                          shrinkA=1, shrinkB=5))
              for x, y, r, kind in points]
    for text in labels:
        text.set_in_layout(False)
    figure.tight_layout(rect=(0, 0.025 * lines, 1, 1))
    place_labels(figure, ax, labels, [(x, y) for x, y, *_ in points], obstacles=[legend], lines=stairs)
    return figure, labels


def _label(record: dict, ratio: float, floor: float) -> str:
    name = display_name(record["strategy"])
    return f"{name} {ratio:.2f}x" + (" (below the axis)" if ratio < floor else "")


def _size(n: int) -> str:
    from remat.units import format_size
    return format_size(n).replace(".00 ", " ")


# --- label placement ------------------------------------------------------------------------

NEAR = [(7, 0, "left", "center"), (-7, 0, "right", "center"), (5, 6, "left", "bottom"), (5, -6, "left", "top"),
        (-5, 6, "right", "bottom"), (-5, -6, "right", "top"), (0, 8, "center", "bottom"), (0, -8, "center", "top")]
"""Offsets (points) around a marker a label tries first: right, left, the four diagonals, above, below."""
FAR = [(dx * k, dy * k, ha, va) for k in (3, 5, 7) for dx, dy, ha, va in
       ((6, 6, "left", "bottom"), (6, -6, "left", "top"), (-6, 6, "right", "bottom"), (-6, -6, "right", "top"),
        (0, 8, "center", "bottom"), (0, -8, "center", "top"), (9, 0, "left", "center"), (-9, 0, "right", "center"))]
"""Further out, each with a leader line to its point, where no near offset is free."""
MARKER_PX = 7  # half the side of the box a marker takes, in pixels (s=55 at 120 dpi)
PAD_PX = 1.5


def place_labels(figure, ax, labels: list, points: list, obstacles: list = (), markers: Optional[list] = None,
                 lines: list = ()) -> None:
    """Move each of ``labels`` (annotations in offset points, with a leader line in their
    ``arrowprops``) about its point of ``points`` (data coordinates) to the first offset of
    :data:`NEAR` then :data:`FAR` whose box is inside ``ax`` and overlaps no label placed before it,
    no marker (``markers``: every point drawn, ``points`` by default) and none of ``obstacles`` (a
    legend), nor crosses ``lines`` (polylines in data coordinates, as lists of points, so a label does
    not sit on a curve); where none is free, the offset that overlaps least. Higher points are placed first.
    The leader line shows only for a label placed away from its point. Call it once the figure's
    layout is final (after ``tight_layout``): it places in pixels."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    taken = [_box(o, renderer) for o in obstacles]
    markers = [_marker_box(ax, point) for point in (points if markers is None else markers)]
    markers += [box for line in lines for box in _line_boxes(ax, line)]
    for text, _ in sorted(zip(labels, points), key=lambda pair: -pair[1][1]):  # top first
        best = None
        for far, (dx, dy, ha, va) in [(False, o) for o in NEAR] + [(True, o) for o in FAR]:
            text.set_position((dx, dy))
            text.set_ha(ha)
            text.set_va(va)
            box = _text_box(text, renderer)
            cost = sum(_overlap(box, other) for other in taken + markers)  # its own marker too
            cost += _outside(box, inside)
            if best is None or cost < best[0]:
                best = (cost, far, dx, dy, ha, va)
            if cost == 0:
                break
        _, far, dx, dy, ha, va = best
        text.set_position((dx, dy))
        text.set_ha(ha)
        text.set_va(va)
        text.arrow_patch.set_visible(far)  # a leader line only where the label sits away from its point
        taken.append(_text_box(text, renderer))


def overlaps(figure, labels: list, points: Optional[list] = None) -> list:
    """Pairs of labels (their texts) whose boxes overlap in ``figure`` as drawn, labels cut by the axes'
    edge (``(label text, "outside the axes")``) and labels that cover a marker of ``points`` other than
    their own (``(label text, "marker at (x, y)")``); empty when every label reads on its own."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = [(_text_box(t, renderer), t) for t in labels]
    found = [(a.get_text(), b.get_text()) for i, (box, a) in enumerate(boxes) for other, b in boxes[i + 1:]
             if _overlap(box, other) > 0]
    ax = labels[0].axes if labels else None
    if ax is not None:
        inside = ax.get_window_extent(renderer)
        found += [(t.get_text(), "outside the axes") for box, t in boxes if _outside(box, inside) > 0]
    if points:
        for (box, text), own in zip(boxes, points):
            for point in points:
                if point != own and _overlap(box, _marker_box(ax, point)) > 0:
                    found.append((text.get_text(), f"marker at {point}"))
    return found


def _text_box(text, renderer):
    from matplotlib.text import Text
    return Text.get_window_extent(text, renderer)  # the text alone, not its leader line


def _box(artist, renderer):
    from matplotlib.text import Text
    return _text_box(artist, renderer) if isinstance(artist, Text) else artist.get_window_extent(renderer)


def _marker_box(ax, point):
    from matplotlib.transforms import Bbox
    x, y = ax.transData.transform(point)
    return Bbox.from_extents(x - MARKER_PX, y - MARKER_PX, x + MARKER_PX, y + MARKER_PX)


def _line_boxes(ax, line: list, step_px: float = 4.0, half_px: float = 1.5) -> list:
    """Small boxes every ``step_px`` along a polyline (data coordinates), for labels to keep off it."""
    from matplotlib.transforms import Bbox
    pixels = ax.transData.transform(line)
    boxes = []
    for (x0, y0), (x1, y1) in zip(pixels[:-1], pixels[1:]):
        steps = max(1, int(((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5 / step_px))
        for i in range(steps + 1):
            x, y = x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps
            boxes.append(Bbox.from_extents(x - half_px, y - half_px, x + half_px, y + half_px))
    return boxes


def _overlap(a, b) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0) + PAD_PX
    height = min(a.y1, b.y1) - max(a.y0, b.y0) + PAD_PX
    return width * height if width > 0 and height > 0 else 0.0


def _outside(box, inside) -> float:
    """How much of ``box`` lies outside ``inside`` (weighted: a label cut by the axes does not read)."""
    spill = (max(0, inside.x0 - box.x0) + max(0, box.x1 - inside.x1) + max(0, inside.y0 - box.y0)
             + max(0, box.y1 - inside.y1))
    return spill * 1000.0


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
