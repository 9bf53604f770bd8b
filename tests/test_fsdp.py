"""remat under data parallelism, two CPU processes (gloo): FSDP2, DDP and FSDP1.

One process group (tests/fsdp_worker.py, one process per rank) runs every case, because
starting processes that import torch and transformers costs more than all the cases together;
each test below reads its part of the group's report. What is checked, and why gradients
are compared exactly in some places and with a tolerance in others, is in the worker's docstring.
"""
import json
import os

import pytest

from launches import launch


def _cpu_fsdp2_supported() -> bool:
    import torch  # torch 2.6's FSDP2 calls Stream.record_event, which its CPU stream lacks
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 7)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not _cpu_fsdp2_supported():
        pytest.skip("FSDP2 on the CPU needs torch >= 2.7")
    record = tmp_path_factory.mktemp("fsdp") / "counts.json"
    worker = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
    results = launch(worker, ["--record", str(record)])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
    lines = results[0][1].strip().splitlines()
    problems = [] if lines[-1:] == ["OK"] else lines
    return problems, json.loads(record.read_text())["counts"]


def _problems(report, prefix):
    return [p for p in report[0] if f" {prefix}" in p]


def test_every_treatment_and_the_chunked_head_under_fsdp2(report):
    """fully_shard per block then root after remat.apply: fp32 and bf16 MixedPrecisionPolicy,
    reshard_after_forward True and False; gradients equal the untreated sharded run's (exact)
    and, averaged over ranks, the whole-batch single-process run's (fp32 tolerance)."""
    cases = [c for c in report[1] if c.startswith("fsdp2/")]
    assert len(cases) == 4 * 9, cases
    assert _problems(report, "fsdp2/") == []


def test_tied_embeddings_with_the_chunked_head_under_fsdp2(report):
    assert "fsdp2-tied/fp32/reshard=True/full+chunked" in report[1]
    assert _problems(report, "fsdp2-tied/") == []


def test_every_treatment_and_the_chunked_head_under_ddp(report):
    """DistributedDataParallel without find_unused_parameters: no 'marked ready twice', same gradients."""
    assert len([c for c in report[1] if c.startswith("ddp/")]) == 9
    assert _problems(report, "ddp/") == []


def test_recompute_adds_no_collectives(report):
    """The mechanism: remat's recompute runs inside the block's backward, so every treatment
    issues the untreated model's all-gathers and reduce-scatters (FSDP2) or all-reduces (DDP)."""
    counts = report[1]
    for wrapper in ("fsdp2/fp32/reshard=True", "fsdp2/bf16/reshard=False", "ddp"):
        keep, full = counts[f"{wrapper}/keep"], counts[f"{wrapper}/full"]
        assert full == keep, (wrapper, full, keep)
    layers = 2
    # one all-gather per block and the root in forward, again in backward when resharded
    assert counts["fsdp2/fp32/reshard=True/full"]["all_gather"] == 2 * (layers + 1)
    assert counts["fsdp2/fp32/reshard=False/full"]["all_gather"] == layers + 1
    assert counts["fsdp2/fp32/reshard=True/full"]["reduce_scatter"] == layers + 1
    assert counts["ddp/full"]["all_reduce"] == 1  # one gradient bucket for a tiny model
    # every case, against its own wrapper's untreated run (the worker also checks this)
    assert [p for p in report[0] if "without remat" in p] == []


def test_fsdp1_with_hugging_face_checkpointing_adds_no_all_gathers(report):
    """FSDP1 (FullyShardedDataParallel per decoder layer) with HF gradient checkpointing, reentrant
    or not, and with remat: the all-gathers of the run without checkpointing."""
    counts = report[1]
    assert _problems(report, "fsdp1/") == []
    eager = counts["fsdp1/eager"]["all_gather"]
    for variant in ("hf_full", "hf_full_reentrant", "remat_full"):
        assert counts[f"fsdp1/{variant}"]["all_gather"] == eager, variant
