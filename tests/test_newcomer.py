"""A newcomer's first hour (issue 30): each of the issue's ten items, as the command or call a new
user makes, and what it does now.

1-2. ``remat doctor`` predicts the peak of the setup it is shown (untouched, Hugging Face
     checkpointing, a plan, a callback) and says "does not fit" as an error, agreeing with
     ``remat estimate`` to the byte; it never calls a setup that does not fit "a bit slower".
3.   Plans know the model, batch and dtype they were made for; ``apply`` refuses another model's.
4.   ``remat bench`` without a GPU shows what a CPU proves (``make demo``).
5.   The README's TRL snippet runs as written (``tests/test_integrations_docs.py`` runs it verbatim;
     here: nothing rewrites it).
6.   accelerate's ``prepare`` before or after ``apply``: the same bf16 loss and gradients.
7.   One error style: non-modules, bogus CLI specs, a callback budget nothing fits.
8.   Messages name transformers 5's APIs, remat's own calls raise no deprecation warning, ``remat env``
     says what its numbers mean, plot budgets carry units, the TRL message tells the truth.
9.   The README states the suite's time; the slow sweeps have their own targets.
10.  A GPU plan on a CPU model with attention dropout is noted (and the README says why).
Plus: the README's own Python snippets run as written (the GPU one on a GPU).

Models are tiny (llama-tiny from its preset, or a 2-layer Llama), on the CPU or the meta device.
"""
import copy
import json
import os
import re
import warnings

import pytest
import torch

import remat
from remat.cli import main

transformers = pytest.importorskip("transformers")
from test_integrations_hf import VOCAB, TokenData, tiny_llama, training_args  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _meta(name="llama-tiny", layers=None):
    from remat.presets import build_model, load_config
    config = load_config(name)
    if layers is not None:
        config.num_hidden_layers = layers
    return build_model(config, device="meta", dtype=torch.bfloat16)


def _ids(batch=2, seq=128):
    return torch.zeros(batch, seq, dtype=torch.long)


def _batch(batch=2, seq=16):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def _estimate(capsys, *argv):
    assert main(["estimate", "--model", "llama-tiny", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# -- 1 and 2: doctor says what does not fit, with estimate's numbers -------------------------------
def test_doctor_cli_reports_an_untouched_model_that_does_not_fit(capsys):
    status = main(["doctor", "--model", "llama-tiny", "--batch", "2", "--seq", "128", "--budget", "1MiB"])
    out = capsys.readouterr().out
    assert status == 1 and "no problems found" not in out
    assert re.search(r"\[error\] does not fit: predicted [\d.]+ MiB > budget 1.00 MiB for the model as it is", out)
    assert "no plan fits: the floor is" in out                 # nothing fits 1 MiB: the fix is the floor


def test_doctor_agrees_with_estimate_to_the_byte_and_never_calls_an_oom_slower(capsys):
    """Issue 2: Hugging Face checkpointing over the budget was "fits, a plan is 6% faster"."""
    from remat.diagnosis import doctor
    table = _estimate(capsys, "--batch", "2", "--seq", "128")
    rows = {(r["strategy"], r["head"]): r["peak_bytes"] for r in table["rows"]}
    full, keep = rows[("full", "plain")], rows[("keep", "plain")]
    budget = full - 1                                          # Hugging Face checkpointing misses by one byte
    model = _meta()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    findings = doctor(model, _ids(), budget=budget, gpu="h100")
    assert [f.check for f in findings] == ["does-not-fit"] and findings[0].severity == "error"
    assert findings[0].predicted_peak_bytes == full and findings[0].budget_bytes == budget
    assert "Hugging Face checkpointing" in findings[0].what and "fits: predicted peak" in findings[0].fix
    untouched = doctor(_meta(), _ids(), budget=budget, gpu="h100")
    assert untouched[0].check == "does-not-fit" and untouched[0].predicted_peak_bytes == keep
    status = main(["doctor", "--model", "llama-tiny", "--batch", "2", "--seq", "128", "--budget", str(budget),
                   "--hf-checkpointing"])
    out = capsys.readouterr().out
    assert status == 1 and "does not fit" in out and "faster" not in out


def test_doctor_without_a_batch_compares_what_every_plan_keeps():
    """llama-8b's weights and gradients alone are 15 GiB: no plan fits 10 GiB."""
    from remat.diagnosis import doctor
    findings = doctor(_meta("llama-8b"), budget="10GiB")
    assert [f.check for f in findings] == ["does-not-fit"]
    assert "> budget 10.00 GiB" in findings[0].what and findings[0].predicted_peak_bytes > 14 * 2**30


def test_doctor_judges_the_plan_a_callback_will_make(capsys):
    from remat.diagnosis import doctor
    from remat.integrations.hf import RematCallback
    assert doctor(_meta(), _ids(), callback=RematCallback(budget="1GiB"), gpu="h100") == []
    findings = doctor(_meta(), _ids(), callback=RematCallback(budget="1MiB"), gpu="h100")
    assert [f.check for f in findings] == ["does-not-fit"] and "RematCallback(budget='1.00 MiB')" in findings[0].what
    assert main(["doctor", "--model", "llama-tiny", "--seq", "128", "--budget", "1MiB", "--callback"]) == 1
    assert "stops at the first training batch" in capsys.readouterr().out


# -- 3: plans know their model ----------------------------------------------------------------
def test_a_plan_knows_what_it_was_made_for_and_apply_refuses_another_model():
    small = tiny_llama()
    plan = remat.plan(small, _batch(batch=4), "1GiB", gpu="h100")
    made = plan.made_for
    assert made["model"] == "LlamaForCausalLM" and made["blocks"] == 2 and made["dtype"] == "float32"
    assert (made["batch"], made["seq"], made["optimizer"], made["gpu"], made["compile"]) == (4, 16, "none", "h100", None)
    assert made["versions"]["torch"] == torch.__version__ and "remat" in made["versions"]
    assert remat.Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).made_for == made   # survives a file

    from transformers import LlamaForCausalLM
    config = copy.deepcopy(small.config)
    config.num_hidden_layers = 4
    bigger = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"treats 2 blocks, this model has 4, and the first it does not name is "
                                         r"'model.layers.2'.*strict=False"):
        remat.apply(bigger, plan)
    assert remat.current_plan(bigger) is None                  # refused before anything changed
    remat.apply(bigger, plan, strict=False)                    # on purpose: the named blocks, the rest keep
    from remat.api import treatments
    assert treatments(bigger)["model.layers.3"] == "keep"
    from remat.diagnosis import doctor
    found = {f.check: f for f in doctor(bigger)}
    assert found["plan-mismatch"].severity == "error" and "'model.layers.2'" in found["plan-mismatch"].what

    other = torch.nn.Sequential()
    other.model = tiny_llama().model                           # the same blocks in another class
    with pytest.raises(ValueError, match="made for a LlamaForCausalLM"):
        remat.apply(other, plan, blocks="model.layers")
    old = {k: v for k, v in plan.to_dict().items()}            # a plan file from before: no model notes
    old["notes"] = {k: v for k, v in old["notes"].items() if k not in ("model", "dtype", "versions")}
    assert remat.Plan.from_dict(old).made_for == {}            # still read; it says nothing of its model
    remat.apply(bigger, remat.Plan.from_dict(old))             # so it applies by name, as a hand-made plan


def test_a_plan_for_another_batch_shape_warns_once_and_doctor_says_so():
    model = tiny_llama().train()
    plan = remat.plan(model, _batch(batch=4), "1GiB", gpu="h100")
    remat.apply(model, plan)
    with pytest.warns(UserWarning, match=r"made for a batch of 4 x 16 tokens, and it trains on 2 x 16"):
        model(**_batch(batch=2)).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="remat: a KV cache")
        model(**_batch(batch=2)).loss.backward()               # once per apply, not every step
    from remat.diagnosis import doctor
    assert "plan-batch" in [f.check for f in doctor(model, _batch(batch=2))]
    same = remat.apply(tiny_llama().train(), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="remat: a KV cache")
        assert doctor(same, _batch(batch=4)) == []             # doctor's own step does not use up the check
        same(**_batch(batch=4)).loss.backward()                # the planned shape: nothing to say


# -- 4: make demo on a CPU --------------------------------------------------------------------
def test_the_cpu_demo_proves_gradients_and_peaks_and_labels_predictions(tmp_path, monkeypatch):
    from remat.prove import demo
    monkeypatch.setattr(demo, "FRONTIER_MODEL", "llama-tiny")  # the same code as llama-1b, in a second
    monkeypatch.setattr(demo, "FRONTIER_BATCH", 1)
    monkeypatch.setattr(demo, "FRONTIER_SEQ", 64)
    monkeypatch.setattr(demo, "FRONTIER_BUDGETS_GIB", (0.0005, 1))
    result = demo.run(str(tmp_path))
    proved = [r for r in result["records"] if not r.get("predicted")]
    ran = [r for r in proved if r["status"] == "ok" and "grads_equal" in r]
    assert {r["spec"] for r in ran} == set(demo.SPECS) and all(r["grads_equal"] for r in ran)
    bitwise = [r for r in ran if r["head"] == "plain" and r["spec"] not in demo.TILED]
    assert all(r["grads_how"].startswith("bitwise") for r in bitwise)
    for r in proved:
        if "predicted_peak_bytes" in r:                        # the CPU peak is the prediction
            assert abs(r["peak_bytes"] / r["predicted_peak_bytes"] - 1) < 0.01, r
    keep = next(r["peak_bytes"] for r in proved if r["spec"] == "keep")
    assert all(r["peak_bytes"] < keep for r in ran)        # each treatment did something
    table = result["table"]
    assert "## Predicted:" in table and "every number below is a prediction" in table
    assert "CPU step times are not shown" in table and "tokens/s (spread)" not in table
    assert (tmp_path / "bench.jsonl").exists() and (tmp_path / "bench.md").read_text() == table
    if result["plot"]:
        assert os.path.getsize(result["plot"]) > 10_000


def test_plain_remat_bench_means_the_demo_only_without_a_gpu_and_options(monkeypatch):
    import argparse

    from remat.cli import bench as command
    from remat.prove import demo
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    defaults = dict(uniform=command.DEFAULT_UNIFORM, steps=5, warmup=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert demo.is_requested(parser.parse_args([]), defaults)
    assert demo.is_requested(parser.parse_args(["--out", "x"]), defaults)
    for argv in (["--device", "cpu"], ["--model", "llama-tiny"], ["--only", "eager"], ["--steps", "3"]):
        assert not demo.is_requested(parser.parse_args(argv), defaults), argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not demo.is_requested(parser.parse_args([]), defaults)


# -- 5: the TRL snippet as written -------------------------------------------------------------
def test_no_snippet_is_rewritten_before_it_runs():
    with open(os.path.join(ROOT, "tests", "test_integrations_docs.py")) as f:
        source = f.read()
    assert "code.replace(" not in source and "use_cpu=True, " not in source
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    trl = re.search(r"```python\n(import torch\nfrom trl .*?)```", readme, re.S).group(1)
    assert "bf16=torch.cuda.is_available()" in trl and "use_cpu" not in trl


# -- 6: accelerate, in either order --------------------------------------------------------------
def test_accelerate_bf16_chunked_head_is_the_same_in_either_order():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    results = []
    for order in ("prepare-then-apply", "apply-then-prepare"):
        model = tiny_llama().train()
        if order == "prepare-then-apply":
            model = accelerator.prepare(model)
            remat.apply(model, "full", head="chunked")
        else:
            remat.apply(model, "full", head="chunked")
            model = accelerator.prepare(model)
        torch.manual_seed(0)
        loss = model(**_batch()).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    AcceleratorState._reset_state(reset_partial_state=True)


# -- 7: one error style ---------------------------------------------------------------------------
@pytest.mark.parametrize("call", [remat.remove, remat.current_plan, remat.apply])
def test_a_model_that_is_not_a_module_is_a_clear_type_error(call):
    with pytest.raises(TypeError, match=r"expects a torch.nn.Module as its first argument, got str \('model'\)"):
        call("model")


@pytest.mark.parametrize("argv, match", [
    (["--uniform", "bogus"], "--uniform bogus: cannot read spec 'bogus'"),
    (["--uniform", "full,every:0"], "--uniform every:0: cannot read spec 'every:0': N must be a whole number"),
    (["--only", "eager,remat:fast"], "--only remat:fast: cannot read spec 'fast'"),
])
def test_bench_refuses_a_bogus_spec_in_any_flag(capsys, tmp_path, argv, match):
    assert main(["bench", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat bench: error: ") and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_callback_budget_nothing_fits_stops_as_remat_plan_does(tmp_path):
    from transformers import Trainer

    from remat.integrations.hf import RematCallback
    from remat.planning.solver import NoPlanFits
    model = tiny_llama()
    with pytest.raises(NoPlanFits) as plan_error:
        remat.plan(model, _batch(), "1KiB")
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenData(),
                      callbacks=[RematCallback(budget="1KiB", say=lambda message: None)])
    with pytest.raises(NoPlanFits, match=r"RematCallback\(budget='1.00 KiB'\) cannot train this batch: no plan fits"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    with pytest.raises(NoPlanFits, match=r"remat.Guard\(budget='1.00 KiB'\)") as guard_error:
        remat.Guard(tiny_llama(), budget="1KiB")(lambda b: None, _batch())
    assert guard_error.value.smallest_peak == plan_error.value.smallest_peak


# -- 8: messages ---------------------------------------------------------------------------------
def test_remat_names_transformers_5_apis_and_calls_no_deprecated_one(capsys):
    from remat.integrations.hf import RematCallback
    model = tiny_llama()
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match=r"model.activation_checkpointing_disable\(\) first.*activation_checkpointing="
                                         r"False"):
        remat.apply(model, "full")
    messages = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("error", message=".*checkpointing.*", category=DeprecationWarning)
        RematCallback(budget="1GiB", say=messages.append)._take_over_model(model)
        assert not model.is_activation_checkpointing
        remat.apply(model, "full")
        with pytest.raises(ValueError, match="activation_checkpointing=False"):
            model.activation_checkpointing_enable()
        assert main(["doctor", "--model", "llama-tiny", "--batch", "1", "--seq", "64", "--budget", "1GiB",
                     "--hf-checkpointing"]) == 0
    assert "[warning]" in capsys.readouterr().out


def test_doctor_has_no_use_cache_note_for_a_model_remat_treats():
    from remat.diagnosis import doctor
    model = tiny_llama().train()
    assert model.config.use_cache is True                      # the config's default
    assert [f.check for f in doctor(model, _batch())] == ["use-cache"]
    remat.apply(model, "full")
    assert doctor(model, _batch()) == []                       # the README: use_cache on is fine


def test_env_says_what_memlock_and_pinned_memory_mean_for_offload(capsys):
    from remat.cli.env import meaning
    lines = meaning({"cuda_available": True, "offload_pinned_limit_bytes": 12 * 2**30,
                     "memlock_limit_bytes": 8 * 2**20})
    assert "pins at most 12.00 GiB" in lines[0] and "not counted against it" in lines[1]
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "offload_pinned_limit" in out and "memlock:" in out and "offload:" in out


def test_plot_budget_labels_carry_units(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from remat.prove import report
    axes = []
    subplots = plt.subplots

    def keep(*args, **kwargs):
        fig, ax = subplots(*args, **kwargs)
        axes.append(ax)
        return fig, ax
    monkeypatch.setattr(plt, "subplots", keep)
    rows = [dict(strategy="eager", kind="anchor", status="ok", peak_bytes=40 * 2**30, tokens_per_s=100.0),
            dict(strategy="remat@16GiB", kind="remat", status="ok", peak_bytes=15 * 2**30, tokens_per_s=90.0,
                 budget_bytes=16 * 2**30)]
    assert report.plot(rows, str(tmp_path / "p.png")) is None
    budgets = axes[0].child_axes[0]  # named on an axis above the plot, where no point or label covers them
    assert [t.get_text() for t in budgets.get_xticklabels()] == ["16 GiB"] and "budget" in budgets.get_xlabel()


def test_the_trl_message_says_what_happens_to_a_plan_applied_before(capsys):
    from remat.integrations.hf import RematCallback
    said = []
    model = remat.apply(tiny_llama(), "full", head="chunked")
    RematCallback(budget="1GiB", say=said.append)._cooperate_with_trl(model)
    assert "the blocks keep their plan until the callback plans them from the first batch" in said[0]
    assert remat.current_plan(model).head == "plain"
    said.clear()
    RematCallback(spec="full", say=said.append)._cooperate_with_trl(remat.apply(tiny_llama(), "full", head="chunked"))
    assert "the callback's spec replaces the blocks' plan now" in said[0]


# -- 9 and 10: what the README says ---------------------------------------------------------------
def test_the_readme_states_the_suite_time_and_the_cpu_plan_limit():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "under 10 minutes on 2 idle cores" in readme and "make test-all" in readme
    assert re.search(r"^test-all:", makefile, re.M) and re.search(r"^demo: install\n\t\$\(BIN\)/remat bench$",
                                                                     makefile, re.M)
    assert "math\nattention kernel" in readme or "math attention kernel" in readme.replace("\n", " ")


def test_a_gpu_plan_on_a_cpu_model_with_attention_dropout_is_noted():
    from remat.diagnosis import doctor
    model = tiny_llama().train()
    model.config.use_cache = False
    remat.apply(model, remat.plan(model, _batch(), "1GiB", gpu="h100"))
    assert doctor(model, _batch()) == []                       # no attention dropout: the CPU peak is the plan's
    model.config.attention_dropout = 0.1
    found = [f for f in doctor(model, _batch()) if f.check == "plan-gpu"]
    assert found and found[0].severity == "note" and "1.4-2x" in found[0].why


# -- the README's own snippets ------------------------------------------------------------------
def _readme_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().split("\n## Integrations\n", 1)[0]     # the Integrations section: test_integrations_docs
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _stand_ins():
    from test_profiling_models import ResidualMLP
    model = tiny_llama().train()
    model.config.use_cache = False
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()
    return dict(model=model, batch=_batch(), net=ResidualMLP(), x=torch.randn(4, 8, 16), train_step=train_step,
                loader=[_batch(), _batch(seq=24)], optimizer=optimizer)


def test_the_readme_snippets_are_found():
    blocks = _readme_blocks()
    assert len(blocks) == 2 and blocks[1].startswith("# GPU")


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=pytest.mark.gpu)])
def test_a_readme_snippet_runs_as_written(index, tmp_path, monkeypatch):
    code = _readme_blocks()[index]
    monkeypatch.chdir(tmp_path)
    namespace = dict(_stand_ins(), remat=remat)
    if index == 1:
        namespace["model"] = namespace["model"].cuda()
        namespace["batch"] = {k: v.cuda() for k, v in namespace["batch"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"README-block{index}", "exec"), namespace)
    assert os.path.exists("plan.json") or index == 1


def _readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if re.match(r"\s*remat (plan|estimate|doctor|bench|env) --", line)]


@pytest.mark.slow
@pytest.mark.parametrize("command", _readme_commands())
def test_a_readme_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    """The ``remat ...`` lines of the README's command-line listing (seconds each: big models on meta)."""
    import shlex
    monkeypatch.chdir(tmp_path)
    status = main(shlex.split(command)[1:])
    out = capsys.readouterr().out
    if shlex.split(command)[1] == "doctor":                    # the README shows a setup that does not fit
        assert status == 1 and "[error] does not fit: predicted" in out
    else:
        assert status == 0
