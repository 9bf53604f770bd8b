"""Redraw every committed plot under ``benchmarks/results/`` from the records beside it (no GPU).

    python benchmarks/plots.py            # all of them
    python benchmarks/plots.py headline   # only the README's headline frontier

- ``issue6/bench.png``, the README's headline: the bench model on one H200 with the stock strategies
  and remat's eager plans of ``issue6/bench.jsonl`` (the README's table under the plot) and remat's
  compiled plans of ``issue11/h200_frontier/frontier.json`` (the README's H200 compiled figures),
  each row's speed its ratio to no checkpointing in its own run; remat's uniform specs
  (``remat:full`` ...) stay in the tables, not on this plot.
- ``issue28/longctx.png``: tokens/s per length from ``issue28/longctx_run*.jsonl`` in run order, the
  last run of a length winning (``benchmarks/longctx.py --plot``).
- every ``frontier.png`` beside a ``frontier.json`` (``benchmarks/frontier.py``'s worst-of-N records),
  and every other ``X.png`` beside an ``X.jsonl`` (``remat bench``'s ``bench.png`` and ``bench.jsonl``).

All through :mod:`remat.prove.plot`, so a plot drawn here reads as ``remat bench`` draws it.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


HEADLINE = os.path.join(RESULTS, "issue6", "bench.png")
LONGCTX = os.path.join(RESULTS, "issue28", "longctx.png")


def headline(out: str = HEADLINE) -> str:
    from remat.prove import plot
    records, title, note = headline_records()
    why = plot.plot(records, out, title=title, note=note)
    if why:
        raise SystemExit(why)
    return out


def headline_records() -> tuple:
    """``(records, title, note)`` of the headline plot (the module docstring says which)."""
    from remat.prove import plot
    eager_run = [r for r in _jsonl(os.path.join(RESULTS, "issue6", "bench.jsonl"))
                 if not r["strategy"].startswith("remat:")]
    with open(os.path.join(RESULTS, "issue11", "h200_frontier", "frontier.json")) as f:
        compiled_run = [r for r in json.load(f)["records"] if plot.group(r) == "remat+compile"]
    first = eager_run[0]
    title = (f"{first['model']} (DESIGN.md's bench model), batch {first['batch']} x {first['seq']}, bf16, one "
             f"{first['gpu']}: up and to the left is better")
    note = ("Stock strategies and remat's eager plans: benchmarks/results/issue6/bench.jsonl (2026-11-26); remat's "
            "compiled plans and torch.compile with remat's mask fix: issue11/h200_frontier (2026-11-27). "
            "Speeds are each row's ratio to no checkpointing in its own run.")
    return eager_run + compiled_run, title, note


def longctx(out: str = LONGCTX) -> str:
    sys.path.insert(0, HERE)
    from longctx import plot as longctx_plot
    runs = glob.glob(os.path.join(RESULTS, "issue28", "longctx_run*.jsonl"))
    runs.sort(key=lambda p: int(re.search(r"run(\d+)", os.path.basename(p)).group(1)))
    return longctx_plot(runs, out)


def frontiers() -> list:
    from remat.prove import plot
    made = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "**", "frontier.json"), recursive=True)):
        png = os.path.join(os.path.dirname(path), "frontier.png")
        if not os.path.exists(png):
            continue
        with open(path) as f:
            summary = json.load(f)
        runs = len(summary.get("runs", [])) or 1
        first = summary["records"][0]
        title = (f"{first.get('model')}, batch {first.get('batch')} x {first.get('seq')}, {first.get('gpu')}, "
                 f"{f'worst of {runs} runs' if runs > 1 else 'one run'}: up and to the left is better")
        if plot.plot(summary["records"], png, title=title) is None:
            made.append(png)
    for png in sorted(glob.glob(os.path.join(RESULTS, "**", "*.png"), recursive=True)):
        records = png[:-len(".png")] + ".jsonl"  # remat bench's bench.png beside its bench.jsonl, or any X.png/X.jsonl
        if png.endswith(os.sep + "frontier.png") or png in (HEADLINE, LONGCTX) or not os.path.exists(records):
            continue
        if plot.plot(_jsonl(records), png) is None:
            made.append(png)
    return made


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    made = [headline()]
    if argv != ["headline"]:
        made += [longctx()] + frontiers()
    print("\n".join(os.path.relpath(p, HERE) for p in made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
