"""``examples/train_long.py`` under torchrun on the CPU (gloo), as its docstring runs it (issue 32).

Four launches start together (each spends most of its time importing torch and transformers):
the example with CP 2 on two ranks (planned on rank 0 and broadcast, the sequence split head-tail,
FSDP2 over both ranks), the same with contiguous pieces (``--contiguous``, a fixed spec), the same
steps on one rank over the whole sequence (the reference), and a budget below the floor on two
ranks. The loss of every step must equal the one-rank run's: fp32,
the same weights (``--same-init``) and tokens, the same sums in another order.
"""
import os
import sys

import pytest

from launches import TORCHRUN, run_concurrently, torchrun
from test_fsdp import _cpu_fsdp2_supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = "examples/train_long.py"
CPU = ["--device", "cpu", "--model", "llama-tiny", "--steps", "2", "--same-init"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not os.path.exists(TORCHRUN):
        pytest.skip(f"no torchrun beside {sys.executable}")
    if not _cpu_fsdp2_supported():
        pytest.skip("FSDP2 on the CPU needs torch >= 2.7")
    out = tmp_path_factory.mktemp("train_long")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    commands = {
        "cp": torchrun(EXAMPLE, [*CPU, "--cp", "2", "--budget", "3MiB", "--plan-out", str(out / "plan.json")]),
        "one": torchrun(EXAMPLE, [*CPU, "--cp", "1", "--plan", "keep"], nproc=1),
        "contiguous": torchrun(EXAMPLE, [*CPU, "--cp", "2", "--contiguous", "--plan", "full"]),
        "nofit": torchrun(EXAMPLE, [*CPU, "--cp", "2", "--budget", "100KiB"]),
    }
    return run_concurrently(commands, cwd=ROOT, env=env), out


def _losses(output):
    return [float(line.split("loss ")[1].split()[0]) for line in output.splitlines() if line.startswith("step ")]


def test_train_long_plans_splits_the_sequence_and_trains(runs):
    (output, code), out = runs[0]["cp"], runs[1]
    assert code == 0, output[-4000:]
    assert "plan for one of 2 ranks (1 data-parallel x 2 context-parallel, 32 of 64 tokens a rank):" in output
    assert "tokens/s per GPU" in output and "planned" in output and "the optimizer's" in output
    import remat
    plan = remat.Plan.load(str(out / "plan.json"))
    notes = plan.notes
    assert notes["cp_world"] == 2 and notes["cp_seq"] == 64 and notes["seq"] == 32, notes
    assert notes["fsdp_world"] == 2 and notes["predicted_optimizer_s"] > 0, notes
    assert notes["predicted_peak_bytes"] <= notes["budget_bytes"]


@pytest.mark.parametrize("layout", ["cp", "contiguous"])
def test_train_long_loss_equals_one_process(runs, layout):
    (cp, code), (one, one_code) = runs[0][layout], runs[0]["one"]
    assert code == 0 and one_code == 0, (cp[-2000:], one[-2000:])
    split, whole = _losses(cp), _losses(one)
    assert len(split) == len(whole) == 2, (cp[-2000:], one[-2000:])
    # a random model's loss is about ln(512); the second step follows one AdamW step on CP gradients
    assert 5.5 < whole[0] < 7.0, whole
    assert split == pytest.approx(whole, rel=1e-5, abs=0), (split, whole)


def test_train_long_below_the_floor_ends_with_one_line(runs):
    output, code = runs[0]["nofit"]
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("train_long.py:")]
    assert len(lines) == 1, output[-3000:]   # rank 0 alone says it
    assert lines[0].startswith("train_long.py: no plan fits 100.00 KiB: the smallest budget that fits is "), lines
    assert not _losses(output)
