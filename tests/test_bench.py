"""The bench harness on the CPU: records, OOM as a result, the table and the plot."""
import json
import os

import pytest
import torch

from remat.prove import bench, report, strategies
from remat.cli import main


def test_bench_cli_writes_records_table_and_plot(tmp_path, capsys):
    out = tmp_path / "b"
    code = main(["bench", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--steps", "1",
                 "--warmup", "1", "--only", "eager,hf_full,remat:full,remat:mlp", "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in records] == ["eager", "hf_full", "remat:full", "remat:mlp"]
    for r in records:
        assert r["status"] == "ok", r
        assert r["peak_bytes"] > 0 and r["tokens_per_s"] > 0 and r["torch"] == torch.__version__
    eager, hf, full = records[:3]
    # full checkpointing keeps exactly what HF's keeps, and never more than eager
    assert full["peak_bytes"] == hf["peak_bytes"] <= eager["peak_bytes"]
    assert full["loss_equal_eager"] and hf["loss_equal_eager"]
    assert "| remat:full |" in (out / "bench.md").read_text()
    if report.plot(records, str(tmp_path / "again.png")) is None:  # matplotlib installed
        assert (out / "bench.png").stat().st_size > 10_000


def test_budget_rows_plan_within_budget_on_cpu(tmp_path):
    out = tmp_path / "b"
    assert main(["bench", "--model", "llama-tiny", "--batch", "2", "--seq", "64", "--steps", "1",
                 "--warmup", "1", "--only", "eager,remat@auto", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    planned = [r for r in records if r["strategy"].startswith("remat@")]
    assert len(planned) == 3
    for r in planned:
        assert r["status"] == "ok", r
        assert r["peak_bytes"] <= r["budget_bytes"]
        assert r["predicted_peak_bytes"] <= r["budget_bytes"]
    assert "best stock strategy that fits" in (out / "bench.md").read_text()


def test_out_of_memory_is_a_result_not_a_crash():
    def prepare(model, batch):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
    ids = torch.zeros(1, 4, dtype=torch.long)
    record = bench.measure(lambda: torch.nn.Linear(2, 2), strategies.Strategy("huge", "anchor", prepare),
                           {"input_ids": ids, "labels": ids})
    assert record["status"] == "oom" and "80.00 GiB" in record["reason"]


def test_unknown_only_names_are_refused(tmp_path):
    import argparse

    from remat.cli import bench as command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with pytest.raises(ValueError, match="unknown strategies"):
        command.run(parser.parse_args(["--only", "eager,fastest", "--out", str(tmp_path)]))


def test_previous_records_are_kept_not_appended(tmp_path):
    out = tmp_path / "b"
    args = ["bench", "--model", "llama-tiny", "--batch", "1", "--seq", "16", "--steps", "1", "--warmup", "1",
            "--only", "eager", "--out", str(out)]
    assert main(args) == 0 and main(args) == 0
    assert len((out / "bench.jsonl").read_text().splitlines()) == 1
    assert os.path.exists(out / "bench.jsonl.previous")
