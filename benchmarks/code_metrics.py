"""Issue 43's numbers for a checkout: what costs the next engineer who adds a treatment or an option.

    python3 benchmarks/code_metrics.py [ROOT]      # ROOT: a checkout (default: this one)

Prints, from the source alone (``ast``; nothing is imported):

- functions over 80 lines in ``src/remat``, with and without their docstrings (a contract's Args count);
- positional parameters on the profiling path (``profiling/profiler.py`` and ``_measure.py``, where the
  issue found settings passed by position; ``self``/``cls`` left out) and the most in one function;
- string comparisons in ``_treated_forward`` (a treatment chosen by its name, not its fields);
- copies of the "train beside an untouched copy" oracle in ``tests/`` (``assert_same_step`` and
  ``compare`` defined outside ``tests/oracle.py`` that do not call it);
- module-docstring lines in ``src/remat``, and the modules whose docstring is over 30 lines;
- imports of private remat names in ``tests/`` (``from remat... import _x``, a ``_module`` in the path).
"""
import ast
import pathlib
import sys


PROFILING_PATH = ("profiling/profiler.py", "profiling/_measure.py")  # where the issue counted settings passed by position


def _docstring_lines(function) -> int:
    first = function.body[0] if function.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def metrics(root: pathlib.Path) -> dict:
    src, tests = root / "src" / "remat", root / "tests"
    long_functions, long_code, doc_lines, long_docs = [], [], 0, []
    positional, most_positional, string_branches = 0, (0, ""), 0
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(src)
        doc = ast.get_docstring(tree, clean=False)
        if doc:
            lines = doc.count("\n") + 1
            doc_lines += lines
            if lines > 30:
                long_docs.append(f"{rel} ({lines})")
        for f in _functions(tree):
            if f.end_lineno - f.lineno + 1 > 80:
                long_functions.append(f"{rel}:{f.name} ({f.end_lineno - f.lineno + 1})")
            if f.end_lineno - f.lineno + 1 - _docstring_lines(f) > 80:
                long_code.append(f"{rel}:{f.name} ({f.end_lineno - f.lineno + 1 - _docstring_lines(f)})")
            if str(rel) in PROFILING_PATH:
                names = [a.arg for a in f.args.posonlyargs + f.args.args if a.arg not in ("self", "cls")]
                positional += len(names)
                most_positional = max(most_positional, (len(names), f"{rel}:{f.name}"))
            if f.name == "_treated_forward":
                string_branches += sum(
                    1 for n in ast.walk(f) if isinstance(n, ast.Compare)
                    and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in [n.left, *n.comparators]))
    oracle_copies, private_imports = [], 0
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path.name != "oracle.py":
            oracle_copies += [f"{path.name}:{f.name}" for f in _functions(tree)
                              if f.name in ("assert_same_step", "compare") and f.col_offset == 0
                              and "oracle.compare" not in ast.unparse(f)]   # a wrapper of the oracle is no copy
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat"):
                private_path = any(part.startswith("_") for part in node.module.split("."))
                private_imports += len(node.names) if private_path else sum(a.name.startswith("_") for a in node.names)
            elif isinstance(node, ast.Import):
                private_imports += sum(a.name.startswith("remat") and any(p.startswith("_") for p in a.name.split("."))
                                       for a in node.names)
    return {
        "functions over 80 lines": len(long_functions), "  which": long_functions,
        "functions over 80 lines less their docstring": len(long_code), "  which (code)": long_code,
        "positional parameters, profiling path": positional, "  most in one function": most_positional,
        "string comparisons in _treated_forward": string_branches,
        "oracle copies in tests": len(oracle_copies), "  where": oracle_copies,
        "module-docstring lines": doc_lines, "module docstrings over 30 lines": len(long_docs), "  over 30": long_docs,
        "private remat imports in tests": private_imports,
    }


if __name__ == "__main__":
    for key, value in metrics(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")).items():
        print(f"{key}: {value}")
