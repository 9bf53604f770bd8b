"""benchmarks/longctx.py on the CPU (llama-tiny, ``--device cpu``): its rows run or say why not,
Liger's rows build inside the scope that puts ``modeling_llama`` back, the ratios to Liger + HF and
to the ceiling, and the bad input it refuses before building anything."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import longctx  # noqa: E402
from remat.prove import stacks  # noqa: E402
from test_bench_card import _fake_liger  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    assert longctx.main(["--model", "llama-tiny", "--device", "cpu", "--seqs", "48", "--steps", "1",
                         "--budget", "1GiB", "--out", str(out), *extra]) == 0
    lines = [json.loads(line) for line in (out / "longctx.jsonl").read_text().splitlines()]
    return lines[0], {r["strategy"]: r for r in lines[1:]}


def test_rows_train_or_say_why_not(tmp_path, capsys):
    environment, rows = _run(tmp_path, "--strategies", "hf,hf_every2,hf_offload,liger_hf,unsloth,remat")
    assert "environment" in environment
    for name in ("hf", "hf_every2", "remat"):
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["loss"] > 0, rows[name]
    assert rows["hf"]["loss"] == rows["remat"]["loss"]   # the same model and batch
    assert "keep" in rows["remat"]["plan"] and rows["remat"]["predicted_peak_GiB"] >= 0
    for name in ("hf_offload", "liger_hf", "unsloth"):
        assert rows[name]["result"] == "skipped" and "GPU" in rows[name]["reason"], rows[name]
    printed = capsys.readouterr().out
    assert "| 48 | liger_hf | none |" in printed and "skipped: Liger runs Triton kernels" in printed


def test_liger_rows_build_patched_and_leave_the_module_as_it_was(tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama
    before = dict(vars(modeling_llama))
    _, mlp, _ = _fake_liger(monkeypatch)
    monkeypatch.setattr(stacks, "liger_unavailable", lambda model_type, cuda: None)
    built = []
    real_build = longctx.build
    monkeypatch.setattr(longctx, "build", lambda *a: built.append(real_build(*a)) or built[-1])
    _, rows = _run(tmp_path, "--strategies", "liger_keep,hf,liger_hf")
    assert [type(m[0].model.layers[0].mlp) is mlp for m in built] == [True, False, True]
    assert dict(vars(modeling_llama)) == before
    assert rows["hf"]["vs_ceiling"] == round(rows["hf"]["tokens_per_s"] / rows["liger_keep"]["tokens_per_s"], 3)
    assert rows["liger_hf"]["vs_liger_hf"] == 1.0 and rows["liger_hf"]["ceiling"] == "liger_keep"


def test_bad_input_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(longctx, "build", lambda *a: pytest.fail("nothing may be built"))
    for extra, said in ((["--strategies", "hf,fastest"], "unknown rows ['fastest']"),
                        (["--card", "15.5GiB"], "caps a CUDA GPU's memory"),
                        (["--card", "lots"], "--card takes a card's memory")):
        with pytest.raises(SystemExit):
            longctx.main(["--model", "llama-tiny", "--device", "cpu", "--out", str(tmp_path), *extra])
        assert said in capsys.readouterr().err
    monkeypatch.setattr(longctx, "build", lambda *a: (object(), False))
    _fake_liger(monkeypatch)
    monkeypatch.setattr(stacks, "liger_unavailable", lambda model_type, cuda: None)
    record = longctx.attempt("liger_remat", 32, longctx.argparse.Namespace(
        device="cpu", model="llama-tiny", budget="1GiB", card=None, fake=True, steps=1, plan_only=False,
        compile_backend=None))
    assert record["result"] == "skipped" and "hands Liger's Triton kernels fake tensors" in record["reason"]
