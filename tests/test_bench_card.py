"""The bench on an emulated card and beside the stacks users run, on the CPU.

The CUDA cap is mocked (``torch.cuda.set_per_process_memory_fraction`` and the device's size):
parsing and refusing cards, the cap set per row and put back, rows named uncapped; an
out-of-memory mid-step recorded with its phase and the next row run after the model is freed;
AdamW stepped; ceilings; the table and plot with reserved peaks and oom rows. Liger's module-wide
patch is a stand-in with Liger's shape (``MODEL_TYPE_TO_APPLY_LIGER_FN``), so the scope that builds
a Liger row's model after patching and puts ``modeling_llama`` back is checked without Triton.
"""
import gc
import json
import sys
import types
import weakref

import pytest
import torch

from remat.cli import main
from remat.prove import bench, card, report, stacks, strategies
from remat.prove.anchors import Skip

GiB = 2 ** 30
MiB = 2 ** 20


def _tiny_build():
    from remat.presets import build_model, load_config
    config = load_config("llama-tiny")
    config.num_hidden_layers = 2
    return build_model(config, device="cpu", dtype=torch.float32)


def _batch(seq=16):
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


class _FakeGPU:
    """A 140 GiB GPU as torch.cuda shows it, recording every fraction set."""

    def __init__(self, monkeypatch, total=140 * GiB, fraction=1.0):
        self.total, self.fraction, self.set = total, fraction, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H200")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=total))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction,
                            raising=False)

        def set_fraction(fraction, device=None):
            if not isinstance(fraction, float) or not 0 <= fraction <= 1:
                raise ValueError(f"Invalid fraction value: {fraction}")
            self.fraction = fraction
            self.set.append(round(fraction * total / GiB, 3))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)


# --- cards -----------------------------------------------------------------------------------

def test_a_card_is_a_size_on_a_gpu_at_most_its_size(monkeypatch):
    gpu = _FakeGPU(monkeypatch)
    h100 = card.parse_card("79.2GiB")
    assert h100.bytes == int(79.2 * GiB) and h100.fraction == pytest.approx(79.2 / 140)
    assert card.parse_card("80GB").bytes == 80 * 10 ** 9   # decimal, as remat.units reads it
    assert card.parse_card(None) is None
    with pytest.raises(ValueError, match=r"--card 200GiB \(200.00 GiB\) is more than this GPU has \(Fake H200: "
                                         r"140.00 GiB\).*Leave --card out"):
        card.parse_card("200GiB")
    for bad in ("80G", "lots", "-1GiB", "0"):
        with pytest.raises(ValueError, match="--card takes a card's memory"):
            card.parse_card(bad)
    with pytest.raises(ValueError, match="the bench runs on cpu"):
        card.parse_card("10GiB", device="cpu")
    assert gpu.set == []  # parsing sets nothing


def test_without_cuda_a_card_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="caps a CUDA GPU's memory.*no CUDA GPU is visible"):
        card.parse_card("15.5GiB")


def test_the_cap_is_set_for_the_region_and_the_previous_one_put_back(monkeypatch):
    gpu = _FakeGPU(monkeypatch, fraction=0.9)
    small = card.parse_card("14GiB")
    with card.capped(small):
        assert gpu.fraction == pytest.approx(14 / 140)
        with card.uncapped(small):
            assert gpu.fraction == 1.0
        assert gpu.fraction == pytest.approx(14 / 140)
    assert gpu.fraction == 0.9
    with pytest.raises(KeyError), card.capped(small):  # put back when the region raises too
        raise KeyError("x")
    assert gpu.fraction == 0.9
    with card.capped(None), card.uncapped(None):  # no card: nothing set
        pass
    assert gpu.set == [14.0, 140.0, 14.0, 126.0, 14.0, 126.0]


def test_a_cap_that_cannot_be_set_names_the_card(monkeypatch):
    _FakeGPU(monkeypatch)
    small = card.parse_card("14GiB")

    def refuse(fraction, device=None):
        raise RuntimeError("not supported on this device")
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refuse)
    with pytest.raises(RuntimeError, match=r"card 14.00 GiB.*cannot be set on this GPU.*not supported"):
        with card.capped(small):
            pass


def test_every_row_runs_under_the_card_except_those_named_uncapped(monkeypatch):
    gpu = _FakeGPU(monkeypatch, fraction=1.0)
    seen = []

    def noting(name):
        def prepare(model, batch):
            seen.append((name, round(gpu.fraction * gpu.total / GiB, 2)))
            return model, __import__("contextlib").nullcontext, None
        return prepare
    rows = [strategies.Strategy(n, "anchor", noting(n)) for n in ("eager", "hf_full", "every2")]
    small = card.parse_card("15.5GiB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the rows themselves run on the CPU
    records = bench.run("llama-tiny", batch_size=1, seq=16, device="cpu", dtype=torch.float32, strategy_list=rows,
                        warmup=1, steps=1, progress=None, card=small, uncapped_rows=("eager", "every2"))
    assert seen == [("eager", 140.0), ("hf_full", 15.5), ("every2", 140.0)]
    assert [r["card_bytes"] for r in records] == [None, small.bytes, None]
    assert gpu.fraction == 1.0
    assert [r["ceiling"] for r in records] == ["eager"] * 3 and records[0]["vs_ceiling"] == 1.0


# --- rows that fail, AdamW -------------------------------------------------------------------

def test_an_out_of_memory_mid_step_is_recorded_and_the_next_row_runs_on_freed_memory():
    built = []

    def build():
        built.append(weakref.ref(model := _tiny_build()))
        return model
    calls = []

    def failing(model, batch):
        def forward(**kw):
            calls.append(1)
            if len(calls) == 2:  # the second step: the warm-up went through
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return model(**kw)
        return forward, __import__("contextlib").nullcontext, None
    rows = [strategies.Strategy("huge", "anchor", failing), strategies.Strategy("eager", "anchor", strategies._plain)]
    first = bench.measure(build, rows[0], _batch(), warmup=1, steps=2)
    gc.collect()
    assert first["status"] == "oom" and first["phase"] == "steps" and "2.00 GiB" in first["reason"]
    assert built[0]() is None, "the failed row's model is still alive"
    second = bench.measure(build, rows[1], _batch(), warmup=1, steps=1)
    assert second["status"] == "ok"


def test_adamw_steps_after_each_backward_and_the_first_loss_is_the_untrained_ones():
    kept = []

    def build():
        kept.append(_tiny_build())
        return kept[-1]
    row = strategies.Strategy("eager", "anchor", strategies._plain)
    plain = bench.measure(build, row, _batch(), warmup=1, steps=1)
    before = {k: v.clone() for k, v in _tiny_build().state_dict().items()}
    stepped = bench.measure(build, row, _batch(), warmup=1, steps=1, optimizer="adamw")
    assert stepped["optimizer"] == "adamw" and "optimizer" not in plain
    assert stepped["loss"] == plain["loss"]
    assert not torch.equal(kept[-1].state_dict()["model.norm.weight"], before["model.norm.weight"])
    assert torch.equal(kept[0].state_dict()["model.norm.weight"], before["model.norm.weight"])
    assert stepped["peak_bytes"] > plain["peak_bytes"]  # two AdamW states per parameter
    fused = bench.measure(build, row, _batch(), warmup=1, steps=1, optimizer="adamw-forloop")
    assert fused["loss"] == plain["loss"] and fused["optimizer"] == "adamw-forloop"
    with pytest.raises(ValueError, match="optimizer must be one of none, adamw, adamw-fused"):
        bench.measure(build, row, _batch(), optimizer="sgd")


# --- the stacks ------------------------------------------------------------------------------

def _fake_liger(monkeypatch):
    """liger_kernel.transformers.monkey_patch with Liger's shape: a family's apply function that
    swaps the modeling module's classes and rope and the causal LM's forward, module-wide."""
    from transformers.models.llama import modeling_llama

    class FakeRMSNorm(modeling_llama.LlamaRMSNorm):
        pass

    class FakeMLP(modeling_llama.LlamaMLP):
        pass
    stock_forward = modeling_llama.LlamaForCausalLM.forward

    def lce_forward(self, *args, **kwargs):
        return stock_forward(self, *args, **kwargs)

    def apply(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
              model=None):
        modeling_llama.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: (q, k)
        modeling_llama.LlamaRMSNorm = FakeRMSNorm
        modeling_llama.LlamaMLP = FakeMLP
        modeling_llama.LlamaForCausalLM.forward = lce_forward
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    return FakeRMSNorm, FakeMLP, lce_forward


def test_a_liger_row_builds_its_model_patched_and_leaves_modeling_llama_as_it_was(monkeypatch):
    from transformers.models.llama import modeling_llama
    before = dict(vars(modeling_llama))
    before_class = dict(vars(modeling_llama.LlamaForCausalLM))
    norm, mlp, lce = _fake_liger(monkeypatch)
    stock = _tiny_build()
    with stacks.liger_patched("llama", cuda=True):
        patched = _tiny_build()
    after = _tiny_build()
    assert type(patched.model.layers[0].mlp) is mlp and type(patched.model.norm) is norm
    assert type(stock.model.layers[0].mlp) is type(after.model.layers[0].mlp) is before["LlamaMLP"]
    assert dict(vars(modeling_llama)) == before and dict(vars(modeling_llama.LlamaForCausalLM)) == before_class
    with pytest.raises(RuntimeError), stacks.liger_patched("llama", cuda=True):
        raise RuntimeError("the row failed")
    assert dict(vars(modeling_llama)) == before and modeling_llama.LlamaForCausalLM.forward is not lce

    # through the bench: the row's model is built inside the scope, the next row's outside
    types_seen = []

    def noting(model, batch):
        types_seen.append(type(model.model.layers[0].mlp))
        return model, __import__("contextlib").nullcontext, None
    rows = [strategies.Strategy("liger_keep", "anchor", noting, around=stacks.liger_patched),
            strategies.Strategy("eager", "anchor", noting)]
    monkeypatch.setattr(stacks, "liger_unavailable", lambda model_type, cuda: None)  # Triton "runs" on the CPU
    records = [bench.measure(_tiny_build, row, _batch(), warmup=1, steps=1, model_type="llama") for row in rows]
    assert [r["status"] for r in records] == ["ok", "ok"], records
    assert types_seen == [mlp, before["LlamaMLP"]]
    # the stand-in's rope (looked up at each call) changed the Liger row's loss, and only its
    assert records[0]["loss"] != records[1]["loss"]
    assert records[1]["loss"] == bench.measure(_tiny_build, rows[1], _batch(), warmup=1, steps=1)["loss"]


def test_stack_rows_that_cannot_run_are_skipped_with_the_reason(monkeypatch):
    listed = strategies.strategies([64 * MiB], uniform=(), compile_budgets=(), anchors=False,
                                   stack_rows=stacks.expand(["stacks"]), gpu="cpu")
    assert [s.name for s in listed] == ["unsloth", "liger_hf", "liger_keep", "remat@64MiB", "liger_remat@64MiB",
                                        "compile_hf"]
    by = {s.name: s for s in listed}
    assert by["liger_remat@64MiB"].kind == "remat" and by["liger_hf"].kind == by["compile_hf"].kind == "anchor"
    assert by["compile_hf"].compiled and by["liger_keep"].around is stacks.liger_patched
    for name in ("liger_hf", "liger_keep", "liger_remat@64MiB", "unsloth"):
        record = bench.measure(_tiny_build, by[name], _batch(), warmup=1, steps=1, model_type="llama")
        assert record["status"] == "skipped" and "only applies on a GPU" in record["reason"], record
    # on a GPU without the packages: what to install
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    assert "liger-kernel does not import here" in stacks.liger_unavailable("llama", cuda=True)
    monkeypatch.setitem(sys.modules, "unsloth_zoo", None)
    with pytest.raises(Skip, match="unsloth_zoo does not import here.*not among the ones carried"):
        stacks.unsloth_checkpointer()
    _fake_liger(monkeypatch)
    assert stacks.liger_unavailable("llama", cuda=True) is None
    assert "no kernels for the 'xlstm' family" in stacks.liger_unavailable("xlstm", cuda=True)
    with pytest.raises(ValueError, match=r"unknown stack rows \['liger'\]"):
        strategies.strategies([], stack_rows=["liger"])
    assert stacks.expand(["liger_hf", "stacks", "cce"]) == ["liger_hf", "liger_keep", "liger_remat", "compile_hf",
                                                            "unsloth", "cce"]


def test_compile_hf_checkpoints_then_compiles():
    import torch._dynamo
    (row,) = [s for s in strategies.strategies([], anchors=False, uniform=(), stack_rows=["compile_hf"],
                                               compile_backend="eager")]
    try:
        record = bench.measure(_tiny_build, row, _batch(), warmup=1, steps=1)
    finally:
        torch._dynamo.reset()
    assert record["status"] == "ok" and record["compiled"], record


def test_each_row_is_a_fraction_of_its_ceiling():
    def ok(name, tokens, **extra):
        return dict(strategy=name, kind="anchor", status="ok", tokens_per_s=tokens, **extra)
    records = [ok("eager", 100.0), ok("hf_full", 80.0), dict(strategy="liger_keep", kind="anchor", status="oom"),
               ok("compile_1", 130.0, compiled=True), ok("remat+compile@8GiB", 117.0, compiled=True)]
    bench.relate_ceilings(records)
    assert records[1]["ceiling"] == "eager" and records[1]["vs_ceiling"] == 0.8
    assert records[4]["ceiling"] == "compile_1" and records[4]["vs_ceiling"] == pytest.approx(0.9)
    records[2].update(ok("liger_keep", 125.0))
    bench.relate_ceilings(records)
    assert records[1]["ceiling"] == "liger_keep" and records[1]["vs_ceiling"] == 0.64


def test_the_table_and_plot_show_reserved_peaks_the_card_and_oom(tmp_path):
    base = dict(model="llama-1b", batch=4, seq=4096, dtype="bfloat16", gpu="H200", optimizer="adamw")
    timing = dict(step_s=0.3, step_s_min=0.3, step_s_max=0.3, loss=1.0)
    records = [
        dict(base, strategy="eager", kind="anchor", status="ok", peak_bytes=58 * GiB, reserved_peak_bytes=60 * GiB,
             tokens_per_s=50000.0, card_bytes=None, **timing),
        dict(base, strategy="hf_full", kind="anchor", status="oom", phase="steps", reason="CUDA out of memory",
             oom_peak_bytes=15 * GiB, oom_reserved_peak_bytes=int(15.5 * GiB), card_bytes=int(15.5 * GiB)),
        dict(base, strategy="remat@14GiB", kind="remat", status="ok", budget_bytes=14 * GiB, peak_bytes=14 * GiB,
             reserved_peak_bytes=int(15.4 * GiB), tokens_per_s=42000.0, card_bytes=int(15.5 * GiB), **timing)]
    bench.relate_all(records)
    table = report.markdown(records)
    assert "| strategy | card | budget | peak allocated | peak reserved |" in table
    assert "| eager | whole GPU |  | 58.00 GiB | 60.00 GiB |" in table
    assert "| hf_full | 15.50 GiB |  | **oom** (steps): 15.00 GiB at oom | 15.50 GiB at oom |" in table
    assert "reserved over budget" in table and "optimizer adamw" in table and "card 15.50 GiB" in table
    assert "0.840 |" in table  # remat@14GiB's fraction of the ceiling (eager)
    if report.plot(records, str(tmp_path / "p.png")) is None:  # matplotlib installed
        assert (tmp_path / "p.png").stat().st_size > 10_000


# --- the command -----------------------------------------------------------------------------

def test_the_command_refuses_a_card_it_cannot_emulate_before_building_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("nothing may be measured"))
    assert main(["bench", "--card", "15.5GiB", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--uncapped", "eager", "--out", str(tmp_path)]) == 2
    assert "no --card was given" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--anchors", "liger_fast", "--out", str(tmp_path)]) == 2
    assert "unknown anchors ['liger_fast']" in capsys.readouterr().err
    _FakeGPU(monkeypatch)
    assert main(["bench", "--card", "15.5GB!", "--only", "eager", "--out", str(tmp_path)]) == 2
    assert "--card takes a card's memory" in capsys.readouterr().err
    assert main(["bench", "--card", "150GiB", "--only", "eager", "--out", str(tmp_path)]) == 2
    assert "more than this GPU has" in capsys.readouterr().err
    assert main(["bench", "--card", "15GiB", "--uncapped", "liger_keep", "--only", "eager",
                 "--out", str(tmp_path)]) == 2
    assert "--uncapped names rows this run does not measure ['liger_keep']" in capsys.readouterr().err


def test_the_command_runs_the_stacks_with_adamw_and_records_them(tmp_path):
    out = tmp_path / "b"
    assert main(["bench", "--device", "cpu", "--model", "llama-tiny", "--batch", "1", "--seq", "16", "--steps", "1",
                 "--warmup", "1", "--optimizer", "adamw", "--anchors", "stacks", "--budgets", "64MiB",
                 "--only", "eager,hf_full,liger_hf,liger_keep,unsloth,liger_remat@64MiB", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in records] == ["eager", "hf_full", "unsloth", "liger_hf", "liger_keep",
                                                "liger_remat@64MiB"]
    assert {r["status"] for r in records[2:]} == {"skipped"}
    assert all(r["optimizer"] == "adamw" for r in records)
    assert records[1]["vs_ceiling"] == records[1]["tokens_per_s"] / records[0]["tokens_per_s"]
