"""The bench side of compile planning, on the CPU: the strategy list with compile and anchors,
remat+compile@ rows (against a stand-in ``remat.plan(..., compile=True)``), transformers' own
every-N / offload rows, the fused-loss anchors' wiring and refusal, the "At each budget" table,
and the repeated-runs combiner (worst of N, monotone frontier) on synthetic records."""
import importlib.util
import json
import os
import sys
import types

import pytest
import torch

import remat
from remat.cli import main
from remat.prove import anchors, bench, report, strategies

MiB = 2 ** 20
GiB = 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _names(strategy_list):
    return [s.name for s in strategy_list]


def _no_module(monkeypatch, missing):
    real = anchors.importlib.import_module

    def fake(name, *args, **kwargs):
        if name in missing:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args, **kwargs) if name not in ("liger_kernel", "cut_cross_entropy") else types.ModuleType(name)
    monkeypatch.setattr(anchors.importlib, "import_module", fake)


# --- the strategy list ----------------------------------------------------------------------

def test_strategy_list_with_compile_plans_and_anchors(monkeypatch):
    _no_module(monkeypatch, missing=())  # both anchors "import"
    listed = strategies.strategies([10 * GiB, 16 * GiB], uniform=("full",), compile_budgets=(1.0, 0.5),
                              compile_plans=True, fused_anchors=("liger", "cce"))
    names = _names(listed)
    assert names == ["eager", "hf_full", "every2", "sac", "save_on_cpu", "hf_every2", "hf_offload", "remat:full",
                     "remat@10GiB", "remat@16GiB", "liger", "cce", "compile_1", "compile_0.5",
                     "compile_1+mask_skip", "remat+compile@10GiB", "remat+compile@16GiB"]
    by = {s.name: s for s in listed}
    assert by["remat+compile@16GiB"].budget_bytes == 16 * GiB and by["remat+compile@16GiB"].kind == "remat"
    assert {s.name for s in listed if s.compiled} == {"compile_1", "compile_0.5", "compile_1+mask_skip",
                                                      "remat+compile@10GiB", "remat+compile@16GiB"}
    assert by["compile_1+mask_skip"].kind == "remat"  # remat's fix: never the "best stock" a plan is held to
    assert by["liger"].kind == by["compile_1"].kind == by["hf_every2"].kind == "anchor"
    # without the flags: no compiled rows, no fused anchors
    plain = _names(strategies.strategies([10 * GiB]))
    assert not any(n.startswith(("compile_", "remat+compile", "liger", "cce")) for n in plain)


def test_anchors_refused_with_a_clear_message_when_not_importable(monkeypatch):
    _no_module(monkeypatch, missing=("liger_kernel",))
    with pytest.raises(ValueError, match=r"liger anchor needs the liger_kernel module.*pip install"):
        strategies.strategies([], fused_anchors=("cce", "liger"))
    assert anchors.fused_loss_unavailable("cce") is None
    assert "unknown anchor" in anchors.fused_loss_unavailable("apex")


def test_cli_refuses_anchors_before_building_anything(monkeypatch, tmp_path, capsys):
    _no_module(monkeypatch, missing=("liger_kernel", "cut_cross_entropy"))
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("nothing may be measured"))
    assert main(["bench", "--anchors", "cce", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cce anchor needs the cut_cross_entropy module" in err and "--no-deps .whl/" in err
    assert main(["bench", "--anchors", "liger,fast", "--out", str(tmp_path)]) == 2
    assert "unknown anchors ['fast']" in capsys.readouterr().err


# --- rows ------------------------------------------------------------------------------------

def _tiny_batch(seq=16):
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _tiny_build():
    from remat.presets import build_model, load_config
    return build_model(load_config("llama-tiny"), dtype=torch.float32)


def test_remat_compile_row_plans_for_compile_applies_and_compiles(monkeypatch):
    seen = {}

    def plan(model, batch, budget, *, compile=False, **kwargs):  # the call the planner is getting
        seen.update(compile=compile, budget=budget, kwargs=kwargs)
        return remat.Plan(blocks={"model.layers.0": "full"}, head="plain",
                          notes={"predicted_peak_bytes": 3 * MiB, "predicted_step_s": 0.01, "peak_at": "test"})
    monkeypatch.setattr(remat, "plan", plan)
    profiled = []   # one compiled profile for every budget, made by remat.profile(..., compile=True)
    monkeypatch.setattr(remat, "profile", lambda model, batch, **kw: profiled.append(kw) or "the profile")
    compiled = []
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: (compiled.append(kw), real_compile(self, **kw))[1])
    (row,) = [s for s in strategies.strategies([64 * MiB], compile_plans=True, compile_backend="eager", gpu="cpu",
                                          anchors=False, uniform=()) if s.name.startswith("remat+compile@")]
    record = bench.measure(_tiny_build, row, _tiny_batch(), warmup=1, steps=1)
    assert record["status"] == "ok", record
    assert profiled == [{"compile": True, "gpu": "cpu", "optimizer": "none"}]
    assert seen == {"compile": True, "budget": 64 * MiB,
                    "kwargs": {"gpu": "cpu", "profiled": "the profile", "optimizer": "none"}}
    assert compiled == [{"backend": "eager"}]
    assert record["compiled"] and record["strategy"] == "remat+compile@64MiB"
    assert record["predicted_peak_bytes"] == 3 * MiB and record["predicted_step_s"] == 0.01
    assert record["plan"] == "1x full; head plain"
    assert record["warmup_s"] > 0 and record["peak_bytes"] > 0


def test_compiled_rows_leave_the_compiler_as_they_found_it():
    import torch._functorch.config as functorch_config
    before = functorch_config.activation_memory_budget

    def prepare(model, batch):
        functorch_config.activation_memory_budget = 0.3
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    record = bench.measure(lambda: torch.nn.Linear(2, 2), strategies.Strategy("c", "anchor", prepare, compiled=True),
                           _tiny_batch(4))
    assert record["status"] == "oom" and record["compiled"]
    assert functorch_config.activation_memory_budget == before


def test_hf_every2_runs_only_where_transformers_has_the_method():
    hf = [s for s in strategies.strategies() if s.name in ("hf_every2", "hf_offload")]
    every2, offload = hf
    record = bench.measure(_tiny_build, every2, _tiny_batch(), warmup=1, steps=1)
    method = getattr(_tiny_build(), "activation_checkpointing_enable", None)
    if method is None:
        assert record["status"] == "skipped" and "transformers" in record["reason"]
    else:
        assert record["status"] == "ok" and record["method"] == "activation_checkpointing_enable"
    # the mechanism: every second decoder layer checkpointed (transformers 4.x: no such method, the reason)
    model = _tiny_build()
    if method is None:
        with pytest.raises(anchors.Skip, match="has no activation_checkpointing_enable"):
            every2.prepare(model, _tiny_batch())
    else:
        every2.prepare(model, _tiny_batch())
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    # offload applies on a GPU only, and says so (transformers 4.x: it has no offload to apply)
    reason = bench.measure(_tiny_build, offload, _tiny_batch())["reason"]
    assert ("has no activation_checkpointing_enable" if method is None else "only applies on a GPU") in reason

    # a transformers without the method: the row is skipped, with the reason
    class Old(torch.nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            pass
    record = bench.measure(Old, every2, _tiny_batch(4))
    assert record["status"] == "skipped" and "has no activation_checkpointing_enable" in record["reason"]

    # transformers 5.17: the same arguments on gradient_checkpointing_enable
    class V517(Old):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
            self.called = (gradient_checkpointing_kwargs, every_n_layers, offload)
    model = V517()
    method, kwargs_name = strategies.hf_checkpointing(model)
    assert method.__name__ == "gradient_checkpointing_enable" and kwargs_name == "gradient_checkpointing_kwargs"


def test_fused_loss_forward_computes_the_models_own_loss():
    model = _tiny_build()
    batch = _tiny_batch(24)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, ::5] = -100

    def reference_loss(hidden, weight, targets):  # stands in for Liger / CCE (Triton, GPU only)
        return torch.nn.functional.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100)
    fused = anchors.fused_loss_forward(model, reference_loss)(**batch).loss
    expected = model(**batch).loss
    torch.testing.assert_close(fused, expected)
    # and the anchor row itself refuses the CPU, saying why
    record = bench.measure(_tiny_build, strategies.Strategy("liger", "anchor", anchors.fused_anchor("liger")), batch)
    assert record["status"] == "skipped" and "only applies on a GPU" in record["reason"]


# --- the report ------------------------------------------------------------------------------

def _rec(name, kind, peak_gib, ratio, budget_gib=None, compiled=False, plan=None, status="ok", **extra):
    r = dict(strategy=name, kind=kind, status=status, model="m", batch=1, seq=8, dtype="bf16", gpu="H100")
    if budget_gib:
        r["budget_bytes"] = int(budget_gib * GiB)
    if compiled:
        r["compiled"] = True
    if status == "ok":
        tokens = 40000 * ratio
        r.update(peak_bytes=int(peak_gib * GiB), peak_GiB=peak_gib, tokens_per_s=tokens, step_s=16384 / tokens,
                 step_s_min=16384 / tokens * 0.99, step_s_max=16384 / tokens * 1.01, loss=1.0)
        if name != "eager":
            r["vs_eager"] = ratio
    else:
        r["reason"] = "CUDA out of memory"
    if plan:
        r["plan"] = plan
    r.update(extra)
    return r


def _one_run(shift=0.0, plan16="16x mlp; head chunked", dip=False):
    return [_rec("eager", "anchor", 53, 1.0), _rec("hf_full", "anchor", 27.6, 0.82),
            _rec("compile_0.5", "anchor", 27.5, 0.97, compiled=True),
            _rec("compile_0.2", "anchor", 20.9, 0.92, compiled=True),
            _rec("remat@16GiB", "remat", 15.7, 0.95 + shift, 16, plan=plan16),
            _rec("remat@25GiB", "remat", 24.5, (0.90 if dip else 1.00) + shift, 25, plan="8x mlp, 8x keep"),
            _rec("remat+compile@16GiB", "remat", 15.9, 0.99 + shift, 16, compiled=True, plan="16x selective"),
            _rec("remat+compile@25GiB", "remat", 26.0, 1.09 + shift, 25, compiled=True, plan="16x keep")]


def test_budget_table_takes_the_best_remat_row_within_the_budget():
    table = report.budget_table(_one_run())
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    # 16 GiB: the compiled plan is faster and within budget; nothing stock fits
    assert "remat+compile@16GiB 0.990x" in rows["16.00 GiB"] and "none fits" in rows["16.00 GiB"]
    # 25 GiB: the compiled plan went over its budget, so the eager plan is remat's row; the best
    # stock strategy that fits is a compile budget
    assert "remat@25GiB 1.000x" in rows["25.00 GiB"] and "26.00 GiB OVER" in rows["25.00 GiB"]
    assert "compile_0.2 0.920x" in rows["25.00 GiB"] and f"{1.0 / 0.92:.3f}x" in rows["25.00 GiB"]
    assert "best stock strategy that fits" in table and "remat+compile" in table


def test_plot_draws_compiled_plans_as_their_own_series(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.plot(_one_run(), str(tmp_path / "f.png")) is None
    assert (tmp_path / "f.png").stat().st_size > 10_000
    assert [report.group(r) for r in _one_run()[1:6]] == ["stock", "stock+compile", "stock+compile", "remat", "remat"]
    assert report.group(_one_run()[-1]) == "remat+compile"


# --- repeated runs ---------------------------------------------------------------------------

def test_combine_runs_keeps_the_worst_of_n():
    runs = [_one_run(0.0), _one_run(-0.03, plan16="11x selective, 5x full; head chunked"), _one_run(0.01)]
    runs[1][1] = _rec("hf_full", "anchor", 27.6, 0.82, status="oom")
    runs[2][4]["peak_bytes"] = int(15.95 * GiB)  # the largest peak wins, even from a faster run
    for index, run in enumerate(runs):
        run[4]["predicted_peak_bytes"] = int((15.0 + index / 10) * GiB)
    combined = {r["strategy"]: r for r in report.combine_runs(runs)}
    plan16 = combined["remat@16GiB"]
    assert plan16["vs_eager"] == pytest.approx(0.92) and plan16["vs_eager_runs"] == pytest.approx([0.95, 0.92, 0.96])
    assert plan16["peak_bytes"] == int(15.95 * GiB) and plan16["n_runs"] == 3 and plan16["runs_ok"] == 3
    # the predicted peak shown beside it is the same run's (run 3), not the slowest run's (run 2)
    assert plan16["predicted_peak_bytes"] == int(15.2 * GiB)
    assert plan16["plans_differ"] and not combined["remat@25GiB"]["plans_differ"]
    assert plan16["tokens_per_s"] == min(plan16["tokens_per_s_runs"])
    assert combined["hf_full"]["status"] == "oom" and combined["hf_full"]["reason"].startswith("run 2 of 3")
    # a strategy missing from one run is a failure of that run
    short = report.combine_runs([_one_run(), _one_run()[:-1]])
    assert short[-1]["status"] == "missing" and "run 2 of 2" in short[-1]["reason"]


def test_frontier_table_does_not_judge_what_was_not_measured():
    compiled_only = [r for r in _one_run() if not r["strategy"].startswith("remat@")]
    short = report.combine_runs([compiled_only, compiled_only[:-1]])  # run 2 ended before the 25 GiB plan
    targets = {16 * GiB: {"remat": 0.95, "remat+compile": 0.98}, 25 * GiB: {"remat": 1.0, "remat+compile": 1.05}}
    rows = {line.split("|")[1].strip(): line for line in report.frontier_table(short, targets).splitlines()[2:]}
    assert "remat >= 0.95: not run" in rows["16.00 GiB"] and "remat+compile >= 0.98: PASS" in rows["16.00 GiB"]
    assert "remat+compile >= 1.05: not shown (missing in a run)" in rows["25.00 GiB"]
    over = report.combine_runs([_one_run()])  # the 25 GiB compiled plan peaks over its budget
    assert "remat+compile >= 1.05: FAIL" in report.frontier_table(over, targets)


def test_monotone_check_flags_a_frontier_that_goes_down():
    assert report.monotone_violations(report.combine_runs([_one_run(), _one_run(0.01)])) == []
    dipped = report.combine_runs([_one_run(), _one_run(dip=True)])
    violations = report.monotone_violations(dipped)
    # remat's eager series dips; so does its best row (the compiled 25 GiB plan is over budget)
    assert [v["series"] for v in violations] == ["remat", "best"]
    assert violations[0]["budget_bytes"] == 25 * GiB and violations[0]["smaller_budget_bytes"] == 16 * GiB
    # within the 1% tolerance: not a violation
    nearly = _one_run()
    nearly[5] = _rec("remat@25GiB", "remat", 24.5, 0.945, 25)  # 0.95 at 16 GiB
    assert [v for v in report.monotone_violations(nearly) if v["series"] == "remat"] == []


def _frontier_module():
    spec = importlib.util.spec_from_file_location("frontier", os.path.join(ROOT, "benchmarks", "frontier.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_frontier_combines_run_folders_into_a_report(tmp_path):
    frontier = _frontier_module()
    folders = []
    for index, run in enumerate([_one_run(), _one_run(-0.02), _one_run(dip=True)], 1):
        folder = tmp_path / f"run{index}"
        folder.mkdir()
        (folder / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run))
        folders.append(str(folder))
    out = tmp_path / "combined"
    assert frontier.main(["--combine", *folders, "--out", str(out)]) == 0
    summary = json.loads((out / "frontier.json").read_text())
    assert not summary["monotone"] and summary["violations"][0]["series"] == "remat"
    text = (out / "frontier.md").read_text()
    assert "worst of 3" in text and "NOT MONOTONE (remat)" in text
    assert "remat >= 0.95: FAIL" in text and "vs stock >= 1.03: PASS" in text  # 16 GiB: worst 0.93; no stock fits
    assert "0.930x (0.950, 0.930, 0.950)" in text
    # the command each run launches: a fresh interpreter, --json, its own folder
    command = frontier.bench_command(["--compile"], "d/run1")
    assert command[0] == sys.executable and command[3:] == ["bench", "--compile", "--json", "--out", "d/run1"]


def test_cli_json_prints_records_only(tmp_path, capsys):
    assert main(["bench", "--model", "llama-tiny", "--batch", "1", "--seq", "16", "--steps", "1", "--warmup", "1",
                 "--only", "eager", "--json", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["strategy"] == "eager"


def test_stock_compiled_rows_run_without_remats_mask_skip_and_the_mask_skip_row_with_it():
    """remat rows hold transformers' mask decisions while their model lives; the stock compile row
    after them must measure stock torch.compile (its record says so), the mask-skip row remat's."""
    pytest.importorskip("transformers.masking_utils")  # transformers < 4.53: nothing to wrap
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        pytest.skip("this torch cannot tell export from compile: remat wraps nothing")
    wanted = ("remat:keep", "compile_1", "compile_1+mask_skip")
    listed = [s for s in strategies.strategies([], uniform=("keep",), compile_budgets=(1.0,), compile_plans=True,
                                          compile_backend="eager") if s.name in wanted]
    records = {s.name: bench.measure(_tiny_build, s, _tiny_batch(), warmup=1, steps=1) for s in listed}
    assert [r["status"] for r in records.values()] == ["ok"] * 3, records
    assert records["compile_1"]["mask_skip"] is False
    assert records["compile_1+mask_skip"]["mask_skip"] is True
    assert "mask_skip" not in records["remat:keep"]  # an eager row: the skip acts only under compile


def test_frontier_combines_a_run_made_in_parts(tmp_path):
    """``--combine A+B``: one run whose budgets were measured in two processes (the first cut short);
    a strategy measured in both parts counts once, at its worst."""
    frontier = _frontier_module()
    whole = _one_run()
    first = [r for r in whole if r["strategy"] != "remat+compile@25GiB"]     # cut before the last plan
    second = [dict(r, vs_eager=r["vs_eager"] - 0.02) if r["strategy"] == "compile_0.5" else r
              for r in whole if r["kind"] == "anchor" or r["strategy"] == "remat+compile@25GiB"]
    for name, records in (("run3", first), ("run4", second), ("run1", whole)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    parts = frontier.load_parts(f"{tmp_path / 'run3'}+{tmp_path / 'run4'}")
    assert sorted(r["strategy"] for r in parts) == sorted(r["strategy"] for r in whole)
    assert {r["strategy"]: r for r in parts}["compile_0.5"]["vs_eager"] == pytest.approx(0.95)   # the worse part's
    combined = {r["strategy"]: r for r in report.combine_runs([load for load in (whole, parts)])}
    assert combined["remat+compile@25GiB"]["status"] == "ok" and combined["remat+compile@25GiB"]["n_runs"] == 2
    assert frontier.load_parts(str(tmp_path / "run1")) == whole
    with pytest.raises(SystemExit, match="not a folder"):
        frontier.load_parts(f"{tmp_path / 'run3'}+{tmp_path / 'nowhere'}")
