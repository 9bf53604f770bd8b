"""``remat verify`` on a preset: the verdict, its table, JSON, exit status, and bad input in one line."""
import json
import os
import warnings
from unittest import mock

import pytest

pytest.importorskip("transformers")


def _cli(argv, capsys):
    from remat.cli import main
    with mock.patch.dict(os.environ), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = main(["verify", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_spec_on_a_preset(capsys):
    status, out, _ = _cli(["--model", "llama-tiny", "--seq", "32", "--spec", "full", "--dropout", "0.1"], capsys)
    assert status == 0 and "BITWISE" in out.splitlines()[0] and "batch 2 x 32 (float32, cpu)" in out


@pytest.mark.slow   # the help's examples run --spec tiled --json in make test; this adds the head and float64
def test_tiled_and_the_chunked_head_as_json(capsys):
    status, out, _ = _cli(["--model", "llama-tiny", "--seq", "32", "--spec", "full+tiled", "--tile-tokens", "16",
                           "--head", "chunked", "--chunk-tokens", "16", "--json"], capsys)
    result = json.loads(out)
    assert status == 0 and result["verdict"] == "within rounding" and result["float64"] == "ran"
    assert any(t["verdict"] == "within rounding" for t in result["tensors"])


@pytest.mark.slow   # a preset built and verified; doctor(verify=True)'s wrong case is in make test
def test_a_wrong_treatment_exits_1(capsys, monkeypatch):
    from remat.treat import treatments
    original = treatments.checkpoint

    def without_rng(function, *args, **kwargs):
        kwargs["preserve_rng_state"] = False
        return original(function, *args, **kwargs)
    monkeypatch.setattr(treatments, "checkpoint", without_rng)
    status, out, _ = _cli(["--model", "llama-tiny", "--seq", "32", "--spec", "full", "--dropout", "0.1"], capsys)
    assert status == 1 and "WRONG" in out


@pytest.mark.parametrize("argv, message", [
    ([], "pass what to verify"),
    (["--spec", "full", "--plan", "p.json"], "--spec and --plan"),
    (["--spec", "full", "--dropout", "1.5"], "--dropout must be"),
    (["--spec", "nonsense"], "nonsense"),
])
def test_bad_input(argv, message, capsys):
    status, _, err = _cli(["--model", "llama-tiny", "--seq", "16", *argv], capsys)
    assert status == 2 and message in err
