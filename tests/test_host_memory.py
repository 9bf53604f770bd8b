"""Host memory is a budget too (issue 28): offload plans never ask the engine to pin more than the host gives."""
import dataclasses

import pytest
import torch

import remat
from remat.presets import build_model, load_config
from remat.offload.pinned import PinnedPool
from remat.planning.offload_model import pinned_bytes
from remat.planning.plans import OFFLOADING_TREATMENTS
from remat.planning.simulator import host_bytes


@pytest.fixture(scope="module")
def bench4():
    """The bench model's shapes with 8 blocks at 32k tokens (long enough that kept block inputs set
    the floor), on the meta device, profiled with fake tensors."""
    config = load_config("llama-1b")
    config.num_hidden_layers = 8
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    return remat.profile(model, torch.zeros(1, 32768, dtype=torch.long), gpu="h100", chunk_candidates=(4096,))


def test_pinned_bytes_are_the_pools_size_classes():
    sizes = [1, 2, 3, 4097, 2**20, 2**20 + 1, 3 * 2**30]
    assert pinned_bytes(sizes) == sum(PinnedPool.size_class(s) for s in sizes)


def _offloading(plan):
    return [t for t in plan.blocks.values() if t in OFFLOADING_TREATMENTS]


def _floor(prof, treatments=None):
    with pytest.raises(remat.NoPlanFits) as found:
        remat.solve(prof, 1, treatments=treatments)
    return found.value.smallest_peak


def test_a_plan_offloads_no_more_than_the_host_gives(bench4):
    """The fastest plan at some budget offloads; with one byte less of host memory than it pins,
    the plan found offloads less (here nothing: at 32k tokens tiling fits the budget instead,
    and offloading a recomputed block's input buys no time), still fits the GPU budget, and is
    no faster."""
    # from the smallest budget a plan without offload fits: the host limit then leaves a plan
    floor = _floor(bench4, [t for t in bench4.treatments() if t not in OFFLOADING_TREATMENTS])
    free = next(plan for plan in (remat.solve(bench4, int(floor * f)) for f in (1 + k / 100 for k in range(0, 101)))
                if _offloading(plan))
    budget, needed = free.notes["budget_bytes"], free.notes["host_bytes"]
    assert needed == host_bytes(bench4, list(free.blocks.values())) > 0
    limited = remat.solve(dataclasses.replace(bench4, host_limit=needed - 1), budget)
    assert limited.notes.get("host_bytes", 0) <= needed - 1  # offloads no more than the host allows
    assert limited.notes["predicted_peak_bytes"] <= budget
    assert limited.notes["predicted_step_s"] >= free.notes["predicted_step_s"]


def test_a_host_too_small_for_any_plan_is_named(bench4):
    """Between the smallest plan with offload and the smallest without, a host that pins 1 MiB
    leaves no plan; the error names the host and the smallest GPU budget without offload."""
    without = _floor(bench4, [t for t in bench4.treatments() if t not in OFFLOADING_TREATMENTS])
    budget = (_floor(bench4) + without) // 2
    with pytest.raises(remat.NoPlanFits, match=r"within the host's 1\.00 MiB of pinned memory") as found:
        remat.solve(dataclasses.replace(bench4, host_limit=2**20), budget)
    error = found.value
    assert error.host_limited
    assert error.smallest_peak > budget and not _offloading(error.plan)  # the smallest GPU budget without offload
    # `remat plan` words it for its own flag: only --host-memory limits the host there (without it a
    # meta-device plan has none), so not remat.plan's default for a profile measured on this GPU
    import argparse

    from remat.cli.plan import no_fit_message
    assert "60%" in str(error)
    text = no_fit_message(error, budget, argparse.Namespace(host_memory="1MiB", optimizer="none", fsdp=1, cp=1, ddp=1))
    assert "60%" not in text and "a larger --host-memory than 1MiB, or none" in text
    assert text.endswith("raise the GPU budget, or shorten the batch or sequence.")


def test_remat_plan_says_the_host_memory_a_plan_needs(capsys, tmp_path):
    """``remat plan`` prints the pinned bytes an offloading plan needs, and plans within
    ``--host-memory`` (here: without offload, which also fits the budget)."""
    from remat.cli import main
    config = load_config("llama-1b")
    config.num_hidden_layers = 8
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    common = ["plan", "--model", str(path), "--batch", "1", "--seq", "32768", "--gpu", "h100"]
    assert main([*common, "--budget", "5.5GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    host, plan = [line for line in out if line.startswith("host ")], [line for line in out if line.startswith("plan ")]
    assert host and "no limit given" in host[0] and "offload" in plan[0], out
    assert main([*common, "--budget", "5.5GiB", "--host-memory", "1MiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    host, plan = [line for line in out if line.startswith("host ")], [line for line in out if line.startswith("plan ")]
    assert not host and "offload" not in plan[0], out

