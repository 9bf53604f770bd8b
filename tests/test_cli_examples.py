"""Every example in every ``remat <command> --help`` runs and succeeds, as printed.

The lines are read from each command module's ``EXAMPLES`` (the text ``--help`` shows) and run
in-process through ``remat.cli.main`` in a scratch folder, where ``mistral-7b.json`` (the
example of a config file of any name) is written first, and ``plan.json`` (a llama-8b plan, as
``remat plan --out`` writes it) where an example reads one. An example whose comment starts
with ``GPU`` (``# GPU`` or ``# GPU: what it shows``) needs CUDA and is skipped without it; the
others run on the CPU. ``> file`` writes the command's stdout to that file, as a shell would. Big models are
planned on the meta device, so they cost seconds, not memory; they carry the ``slow`` mark.
"""
import json
import shlex
from importlib import import_module

import pytest

from remat.cli import COMMANDS, main

QUICK = ("llama-tiny", "remat env", "remat bench --only")  # seconds; everything else is marked slow


def _examples():
    for name, (module_name, _) in COMMANDS.items():
        for line in import_module(module_name).EXAMPLES.splitlines():
            if not line.startswith("  remat "):
                continue
            command, _, comment = line.strip().partition("#")
            marks = [pytest.mark.gpu] if comment.strip().split(":")[0].strip() == "GPU" else []
            if not any(word in command for word in QUICK):
                marks.append(pytest.mark.slow)
            yield pytest.param(command.strip(), marks=marks, id=command.strip())


EXAMPLES = list(_examples())


def test_every_command_has_examples():
    commands = {shlex.split(p.values[0])[1] for p in EXAMPLES}
    assert commands == set(COMMANDS)


@pytest.mark.parametrize("command", EXAMPLES)
def test_example_runs(command, tmp_path, monkeypatch, capsys):
    from transformers import MistralConfig
    monkeypatch.chdir(tmp_path)
    MistralConfig().to_json_file("mistral-7b.json")  # Mistral-7B's shape, the config-file example
    if "plan.json" in command and "--out plan.json" not in command:   # a plan `remat plan --out` wrote
        from remat import Plan
        notes = {"predicted_peak_bytes": 38 * 2**30, "predicted_step_s": 2.5}   # an eager plan's prediction
        Plan({f"model.layers.{i}": "full" for i in range(32)}, head="chunked", notes=notes).save("plan.json")
    command, _, redirect = command.partition(">")   # `remat ... > file`: stdout into that file, as a shell does
    argv = shlex.split(command)[1:]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if redirect.strip():
        with open(redirect.strip(), "w") as f:
            f.write(out)
    if "--json" in argv:   # bench prints JSON lines, plan and estimate one document
        [json.loads(line) for line in out.splitlines()] if argv[0] == "bench" else json.loads(out)
    if argv[0] == "bench":
        out_dir = argv[argv.index("--out") + 1] if "--out" in argv else "remat-bench"
        with open(f"{out_dir}/bench.jsonl") as f:
            failed = [r for r in map(json.loads, f) if r.get("status") == "error"]
        assert not failed, [(r["strategy"], r.get("reason")) for r in failed]
