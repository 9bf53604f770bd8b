"""``remat doctor`` (issue 13): each check is triggered by a setup built to have that one
problem, and says nothing on a good one. The GPU check (measured against predicted) carries
the gpu marker. Compiled models are compiled (``Module.compile()``, ``torch.compile``) but never
called here: doctor reads how they will run and steps them eagerly."""
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn as nn

import remat
from remat.diagnosis import Finding, doctor

pytest.importorskip("transformers")
from test_integrations_hf import VOCAB, tiny_llama, with_lora  # noqa: E402
from versions import TORCH, TRANSFORMERS_4  # noqa: E402

# the tiny Llama at 2 x 16 tokens, no optimizer state: keeping everything peaks at ~316 kB
# and the smallest plan at ~265 kB, so this budget needs some checkpointing
TIGHT = 300_000


def _model(**config):
    model = tiny_llama().train()
    model.config.use_cache = False
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


def _batch():
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def _args(tmp_path, **extra):
    """TrainingArguments for doctor to read. Transformers 4.x's ``fsdp=`` exports ACCELERATE_USE_FSDP
    and FSDP_* to ``os.environ``, where every later Accelerator of this process finds them (a CPU
    Trainer then asks for a GPU): the environment is put back."""
    from transformers import TrainingArguments
    with warnings.catch_warnings(), mock.patch.dict(os.environ):
        warnings.simplefilter("ignore")
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **extra)


def _checks(findings):
    return [f.check for f in findings]


def test_good_setups_are_silent(tmp_path):
    model = _model()
    assert doctor(model, _batch(), training_args=_args(tmp_path), budget="1GB") == []
    remat.auto(model, _batch(), budget=TIGHT)                      # the plan this budget needs
    assert doctor(model, _batch(), training_args=_args(tmp_path), budget=TIGHT) == []
    lora = with_lora(_model())
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert doctor(lora, _batch(), training_args=args) == []


def test_doctor_leaves_the_model_as_it_found_it():
    model = _model()
    model.model.layers[0].mlp.up_proj.weight.grad = torch.ones_like(model.model.layers[0].mlp.up_proj.weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    doctor(model, _batch(), budget="1GB")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight.grad,
                       torch.ones_like(model.model.layers[0].mlp.up_proj.weight))
    assert model.model.layers[1].mlp.up_proj.weight.grad is None


def test_parameter_without_gradient():
    model = _model()
    model.unused = nn.Linear(4, 4)           # trainable, never reached by the forward
    findings = doctor(model, _batch())
    assert _checks(findings) == ["no-grad"] and findings[0].severity == "error"
    assert "unused.weight" in findings[0].what and "unused.bias" in findings[0].what


def test_use_cache_during_training():
    findings = doctor(_model(use_cache=True), _batch())
    assert _checks(findings) == ["use-cache"] and findings[0].severity == "note"
    assert doctor(_model(use_cache=True)) == []             # no training step, nothing to say


def test_hf_and_fsdp_checkpointing_both_on(tmp_path):
    args = _args(tmp_path, fsdp="full_shard", fsdp_config={"activation_checkpointing": True},
                 gradient_checkpointing=True)
    findings = doctor(_model(), training_args=args)
    assert _checks(findings) == ["hf-and-fsdp-checkpointing"]
    assert "gradient_checkpointing" in findings[0].what and "activation_checkpointing" in findings[0].what
    accelerate_config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_activation_checkpointing": True}}
    args = _args(tmp_path, gradient_checkpointing=True)
    assert _checks(doctor(_model(), training_args=args, accelerate_config=accelerate_config)) == \
        ["hf-and-fsdp-checkpointing"]
    assert doctor(_model(), training_args=_args(tmp_path, fsdp="full_shard",
                                                fsdp_config={"activation_checkpointing": True})) == []


def test_reentrant_checkpointing_with_frozen_inputs(tmp_path):
    """LoRA (frozen embeddings) under reentrant checkpointing whose blocks' inputs do not require
    grad: the adapters get no gradient. transformers 5 adds the input-grad hook when it switches
    checkpointing on, so the bad setup is the hook taken off again; 4.x adds it only for adapters
    it loaded itself, so a PEFT-wrapped model is the bad setup until the hook is added."""
    lora = with_lora(_model())
    base = lora.base_model.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if TRANSFORMERS_4:
        assert _checks(doctor(lora, _batch())) == ["reentrant-frozen-inputs", "no-grad"]
        base.enable_input_require_grads()
    assert doctor(lora, _batch()) == []                         # transformers' hook: adapters train
    base.disable_input_require_grads()
    findings = doctor(lora, _batch())
    assert _checks(findings) == ["reentrant-frozen-inputs", "no-grad"]
    assert findings[0].severity == "error" and "lora_A" in findings[1].what
    # TrainingArguments asking for it: doctor says what the Trainer's enable call will leave, as this
    # transformers' enable call on a fresh LoRA model shows (the embeddings' output requires grad: hooked)
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    expected = [] if _hooked_by_enable() else ["reentrant-frozen-inputs"]
    assert _checks(doctor(with_lora(_model()), training_args=args)) == expected


def _hooked_by_enable() -> bool:
    """Whether this transformers' checkpointing switch, as the Trainer calls it, hooks a LoRA model's
    frozen input embeddings so that their output requires grad."""
    lora = with_lora(_model())
    embeddings = lora.base_model.model.get_input_embeddings()
    assert not embeddings(_batch()["input_ids"]).requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return embeddings(_batch()["input_ids"]).requires_grad


def test_a_removed_input_grad_hook_left_on_the_model_is_no_hook():
    """Transformers 4.x's ``disable_input_require_grads`` removes the hook and leaves its handle as
    ``_require_grads_hook``: doctor reads whether the hook is installed, not whether a handle is there."""
    lora = with_lora(_model())
    base = lora.base_model.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if getattr(base, "_require_grads_hook", None) is not None:  # transformers 5 hooked the inputs itself
        base.disable_input_require_grads()
    handle = base.get_input_embeddings().register_forward_hook(lambda m, args, out: out.requires_grad_(True))
    handle.remove()
    base._require_grads_hook = handle                           # as transformers 4.x's disable leaves it
    assert _checks(doctor(lora, _batch())) == ["reentrant-frozen-inputs", "no-grad"]


def test_rng_state_not_preserved_with_dropout(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve_rng_state": False})
    findings = doctor(_model(attention_dropout=0.1), training_args=args)
    assert _checks(findings) == ["rng-not-preserved"] and findings[0].severity == "error"
    assert doctor(_model(), training_args=args) == []          # no dropout: no randomness to replay


def test_checkpointing_that_is_not_needed():
    model = remat.apply(_model(), "full")
    findings = doctor(model, _batch(), budget="1GB")
    assert _checks(findings) == ["keep-fits"] and findings[0].severity == "warning" and findings[0].cost > 0
    hf = _model()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    findings = doctor(hf, _batch(), budget="1GB")
    assert _checks(findings) == ["keep-fits"] and "Hugging Face" in findings[0].what
    assert hf.model.gradient_checkpointing                    # switched back on after the profile


def test_a_faster_plan_fits_the_budget():
    model = remat.apply(_model(), "full", head="chunked")
    findings = doctor(model, _batch(), budget=TIGHT)
    assert _checks(findings) == ["faster-plan"] and findings[0].cost >= 0.05


def _planned(model, **notes):
    """``model`` with the plan remat.plan makes for TIGHT applied, its notes updated with ``notes``."""
    import dataclasses
    plan = remat.plan(model, _batch(), TIGHT)
    return remat.apply(model, dataclasses.replace(plan, notes=dict(plan.notes, **notes)))


def test_a_plan_for_compile_on_a_model_that_runs_eagerly():
    model = _planned(_model(), compile=True)
    findings = doctor(model)
    assert _checks(findings) == ["compile-mismatch"] and findings[0].severity == "warning"
    assert "made for a compiled model" in findings[0].what and "runs uncompiled" in findings[0].what
    assert "27.6 GiB eager, 15.8 GiB compiled" in findings[0].why and "model.compile()" in findings[0].fix
    assert doctor(model, compiled=True) == []                  # compiled after doctor: what the plan is for
    model.compile()
    assert doctor(model) == []
    assert doctor(remat.apply(_model(), "full")) == []          # a spec: no prediction to break


def test_an_eager_plan_on_a_compiled_model():
    model = _planned(_model())
    assert doctor(model) == []
    in_place = _planned(_model())
    in_place.compile()
    for compiled in (torch.compile(model), in_place):           # a wrapper, or compiled in place
        findings = doctor(compiled)
        assert _checks(findings) == ["compile-mismatch"] and "made for eager execution" in findings[0].what
        assert "compile=True" in findings[0].fix
    block = _planned(_model())
    block.model.layers[0].compile()                            # per-block compile counts too
    assert _checks(doctor(block)) == ["compile-mismatch"]
    assert doctor(block, compiled=False) == []


def test_a_compiled_model_is_stepped_eagerly_and_not_judged_by_eager_plans():
    model = _planned(_model(), compile=True)
    model.compile()
    never = lambda *args, **kwargs: pytest.fail("doctor ran the compiled forward")  # noqa: E731
    model._compiled_call_impl = never
    findings = doctor(model, _batch(), budget=TIGHT)
    assert _checks(findings) == ["plans-not-checked"] and findings[0].severity == "note"
    assert "compile=True" in findings[0].fix
    assert model._compiled_call_impl is never                 # put back


def test_an_all_ones_attention_mask_on_a_compiled_sdpa_model():
    model = remat.apply(_model(), "keep")
    batch = _batch()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    findings = doctor(model, batch, compiled=True)
    assert _checks(findings) == ["compiled-attention-mask"] and findings[0].severity == "warning"
    assert "(2, 16)" in findings[0].what and "causal" in findings[0].why and "leave attention_mask out" in findings[0].fix
    assert doctor(model, batch) == []                          # eager: transformers skips the mask itself
    padded = dict(batch, attention_mask=batch["attention_mask"].clone())
    padded["attention_mask"][0, :3] = 0
    assert doctor(model, padded, compiled=True) == []          # padding: the mask is needed
    assert doctor(model, _batch(), compiled=True) == []        # no mask: remat's skip applies
    with torch.device("meta"):                                 # a model and batch without values
        on_meta = remat.apply(_model(), "keep")
    unknown = {key: value.to("meta") for key, value in batch.items()}
    assert "compiled-attention-mask" not in _checks(doctor(on_meta, unknown, compiled=True))
    model.config._attn_implementation = "eager"
    assert doctor(model, batch, compiled=True) == []           # not SDPA


def test_segments_plans_are_not_simulated():
    from remat.planning.simulator import simulate
    from remat.profiling.profiler import profile
    model = remat.apply(_model(), "segments:2")
    with pytest.raises(ValueError, match="segments plan .* applied as given and not simulated"):
        simulate(profile(model, _batch()), remat.api.current_plan(model))
    findings = doctor(model, _batch(), budget="1GB")            # keep fits: said without a simulation
    assert _checks(findings) == ["keep-fits"] and "segments timed as full" in findings[0].why
    findings = doctor(model, _batch(), budget=TIGHT)
    assert _checks(findings) == ["plans-not-checked"] and "segments plan" in findings[0].what
    assert "faster-plan" in findings[0].what


def test_findings_are_ordered_worst_first(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve_rng_state": False})
    model = _model(attention_dropout=0.1, use_cache=True)
    model.unused = nn.Linear(2, 2)
    findings = doctor(model, _batch(), training_args=args)
    assert _checks(findings) == ["rng-not-preserved", "no-grad", "use-cache"]
    assert all(isinstance(f, Finding) for f in findings)
    with pytest.raises(Exception):
        findings[0].cost = 0.0                                  # frozen


@pytest.mark.gpu
def test_measured_peak_far_from_the_plan_prediction():
    """A plan made for one sequence of 16 tokens, run on 8 x 256: the prediction is far off."""
    model = _model().cuda()
    small = {k: v[:1].cuda() for k, v in _batch().items()}
    remat.auto(model, small, budget="1GB")
    ids = torch.randint(0, VOCAB, (8, 256), device="cuda")
    findings = doctor(model, {"input_ids": ids, "labels": ids}, run_step=True)
    assert "prediction-off" in _checks(findings)
    remat.auto(model, {"input_ids": ids, "labels": ids}, budget="1GB")
    assert "prediction-off" not in [f.check for f in doctor(model, {"input_ids": ids, "labels": ids},
                                                              run_step=True) if f.severity == "warning"]


def _cli(argv, capsys):
    """``remat doctor *argv`` as the command line runs it: (exit status, stdout)."""
    from remat.cli import main
    status = main(["doctor", *argv])
    return status, capsys.readouterr().out


def test_cli_good_model_says_nothing_is_wrong(capsys):
    status, out = _cli(["--model", "llama-tiny"], capsys)
    assert status == 0 and "no problems found" in out


def test_cli_names_checkpointing_a_budget_does_not_need(capsys):
    status, out = _cli(["--model", "llama-tiny", "--batch", "1", "--seq", "64", "--budget", "1GiB",
                        "--hf-checkpointing"], capsys)
    assert status == 0 and "[warning]" in out and "keeping every activation fits" in out


def test_cli_plan_file(tmp_path, capsys):
    from remat.cli import main
    plan = tmp_path / "plan.json"
    remat.Plan(blocks={f"model.layers.{i}": "full" for i in range(4)}).save(str(plan))
    status, out = _cli(["--model", "llama-tiny", "--seq", "64", "--budget", "1GiB", "--plan", str(plan)], capsys)
    assert status == 0 and "the applied remat plan (4x full" in out
    assert main(["doctor", "--model", "llama-tiny", "--reentrant"]) == 2
    assert "--hf-checkpointing" in capsys.readouterr().err


def test_cli_plan_made_for_compile(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    notes = {"predicted_peak_bytes": 2**20, "predicted_step_s": 0.01, "compile": True}
    remat.Plan(blocks={f"model.layers.{i}": "full" for i in range(4)}, notes=notes).save(str(plan))
    status, out = _cli(["--model", "llama-tiny", "--plan", str(plan)], capsys)
    assert status == 0 and "[warning]" in out and "runs uncompiled" in out
    status, out = _cli(["--model", "llama-tiny", "--plan", str(plan), "--compile"], capsys)
    assert status == 0 and "no problems found" in out


def test_a_compiled_plan_of_the_other_scope():
    """Seen compiled, the plan's scope is checked: a whole-model plan (compile=True, or one from before
    scopes) on per-block compile is a warning (its head runs eager), a per-block plan on a whole
    compiled model a note; the matching scope, or compiled=True told rather than seen, says nothing."""
    for notes in ({"compile": True}, {"compile": True, "compile_scope": "model"}):
        blocks = _planned(_model(), **notes)
        for layer in blocks.model.layers:
            layer.compile()
        findings = doctor(blocks)
        assert _checks(findings) == ["compile-mismatch"] and findings[0].severity == "warning", notes
        assert "only modules inside it are compiled" in findings[0].what and "compile='blocks'" in findings[0].fix
        assert doctor(blocks, compiled=True) == []
    per_block = _planned(_model(), compile=True, compile_scope="blocks")
    for layer in per_block.model.layers:
        layer.compile()
    assert doctor(per_block) == []
    whole = _planned(_model(), compile=True, compile_scope="blocks")
    whole.compile()
    findings = doctor(whole)
    assert _checks(findings) == ["compile-mismatch"] and findings[0].severity == "note"
    assert "whole model is compiled" in findings[0].what


@pytest.mark.skipif(TORCH < (2, 7), reason="FSDP2 on the CPU needs torch >= 2.7 (torch 2.6's FSDP2 calls "
                                           "Stream.record_event, which its CPU stream lacks)")
def test_eager_selective_under_fsdp2_is_flagged(tmp_path):
    """``fsdp-eager-selective``: blocks treated ``selective`` in a model FSDP2 shards, run eager
    (the planner leaves them out there); not for ``mlp``, not when the model runs compiled, not
    without FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    selective = _model()
    remat.apply(selective, "selective")
    assert "fsdp-eager-selective" not in _checks(doctor(selective))      # one GPU: the host runs ahead
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for spec in ("selective", "mlp"):
            model = _model()
            remat.apply(model, spec)
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
            found = [f for f in doctor(model) if f.check == "fsdp-eager-selective"]
            assert len(found) == (spec == "selective"), spec
            assert all(f"{len(model.model.layers)} block(s)" in f.what for f in found)
            assert not [f for f in doctor(model, compiled=True) if f.check == "fsdp-eager-selective"]
    finally:
        dist.destroy_process_group()


def test_per_block_compile_with_the_cache_on_is_flagged():
    """``compiled-blocks-cache``: blocks compiled each alone with ``use_cache`` on, as the config's
    default leaves it (every block a new graph); not with the cache off, nor for a whole compiled
    model, nor eager."""
    model = tiny_llama().train()
    assert model.config.use_cache is True     # the config's default, as from_pretrained gives it
    assert "compiled-blocks-cache" not in _checks(doctor(model))
    for block in model.model.layers:
        block.compile(backend="eager")
    found = [f for f in doctor(model) if f.check == "compiled-blocks-cache"]
    assert len(found) == 1 and found[0].severity == "warning" and "use_cache" in found[0].fix
    model.config.use_cache = False
    assert "compiled-blocks-cache" not in _checks(doctor(model))
    whole = tiny_llama().train()
    whole.compile(backend="eager")
    assert "compiled-blocks-cache" not in _checks(doctor(whole))


def test_the_documented_import_of_the_doctor_still_works():
    from remat.integrations.doctor import Finding as documented_finding, doctor as documented
    assert documented is doctor and documented_finding is Finding
