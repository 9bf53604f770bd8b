"""The registry zoo sweep (issue 29): every model type transformers maps to a training head, every
treatment with the plain and the chunked head, and ``remat.plan``.

    make zoo
    PYTHONPATH=src .venv/bin/python benchmarks/zoo_sweep.py [--models llama,bert] [--workers 2]
        [--timeout 900] [--out benchmarks/results/zoo]

The models and batches are ``tests/registry_zoo.py``'s, the checks ``tests/registry_cells.py``'s; each model
type runs in a process of its own with one intra-op thread, ``--workers`` at a time, and is
stopped after ``--timeout`` seconds, so that one hanging or crashing model cannot stop the sweep
(its unfinished cells are FAIL with the reason). A cell is ``exact`` (``torch.equal`` everywhere
over two SGD steps, fp32, dropout on), ``~1e-07`` (the chunked head: within fp32 rounding, the
largest norm-wise relative difference shown), ``refused [n]`` (remat raised a ValueError/TypeError
before touching the model; footnote n is its first line), ``refused late [n]`` (in the first step, with
remat taken off the model), ``FAIL [n]`` (anything else) or the
model is listed as not built with the harness's reason.

Writes ``registry.jsonl`` (one record per cell: model, class, head kind, column, head, verdict,
detail, largest relative difference, seconds, versions, date), ``registry.md`` (one row per
model type, refusals and failures as footnotes, the not-built models grouped by reason) and
``registry.meta.json`` (the sweep's wall time, workers, date, later ``--merge`` runs) under
``--out``, and prints the summary the README quotes. ``--merge --models a,b`` runs those model
types again and replaces only their records (after a fix, without the whole sweep). A
correctness table, not a benchmark: the seconds say where the sweep's time went, nothing is
compared on them. Limits: a hung model is stopped only at its timeout, and a sweep at two
workers takes about half an hour on two cores (29 min on 2026-12-01).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
MARK = "ZOO-CELL "
from registry_cells import SWEEP_TREATMENTS as COLUMNS  # noqa: E402 - found through the path above


def worker(model_type: str) -> None:
    """Run every cell of one model type here, printing each as a marked JSON line."""
    import dataclasses

    import torch
    torch.set_num_threads(1)
    import registry_cells
    with registry_cells.quiet():
        registry_cells.run_model(model_type, emit=lambda cell: print(
            MARK + json.dumps(dataclasses.asdict(cell)), flush=True))


def _run_one(model_type: str, timeout: float) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model_type], env=env,
                              capture_output=True, text=True, timeout=timeout)
        out, err, reason = done.stdout, done.stderr, None
        if done.returncode != 0:
            last = [line for line in err.splitlines() if line.strip()][-1:] or [""]
            reason = f"worker exited with status {done.returncode}: {last[0][:200]}"
    except subprocess.TimeoutExpired as expired:
        def text(value):
            return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
        out, err = text(expired.stdout), text(expired.stderr)
        reason = f"timeout: the model's cells ran past {timeout:.0f} s"
    cells = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    if reason is not None:
        done_columns = [(c["column"], c["head"]) for c in cells]
        cells.append({"model": model_type, "column": "after " + (
            f"{done_columns[-1][0]}/{done_columns[-1][1]}" if done_columns else "start"),
            "head": "plain", "verdict": "FAIL", "detail": reason, "max_rel": 0.0,
            "seconds": time.perf_counter() - start})
    return cells


def sweep(model_types, workers: int, timeout: float, progress=print) -> list:
    cells = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_one, t, timeout): t for t in model_types}
        for future in concurrent.futures.as_completed(futures):
            found = future.result()
            cells.extend(found)
            verdicts = {}
            for cell in found:
                verdicts[cell["verdict"]] = verdicts.get(cell["verdict"], 0) + 1
            progress(f"{futures[future]}: {verdicts}")
    return cells


# ----------------------------------------------------------------------------- the table

class Notes:
    """Footnotes: one number per distinct first line."""

    def __init__(self):
        self.numbers = {}

    def __call__(self, text: str) -> int:
        return self.numbers.setdefault(text, len(self.numbers) + 1)


def _short(cell: dict, notes: Notes) -> str:
    verdict = cell["verdict"]
    if verdict == "exact":
        return "exact"
    if verdict == "rounding":
        return f"~{cell['max_rel']:.0e}"
    label = verdict if verdict in ("refused", "refused late") else "**FAIL**"
    return f"{label} [{notes(cell['detail'])}]"


def summary(cells, model_types) -> dict:
    built = {c["model"] for c in cells if c["verdict"] != "not built"}
    counts = {"model types": len(model_types), "built": len(built),
              "not built": len({c["model"] for c in cells if c["verdict"] == "not built"}), "cells": 0}
    for cell in cells:
        if cell["verdict"] != "not built":
            counts["cells"] += 1
            counts[cell["verdict"]] = counts.get(cell["verdict"], 0) + 1
    return counts


def table(cells, entries) -> str:
    by_model = {}
    for cell in cells:
        by_model.setdefault(cell["model"], []).append(cell)
    refusals, failures = Notes(), Notes()
    lines = ["| model | head (class) | chunked head | " + " | ".join(f"{c} (plain · chunked)" for c in COLUMNS)
             + " | plan |", "|" + "---|" * (len(COLUMNS) + 4)]
    not_built = {}
    for model in sorted(by_model):
        found = by_model[model]
        if any(c["verdict"] == "not built" for c in found):
            not_built.setdefault(found[0]["detail"], []).append(model)
            continue
        entry = entries.get(model)
        grid = {(c["column"], c["head"]): c for c in found}

        def text(column, head):
            cell = grid.get((column, head))
            if cell is None:
                return "-"
            notes = refusals if cell["verdict"] in ("refused", "refused late") else failures
            return _short(cell, notes)
        head_alone = grid.get(("keep", "chunked"))
        chunked_off = head_alone is not None and head_alone["verdict"] in ("refused", "refused late")
        row = [model, f"{entry.head} ({entry.class_name})" if entry else "?", text("keep", "chunked")]
        for column in COLUMNS:
            row.append(text(column, "plain") if chunked_off else f"{text(column, 'plain')} · {text(column, 'chunked')}")
        plan = grid.get(("plan", "plain")) or grid.get(("plan", "chunked"))
        row.append(text("plan", plan["head"]) if plan else "-")
        extra = [c for c in found if c["column"].startswith("after ")]
        if extra:
            row[-1] += " " + " ".join(_short(c, failures) for c in extra)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "A treatment cell is the plain head's result, then the chunked head's; where the chunked head "
              "is refused for the model (its own column), the plain head's only.", ""]
    if refusals.numbers:
        lines += ["Refusals (remat's first line):", ""]
        lines += [f"{n}. {text}" for text, n in refusals.numbers.items()] + [""]
    if failures.numbers:
        lines += ["Failures:", ""]
        lines += [f"{n}. {text}" for text, n in failures.numbers.items()] + [""]
    if not_built:
        lines += ["Not built (the harness could not build the model; not a remat failure):", ""]
        for reason, models in sorted(not_built.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"- {', '.join(sorted(models))}: {reason}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model types (default: every one the registry maps)")
    parser.add_argument("--workers", type=int, default=2, help="model processes at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model type (default 900)")
    parser.add_argument("--out", help="folder for registry.jsonl and registry.md")
    parser.add_argument("--merge", action="store_true",
                        help="replace only these models' records in --out's earlier sweep (after a fix)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    import torch
    import transformers

    import registry_zoo
    entries = registry_zoo.registry()
    names = args.models.split(",") if args.models else list(entries)
    unknown = [n for n in names if n not in entries]
    if unknown:
        parser.error(f"unknown model types {unknown}")
    if args.merge and not (args.out and os.path.exists(os.path.join(args.out, "registry.jsonl"))):
        parser.error("--merge needs --out with the registry.jsonl of an earlier sweep")
    start = time.perf_counter()
    cells = sweep(names, args.workers, args.timeout, progress=lambda line: print(line, file=sys.stderr, flush=True))
    wall = time.perf_counter() - start
    import remat
    stamp = {"torch": torch.__version__, "transformers": transformers.__version__, "remat": remat.__version__,
             "date": datetime.date.today().isoformat(), "device": "cpu", "dtype": "float32"}
    meta = {"wall_s": round(wall), "workers": args.workers, "date": stamp["date"], "merged": []}
    records = [{**cell, "class": entries[cell["model"]].class_name, "head_kind": entries[cell["model"]].head, **stamp}
               for cell in cells]
    if args.merge:  # the earlier sweep's records, these models' replaced
        with open(os.path.join(args.out, "registry.jsonl")) as f:
            records = [r for r in map(json.loads, f) if r["model"] not in names] + records
        with open(os.path.join(args.out, "registry.meta.json")) as f:
            meta = {**json.load(f)}
        meta["merged"] = meta["merged"] + [{"date": stamp["date"], "models": names, "wall_s": round(wall)}]
    swept = sorted({r["model"] for r in records})
    counts = summary(records, swept)
    text = table(records, entries)
    merged = sum(len(m["models"]) for m in meta["merged"])
    header = (f"# Registry zoo\n\nEvery model type of transformers {transformers.__version__}'s causal LM, seq2seq LM, "
              f"masked LM, image classification and image-text-to-text mappings, built from its config class's "
              f"defaults with sizes shrunk (`tests/registry_zoo.py`), two SGD steps beside an untouched copy, fp32 "
              f"CPU, dropout 0.1, torch {torch.__version__}. Generated by `make zoo` "
              f"(`benchmarks/zoo_sweep.py`) in {meta['wall_s'] / 60:.0f} min with {meta['workers']} workers on "
              f"{meta['date']}" + (f" ({merged} model types run again with `--merge` since)" if merged else "")
              + ".\n\nCounts: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".\n\n")
    print(header + text)
    print(json.dumps(counts), file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "registry.md"), "w") as f:
            f.write(header + text)
        with open(os.path.join(args.out, "registry.jsonl"), "w") as f:
            for record in sorted(records, key=lambda r: (r["model"], r["column"], r["head"])):
                f.write(json.dumps(record) + "\n")
        with open(os.path.join(args.out, "registry.meta.json"), "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
