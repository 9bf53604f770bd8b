"""Print the zoo table (issue 10): architecture x treatment, each cell what tests/test_zoo.py checks.

    PYTHONPATH=src .venv/bin/python benchmarks/zoo_table.py [--models llama,gpt2] [--out zoo.md]

A cell is "exact" (loss, every parameter gradient and every buffer ``torch.equal`` to an
untouched copy over two training steps, fp32, dropout on), "refused (no mlp)" (the blocks
have no such sub-module and ``remat.apply`` said so), "refused (in-place ...)" (``selective`` on a
block that adds into a kept matmul output in place), or "FAIL: <first line of the error>".
The last column is ``remat.plan`` on the fake-tensor path. Models that cannot be built
with the installed libraries (timm absent, a class missing from an older transformers)
are listed under the table with the reason. The models and the checks are
``tests/zoo.py``'s, so the table and the tests cannot drift apart; this is a correctness
table, not a benchmark: nothing is timed. The sweep over every model type transformers maps
to a training head (``make zoo``) is ``benchmarks/zoo_sweep.py``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zoo  # noqa: E402


def _short(error: BaseException, width: int = 70) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".replace("|", "/")
    return text if len(text) <= width else text[: width - 3] + "..."


def cell(check, *args) -> str:
    """One table cell; :class:`zoo.Unavailable` propagates."""
    try:
        result = check(*args)
    except zoo.Unavailable:
        raise
    except ValueError as error:
        if "modifies in place" in str(error):   # selective's clear refusal (see README "Known limit")
            return "refused (in-place add into a kept matmul output)"
        return f"FAIL: {_short(error)}"
    except Exception as error:  # the table reports every failure instead of stopping
        return f"FAIL: {_short(error)}"
    if result == "refused":
        return f"refused (no {args[1]})"
    return "exact" if isinstance(result, str) else "ok"


def table(names) -> tuple:
    """(markdown lines, {name: reason} of the cases that could not be built)."""
    header = ["model", *zoo.TREATMENTS, "plan"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    unavailable = {}
    for name in names:
        try:
            row = [cell(zoo.run_treatment, name, spec) for spec in zoo.TREATMENTS]
            row.append(cell(zoo.run_plan, name))
        except zoo.Unavailable as reason:
            unavailable[name] = str(reason)
            continue
        lines.append(f"| {name} | " + " | ".join(row) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines, unavailable


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated zoo names (default: all)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else sorted(zoo.CASES)
    unknown = [n for n in names if n not in zoo.CASES]
    if unknown:
        parser.error(f"unknown zoo models {unknown}; known: {', '.join(sorted(zoo.CASES))}")
    import torch
    import transformers
    lines, unavailable = table(names)
    lines += ["", f"torch {torch.__version__}, transformers {transformers.__version__}, CPU fp32, "
                  "two training steps with dropout on."]
    lines += [f"Not built: {name} ({reason})." for name, reason in unavailable.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
