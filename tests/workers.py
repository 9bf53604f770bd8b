"""What the gloo worker processes share (tests/fsdp_worker.py, tests/cp_worker.py): joining the
process group, collecting every rank's problems, and rank 0's report.

A worker runs as one process per rank (RANK and WORLD_SIZE set by :func:`launches.launch`, which
also hands it a rendezvous file; or MASTER_ADDR and MASTER_PORT by hand or by torchrun), joins with
:func:`init`, checks its cases, and ends with :func:`finish`: rank 0 prints ``OK`` or every
rank's problems (the test reads its last lines) and, with a record path, writes the cases'
measurements as JSON beside the versions they were measured with.
"""
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from launches import RENDEZVOUS


class Worker:
    """One rank's findings: ``problems`` (one line each, the rank and case first)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.problems = []

    def fail(self, case: str, message: str) -> None:
        self.problems.append(f"rank {self.rank} {case}: {message}")


def init(backend: str = "gloo") -> None:
    """``init_process_group(backend)`` at the launch's rendezvous file (:data:`launches.RENDEZVOUS`),
    or from MASTER_ADDR and MASTER_PORT where none is given (a worker started by hand or torchrun)."""
    if os.environ.get(RENDEZVOUS):
        dist.init_process_group(backend, init_method=os.environ[RENDEZVOUS], rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def start() -> tuple:
    """Joins the gloo group on the CPU: ``(rank, world)``. One torch thread a rank (the ranks share
    a CPU: more threads only contend); warnings off (offload's no-CUDA note and torch's deprecations
    would repeat once per case)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    init("gloo")
    return dist.get_rank(), dist.get_world_size()


def finish(problems: list, record_path=None, record=None) -> None:
    """Gathers every rank's ``problems``; rank 0 writes ``record`` (a dict, after the date, the torch
    and transformers versions, the world, the backend and the device) to ``record_path`` if given,
    and prints ``OK`` or the problems. Then leaves the process without the interpreter's teardown,
    where torch 2.13 (CPU) once aborted a rank that had finished ("terminate called without an
    active exception": a native thread, likely the profiler's, still joinable at exit), about one
    run in ten: all is done and reported by then."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = [None] * world
    dist.all_gather_object(everyone, problems)
    if rank == 0:
        if record_path:
            import transformers
            with open(record_path, "w") as f:
                json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               torch=torch.__version__, transformers=transformers.__version__, world=world,
                               backend="gloo", device="cpu", **(record or {})), f, indent=1)
        lines = [line for rank_problems in everyone for line in rank_problems]
        print("\n".join(lines) if lines else "OK")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
