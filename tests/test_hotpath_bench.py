"""benchmarks/hotpath_bench.py runs on the CPU (the plumbing: every part records, none fails), and
``--src`` runs it once per remat source tree, each in its own process, records labelled."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_part_records_for_each_source_tree(tmp_path):
    out = tmp_path / "hotpath.jsonl"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hotpath_bench.py"), "--device", "cpu", "--model",
                    "llama-tiny", "--batch", "2", "--seq", "32", "--rounds", "1", "--calls", "1",
                    "--src", f"a={ROOT / 'src'}", "--src", f"b={ROOT / 'src'}", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in records if r.get("status") == "error"], records
    parts = {(r["label"], r["part"], r.get("targets")) for r in records}
    for label in ("a", "b"):
        assert {(label, "head", "device"), (label, "head", "host"), (label, "step", None), (label, "guard", None),
                (label, "guard_trainer", None)} <= parts
    assert all(r["remat_path"] == str(ROOT / "src" / "remat") for r in records)
