"""The CLI's contract: one-line errors with a fix (exit 2, no traceback), JSON for scripts,
progress on stderr, any config file. Called in-process through ``remat.cli.main``."""
import argparse
import json
import sys
import threading

import pytest

from remat.cli import main

TINY = ["--model", "llama-tiny", "--batch", "2", "--seq", "64"]


def _error(capsys, argv, *, command="plan"):
    """Run ``argv``, expect exit 2 and one ``remat <command>: error:`` line on stderr; return it."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith(f"remat {command}: error: ")]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("budget, match", [
    ("-5GiB", "negative"), ("1e30", "more than 64.00 TiB"), ("1e30GiB", "more than 64.00 TiB"),
    ("0", "more than 0 bytes"), ("inf", "cannot read size"), ("24G", "ambiguous"),
])
def test_bad_budgets_are_refused_before_any_work(capsys, budget, match, monkeypatch):
    def work(*args, **kwargs):
        raise AssertionError("the model was built or profiled before the budget was read")
    monkeypatch.setattr("remat.presets.build_model", work)
    monkeypatch.setattr("remat.profiling.profiler.profile", work)
    line = _error(capsys, ["plan", *TINY, "--budget", budget])
    assert match in line and "24GiB" in line


@pytest.mark.parametrize("argv, match", [
    (["--batch", "0"], "--batch must be a whole number >= 1, got 0"),
    (["--seq", "-3"], "--seq must be a whole number >= 1, got -3"),
    (["--fsdp", "0"], "leave --fsdp out"),
    (["--batch", "abc"], "invalid int value: 'abc'; see `remat plan --help`"),
    (["--gpu", "tpu9"], "unknown gpu 'tpu9'; expected one of"),
])
def test_bad_numbers_are_one_line_errors(capsys, argv, match):
    assert match in _error(capsys, ["plan", "--model", "llama-tiny", "--budget", "1GiB", *argv])


def test_a_missing_option_is_a_usage_error_not_an_exit(capsys):
    assert "required: --budget" in _error(capsys, ["plan", "--model", "llama-tiny"])


def test_help_returns_zero_in_process(capsys):
    assert main(["plan", "--help"]) == 0
    assert "examples:" in capsys.readouterr().out


def test_out_into_a_missing_folder_fails_before_planning(capsys, tmp_path):
    line = _error(capsys, ["plan", *TINY, "--budget", "1GiB", "--out", str(tmp_path / "no" / "plan.json")])
    assert "does not exist; create it" in line


def test_missing_transformers_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert "pip install 'remat[hf]'" in _error(capsys, ["plan", *TINY, "--budget", "1GiB"])


def test_config_problems_name_the_file_and_the_fix(capsys, tmp_path):
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    line = _error(capsys, ["plan", "--model", str(broken), "--budget", "1GiB"])
    assert "config.json is not valid JSON" in line and "save_pretrained" in line

    (tmp_path / "list.json").write_text("[1, 2]")
    assert "expected a JSON object with a 'model_type'" in _error(
        capsys, ["estimate", "--model", str(tmp_path / "list.json")], command="estimate")

    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "not-a-model"}))
    assert "model_type 'not-a-model' is not known to transformers" in _error(
        capsys, ["plan", "--model", str(tmp_path / "odd.json"), "--budget", "1GiB"])

    line = _error(capsys, ["plan", "--model", str(tmp_path / "nowhere" / "config.json"), "--budget", "1GiB"])
    assert "no such file" in line and "preset" in line

    (tmp_path / "empty").mkdir()
    assert "folder without a config.json" in _error(
        capsys, ["plan", "--model", str(tmp_path / "empty"), "--budget", "1GiB"])


def test_an_encoder_decoder_config_is_refused_in_one_short_line(capsys, tmp_path):
    from transformers import T5Config
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64).to_json_file(tmp_path / "t5.json")
    line = _error(capsys, ["plan", "--model", str(tmp_path / "t5.json"), "--budget", "1GiB"])
    assert "encoder-decoder" in line and "decoder-only" in line
    assert len(line) < 300  # transformers' own message lists every config class (3 KB)


def test_a_config_file_of_any_name_and_an_attention_the_model_supports(capsys, tmp_path):
    """Gemma-2 refuses sdpa (attention softcapping) on transformers 5, and 4.x's sdpa drops the
    softcapping: remat must pick eager on both."""
    from transformers import Gemma2Config

    from remat.presets import attention_for, load_config
    Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16).to_json_file(tmp_path / "gemma2-tiny.json")
    path = str(tmp_path / "gemma2-tiny.json")
    assert attention_for(load_config(path)) == "eager"
    assert attention_for(load_config("llama-tiny")) == "sdpa"
    assert main(["plan", "--model", path, "--batch", "2", "--seq", "32", "--budget", "64MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(plan["blocks"]) == ["model.layers.0", "model.layers.1"]


def test_plan_json_is_the_only_stdout_and_progress_goes_to_stderr(capsys, monkeypatch, tmp_path):
    import remat
    from remat.cli import plan as plan_cli
    monkeypatch.setattr(plan_cli, "PROGRESS_AFTER_S", 0.0)
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--budget", "4MiB", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = remat.Plan.from_dict(json.loads(captured.out))
    assert printed == remat.Plan.load(str(out))
    assert printed.notes["predicted_peak_bytes"] <= 4 * 2**20
    assert "building llama-tiny" in captured.err and "solving for 4.00 MiB" in captured.err


def test_plan_compile_without_cuda_is_refused_before_building(capsys, monkeypatch):
    import torch

    from remat.cli import plan as plan_cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(plan_cli, "profile_from_args", lambda *a: pytest.fail("built the model"))
    line = _error(capsys, ["plan", *TINY, "--budget", "1GiB", "--compile"])
    assert "--compile measures the compiled blocks on a GPU" in line and "Drop --compile for an eager plan" in line


@pytest.mark.parametrize("flag, scope, then", [(["--compile"], "model", "model.compile()"),
                                               (["--compile", "blocks"], "blocks", "block.compile() on each block")])
def test_plan_compile_builds_on_the_gpu_and_says_the_plan_is_for_compile(capsys, monkeypatch, tmp_path, flag, scope,
                                                                         then):
    """The GPU itself is not here: the CUDA check is passed and the compiled profile stood in for
    by an eager one marked compiled (the real one: tests/test_plan_compile.py, GPU). ``--compile``
    alone plans for the whole model compiled, ``--compile blocks`` for each block compiled alone."""
    import dataclasses

    import torch

    import remat
    from remat.cli import plan as plan_cli
    from remat.presets import build_model
    from remat.profiling.profiler import profile
    built = {}

    def fake_build(config, *, device="cpu", dtype=None, **kwargs):
        built["device"] = device
        return build_model(config, device="cpu", dtype=torch.float32)

    def fake_profile(model, batch, *, compile=False, **kwargs):
        built["compile"], built["gpu"] = compile, kwargs.get("gpu")
        prof = profile(model, batch, gpu="h100", optimizer=kwargs["optimizer"])
        return dataclasses.replace(prof, notes=dict(prof.notes, compile=True, compile_scope=scope,
                                                    compile_backend="inductor"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("remat.presets.build_model", fake_build)
    monkeypatch.setattr("remat.profiling.profiler.profile", fake_profile)
    out_path = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--budget", "1GiB", *flag, "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert built == {"device": "cuda", "compile": scope, "gpu": None}
    assert "planned for compiled execution" in out and then in out
    saved = remat.Plan.load(str(out_path)).notes
    assert saved["compile"] is True and saved["compile_scope"] == scope
    monkeypatch.undo()
    assert main(["plan", *TINY, "--budget", "1GiB"]) == 0
    assert "compiled" not in capsys.readouterr().out


def test_estimate_json_and_table(capsys):
    assert main(["estimate", *TINY, "--budget", "4MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["budget"]["fits"] and report["budget"]["plan"]["version"] == 1
    strategies = {(r["strategy"], r["head"]) for r in report["rows"]}
    assert ("full", "plain") in strategies and ("plan@4MiB", report["rows"][-1]["head"]) in strategies
    assert all(r["peak_bytes"] > 0 and r["tokens_per_s"] > 0 for r in report["rows"])

    assert main(["estimate", *TINY, "--budget", "1KiB"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert "at most" not in header  # a column that was empty in every row
    assert "plan@1KiB: no plan fits 1.00 KiB. The smallest budget that fits is" in out


def test_no_fit_says_why_the_smallest_budget_is_above_the_peak():
    from remat.cli.plan import no_fit_message
    from remat.planning.plans import Plan
    from remat.planning.solver import NoPlanFits
    args = argparse.Namespace(optimizer="adamw", fsdp=1)
    notes = {"predicted_peak_bytes": 83 * 2**20, "peak_at": "backward: head and loss"}
    offloading = NoPlanFits("", 85 * 2**20, Plan({"a": "full+offload", "b": "full"}, notes=notes))
    text = no_fit_message(offloading, 2**20, args)
    assert "smallest budget that fits is 85.00 MiB" in text and "predicted peak 83.00 MiB" in text
    assert "keeps 2% of the budget free for plans that offload" in text
    assert "--optimizer adamw8bit" in text and "--fsdp WORLD" in text
    rounding = NoPlanFits("", 83 * 2**20 + 4096, Plan({"a": "full"}, notes=notes))
    assert "rounds each block's memory up" in no_fit_message(rounding, 2**20, args)


def test_a_long_stage_keeps_saying_it_is_running():
    from remat.cli.plan import working
    said, beat = [], threading.Event()

    def say(line):
        said.append(line)
        if line.startswith("still"):
            beat.set()
    threads = set(threading.enumerate())
    with working(say, "solving for 70 GiB", every_s=0.001):
        assert beat.wait(timeout=60)  # a bound on a heartbeat that broke, not a timing
    assert said[0] == "solving for 70 GiB" and said[1].startswith("still solving after")
    assert set(threading.enumerate()) <= threads  # the heartbeat's thread ended with the stage: it says no more


def test_env_prints_sizes_in_the_unit_that_fits(capsys):
    from remat.cli.env import text_lines
    lines = text_lines({"memlock_limit_bytes": 8 * 2**20, "host_memory_bytes": 64 * 2**30, "cpu_count": 2})
    assert lines == ["memlock_limit  8.00 MiB", "host_memory    64.00 GiB", "cpu_count      2"]
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["memlock_limit_bytes"] is None or isinstance(info["memlock_limit_bytes"], int)


@pytest.mark.parametrize("argv, match", [
    (["--budgets", "10,1e30GiB"], "more than 64.00 TiB"),
    (["--steps", "0"], "--steps must be a whole number >= 1"),
    (["--only", "eager,nonsense"], "unknown strategies ['nonsense']"),
])
def test_bench_refuses_bad_options_before_measuring(capsys, tmp_path, argv, match):
    out = tmp_path / "out"
    assert match in _error(capsys, ["bench", "--out", str(out), *argv], command="bench")
    assert not out.exists()  # refused before writing anything
