"""``benchmarks/fit_overheads.py``: the FSDP2 overhead constants come back from traced bench rows.

Synthetic records are made the way ``benchmarks/fsdp_bench.py --trace`` writes them: a prediction
split into terms at the constants the bench used (the provisional ones, or the record's own
``overheads``) and a trace whose kernel times follow other, "true" constants. The fit must find
the true ones, and the re-prediction must then meet every measured step.
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import fit_overheads  # noqa: E402
from remat.planning.sharding import Overheads  # noqa: E402

H100_HBM = 3.35e12
TRUE = Overheads(hbm_Bps_fraction=0.9, contention=0.5, latency_s=0.4e-3)


def _record(strategy, *, alone_s, overlap_s, copy_bytes, collectives, exposed_s, used=None, world=4):
    """A traced fsdp_bench row: predicted at ``used`` (None: the provisional constants, not written
    down, as before records named them), measured at :data:`TRUE`."""
    at = used or fit_overheads.PROVISIONAL
    contention_s, copy_s = at.contention * overlap_s, copy_bytes / (at.hbm_Bps_fraction * H100_HBM)
    launch_s = at.latency_s * collectives
    compute_s = alone_s + contention_s + copy_s + launch_s
    measured_copy = copy_bytes / (TRUE.hbm_Bps_fraction * H100_HBM)
    measured_compute = alone_s + TRUE.contention * overlap_s
    record = dict(strategy=strategy, world=world, kind="anchor", profile="cuda", gpu="NVIDIA H100 80GB HBM3",
                  step_s=measured_compute + measured_copy + TRUE.latency_s * collectives + exposed_s,
                  predicted_step_s=compute_s + exposed_s, predicted_compute_s=compute_s,
                  predicted_exposed_comm_s=exposed_s, predicted_comm_contention_s=contention_s,
                  predicted_comm_copy_s=copy_s, predicted_comm_launch_s=launch_s,
                  trace=dict(kernel_s=dict(fsdp_copy=measured_copy), compute_busy_s=measured_compute + measured_copy))
    if used is not None:
        record["overheads"] = dict(hbm_Bps_fraction=used.hbm_Bps_fraction, contention=used.contention,
                                   latency_s=used.latency_s)
    return record


def _write(tmp_path, records, name="bench.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


ROWS = dict(eager=dict(alone_s=0.38, overlap_s=0.105, copy_bytes=1.0e11, collectives=97, exposed_s=0.010),
            torch_ac=dict(alone_s=0.48, overlap_s=0.11, copy_bytes=1.0e11, collectives=97, exposed_s=0.012),
            plan=dict(alone_s=0.42, overlap_s=0.09, copy_bytes=0.9e11, collectives=81, exposed_s=0.02))


@pytest.mark.parametrize("used", [None, Overheads(hbm_Bps_fraction=0.7, contention=0.3, latency_s=0.2e-3)])
def test_fit_recovers_the_constants_the_trace_follows(tmp_path, used):
    records = [_record(name, used=used, **terms) for name, terms in ROWS.items()]
    rows = fit_overheads.rows([_write(tmp_path, records)])
    fitted = fit_overheads.fit(rows, fit_on=("eager", "torch_ac"))
    assert fitted.hbm_Bps_fraction == pytest.approx(TRUE.hbm_Bps_fraction, rel=1e-9)
    assert fitted.contention == pytest.approx(TRUE.contention, rel=1e-9)
    assert fitted.latency_s == pytest.approx(TRUE.latency_s, rel=1e-9)
    for row, record in zip(rows, records):  # the held-out plan too: it follows the same constants
        assert fit_overheads.predict(row, fitted) == pytest.approx(record["step_s"], rel=1e-9)
        assert record["predicted_step_s"] != pytest.approx(record["step_s"], rel=1e-3)


def test_single_rows_and_untraced_rows_are_left_out(tmp_path):
    eager = _record("eager", **ROWS["eager"])
    single = dict(eager, strategy="single:eager", kind="single")
    untraced = {k: v for k, v in eager.items() if k != "trace"}
    assert [r["strategy"] for r in fit_overheads.rows([_write(tmp_path, [eager, single, untraced])])] == ["eager"]


def test_a_fake_profile_row_is_refused(tmp_path):
    fake = dict(_record("eager", **ROWS["eager"]), profile="fake")
    with pytest.raises(ValueError, match="measured on the GPU"):
        fit_overheads.rows([_write(tmp_path, [fake])])


def test_nothing_to_fit_on_says_what_there_is(tmp_path):
    rows = fit_overheads.rows([_write(tmp_path, [_record("plan", **ROWS["plan"])])])
    with pytest.raises(ValueError, match="no row of strategy eager, torch_ac.*rows are: plan"):
        fit_overheads.fit(rows)


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no HBM bandwidth"):
        fit_overheads.hbm_Bps("Some Accelerator 9000")


def test_main_writes_the_fit_and_every_row(tmp_path, capsys):
    path = _write(tmp_path, [_record(name, **terms) for name, terms in ROWS.items()])
    out = tmp_path / "fit.json"
    assert fit_overheads.main([path, "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["overheads"]["contention"] == pytest.approx(TRUE.contention)
    assert [r["fitted_on"] for r in written["rows"]] == [True, True, False]
    assert all(abs(r["error_after"]) < 1e-6 for r in written["rows"])
    assert "refit" in capsys.readouterr().out
