"""Importing remat and `remat --help` stay light: no torch, no transformers, no CUDA."""
import subprocess
import sys

import pytest


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_remat_imports_neither_torch_nor_transformers():
    out = _run("import sys, remat; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_cli_help_imports_no_torch():
    out = _run("import sys; from remat.cli import main; main(['--help']); print('torch' in sys.modules)")
    assert "commands:" in out and out.strip().endswith("False")


def test_using_remat_does_not_initialise_cuda():
    out = _run("import torch, remat; from remat.presets import load_config, build_model;"
               "m = build_model(load_config('llama-tiny')); remat.apply(m, 'full');"
               "print(torch.cuda.is_initialized())")
    assert out.strip() == "False"


def test_unknown_command_is_a_clear_error(capsys):
    from remat.cli import main
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_env_command_runs(capsys):
    from remat.cli import main
    assert main(["env", "--json"]) == 0
    assert '"torch"' in capsys.readouterr().out


def test_presets_and_config_paths(tmp_path):
    from remat.presets import load_config
    cfg = load_config("llama-8b")
    assert cfg.num_hidden_layers == 32 and cfg.vocab_size == 128256
    cfg.save_pretrained(tmp_path)
    assert load_config(str(tmp_path / "config.json")).hidden_size == 4096
    with pytest.raises(ValueError, match="preset"):
        load_config("llama-9000b")
