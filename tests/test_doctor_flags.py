"""The doctor reads the setups users switch on with one flag as they are (issue 45): transformers'
``every_n_layers`` and ``offload=True``, accelerate's FSDP2 activation checkpointing and its offload,
Liger's ``use_liger_kernel``; each gets a ``setup-vs-plan`` note (its predicted peak and step beside
remat's plan at the same budget), and ``remat doctor --verify`` / ``doctor(verify=True)`` run
remat.verify on the setup."""
import os
import warnings
from unittest import mock

import pytest

import remat
from remat.diagnosis import doctor
from remat.diagnosis.findings import checkpointing_of
from remat.diagnosis.run_checks import synchronous_copy_s

pytest.importorskip("transformers")
from test_doctor import TIGHT, _args, _batch, _checks, _model  # noqa: E402
from versions import TRANSFORMERS_4  # noqa: E402

new_hf = pytest.mark.skipif(TRANSFORMERS_4, reason="every_n_layers= and offload= are transformers >= 5.16")


def _note(findings):
    notes = [f for f in findings if f.check == "setup-vs-plan"]
    assert len(notes) == 1, _checks(findings)
    return notes[0]


@new_hf
def test_every_n_layers_on_the_model_is_read_per_layer():
    model = _model()
    model.activation_checkpointing_enable(every_n_layers=2)
    ckpt = checkpointing_of(model)
    assert ckpt.every_n_layers == 2 and not ckpt.offload
    note = _note(doctor(model, _batch(), budget=TIGHT))
    assert "full on 1 of 2 blocks" in note.what and "remat's plan at" in note.what
    assert "every:2" in note.why


@new_hf
def test_offload_true_is_full_offload_with_its_copies_on_the_compute_stream(tmp_path):
    args = _args(tmp_path, activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True})
    note = _note(doctor(_model(), _batch(), training_args=args, budget=TIGHT))
    assert "full+offload on every block, offloaded synchronously" in note.what
    assert "save_on_cpu" in note.why
    model = _model()
    model.activation_checkpointing_enable(offload=True)
    assert checkpointing_of(model).offload   # transformers' checkpoint_func inside save_on_cpu, seen on the model


def test_synchronous_copies_are_charged_at_the_bus_rate():
    from types import SimpleNamespace
    rates = SimpleNamespace(d2h_Bps=50e9, h2d_Bps=25e9)
    sim = SimpleNamespace(offload_bytes=10**9, exposed_copy_s=0.01)
    assert synchronous_copy_s(SimpleNamespace(rates=rates), sim) == pytest.approx(0.02 + 0.04 - 0.01)


def test_fsdp2_checkpointing_and_its_offload_from_an_accelerate_config():
    config = {"fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True,
                              "fsdp_activation_checkpointing_offload": True}}
    findings = doctor(_model(), _batch(), budget=TIGHT, accelerate_config=config)
    note = _note(findings)
    assert note.what.startswith("accelerate's FSDP2 activation checkpointing (full+offload on every block")
    assert "checkpoint_wrapper" in note.why
    assert "rng-not-preserved" not in _checks(findings)            # no dropout: nothing to replay


def test_fsdp2_checkpointing_with_dropout_is_an_error():
    """accelerate 1.15's fsdp2_apply_ac wraps each block in checkpoint_wrapper(preserve_rng_state=False)."""
    config = {"fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}
    findings = doctor(_model(attention_dropout=0.1), accelerate_config=config)
    assert _checks(findings) == ["rng-not-preserved"] and "preserve_rng_state=False" in findings[0].why
    config["fsdp_config"]["fsdp_version"] = 1                       # FSDP1's wrapper keeps the RNG state
    assert doctor(_model(attention_dropout=0.1), accelerate_config=config) == []


def test_liger_is_read_as_the_chunked_head_and_not_judged_on_speed(tmp_path):
    args = _args(tmp_path, use_liger_kernel=True, gradient_checkpointing=True)
    findings = doctor(_model(), _batch(), training_args=args, budget="1GB")
    note = _note(findings)
    assert "with Liger's kernels" in note.what and "chunked head" in note.why
    assert "apply_liger_kernel_to_" in note.fix
    assert not {"faster-plan", "keep-fits"} & set(_checks(findings))   # Liger's kernels are not timed here


def test_all_or_nothing_checkpointing_gets_no_note(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "setup-vs-plan" not in _checks(doctor(_model(), _batch(), training_args=args, budget=TIGHT))


def _with_dropout():
    model = _model(attention_dropout=0.1)
    for module in model.modules():   # the attention modules read the probability once, when built
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return model


def test_doctor_verify_finds_wrong_gradients():
    model = _with_dropout()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                          "preserve_rng_state": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = doctor(model, _batch(), verify=True)
    assert set(_checks(findings)) == {"rng-not-preserved", "wrong-gradients"}
    wrong = next(f for f in findings if f.check == "wrong-gradients")
    assert wrong.severity == "error" and "in float64 still" in wrong.why
    good = remat.apply(_with_dropout(), "full")
    assert doctor(good, _batch(), verify=True) == []


def _cli(argv, capsys):
    from remat.cli import main
    with mock.patch.dict(os.environ), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@new_hf
def test_cli_flags(capsys):
    status, out, _ = _cli(["doctor", "--model", "llama-tiny", "--batch", "1", "--seq", "64", "--budget", "1GiB",
                           "--hf-checkpointing", "--every-n-layers", "2"], capsys)
    assert "[note] Hugging Face checkpointing (full on 2 of 4 blocks)" in out
    status, out, err = _cli(["doctor", "--model", "llama-tiny", "--every-n-layers", "2"], capsys)
    assert status == 2 and "add --hf-checkpointing" in err
    status, out, _ = _cli(["doctor", "--model", "llama-tiny", "--batch", "1", "--seq", "64", "--budget", "1GiB",
                           "--fsdp-checkpointing-offload"], capsys)
    assert "accelerate's FSDP2 activation checkpointing (full+offload" in out


@pytest.mark.slow   # a preset built on the CPU and verified (the help's --verify example runs in make test)
def test_cli_doctor_verify(capsys):
    status, out, err = _cli(["doctor", "--model", "llama-tiny", "--batch", "1", "--seq", "32", "--dtype", "fp32",
                             "--hf-checkpointing", "--no-preserve-rng", "--dropout", "0.1", "--verify"], capsys)
    assert status == 1 and "[error]" in out and "remat.verify: Hugging Face checkpointing" in out
    assert "WRONG" in out
    status, out, err = _cli(["doctor", "--model", "llama-tiny", "--verify"], capsys)
    assert status == 2 and "--verify runs a setup" in err
