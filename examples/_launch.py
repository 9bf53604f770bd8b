"""What the torchrun examples share (``train_fsdp.py``, ``train_long.py``): their common arguments,
the process group and device each rank starts with, rank 0's plan broadcast to every rank, and
the lines that end a run (the median step beside the plan's, every rank's peak).

Imported by name (``from _launch import ...``): ``torchrun examples/train_long.py`` puts the script's
folder first on ``sys.path``, as ``benchmarks/_args.py`` is found by the benchmarks. Each script
keeps what is its own: its arguments in between the shared ones (``--cp``, ``--compile`` ...), how
rank 0 plans, and its steps.
"""
import argparse
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import remat


def add_model_arguments(p: argparse.ArgumentParser, *, budget: str) -> None:
    """``--model``, ``--budget`` (its default), ``--plan``: what is trained and within what."""
    p.add_argument("--model", default="llama-8b", help="preset name or a config.json path")
    p.add_argument("--budget", default=budget, help="memory budget of one rank (GPU)")
    p.add_argument("--plan", help="apply this spec or plan file instead of planning")


def add_run_arguments(p: argparse.ArgumentParser, *, batch_help: str, seq_default, seq_help=None,
                      steps: int) -> None:
    """``--batch``, ``--seq``, ``--steps``, ``--lr``, ``--device``, ``--dtype``, ``--gpu``."""
    p.add_argument("--batch", type=int, default=1, help=batch_help)
    p.add_argument("--seq", type=int, default=seq_default, help=seq_help)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--gpu", help="rates to plan with (h100, h200, a100); default: this GPU's")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """``--plan-out``, ``--gc-every``."""
    p.add_argument("--plan-out", help="rank 0 writes the plan it used here")
    p.add_argument("--gc-every", type=int, default=50,
                   help="collect Python's garbage between steps every N steps, never during one (0: automatic)")


def check_gc_every(p: argparse.ArgumentParser, args) -> None:
    if args.gc_every < 0:
        p.error("--gc-every must be 0 (Python's automatic collection) or a positive number of steps, "
                f"got {args.gc_every}")


@dataclass(frozen=True, kw_only=True)
class Rank:
    """This process in the group :func:`start` joined."""

    rank: int
    world: int
    cuda: bool
    """NCCL on this rank's GPU; else gloo on the CPU."""
    device: torch.device
    dtype: torch.dtype
    """``--dtype``, else bf16 on CUDA and fp32 on the CPU."""

    def say(self, *args, **kwargs) -> None:
        """``print`` on rank 0, nothing elsewhere."""
        if self.rank == 0:
            print(*args, **kwargs)


def start(args) -> Rank:
    """Joins the process group torchrun describes: NCCL with each rank on its GPU (``LOCAL_RANK``,
    set before the group so that NCCL knows it), or gloo on the CPU (``--device cpu``) with the
    node's cores shared among its ranks. SystemExit for ``--device cuda`` without CUDA."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; pass --device cpu (gloo) to try it on the CPU")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        # each rank initialises its own shards; DTensor's note that its CPU random ops are local is expected
        warnings.filterwarnings("ignore", message="DTensor random operators")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    return Rank(rank=rank, world=world, cuda=cuda, device=device, dtype=dtype)


def broadcast_plan(rank: int, make: Callable[[], "remat.Plan"], *, refuse=()) -> tuple:
    """Rank 0 makes the plan, every rank gets it as plain data: ``(plan, None)``, or ``(None, reason)``
    on every rank when rank 0's ``make`` raised one of ``refuse`` (``NoPlanFits`` as its message,
    another ValueError as ``"error: ..."``). Other errors raise on rank 0."""
    from remat.planning.solver import NoPlanFits
    box = [None]
    if rank == 0:
        try:
            box[0] = (make().to_dict(), None)
        except NoPlanFits as e:
            if NoPlanFits not in refuse:
                raise
            box[0] = (None, str(e))   # "no plan fits X: the smallest budget that fits is Y (plan) ..."
        except ValueError as e:
            if ValueError not in refuse:
                raise
            box[0] = (None, f"error: {e}")
    dist.broadcast_object_list(box, src=0)
    data, failure = box[0]
    if failure:
        return None, failure
    return remat.Plan.from_dict(data, source="the plan broadcast by rank 0"), None


def spec_or_file(spec: str, model) -> "remat.Plan":
    """``--plan``: a plan file, or a spec (``full``, ``every:2`` ...) resolved for ``model``'s blocks."""
    if os.path.isfile(spec):
        return remat.Plan.load(spec)
    from remat.planning.plans import resolve
    return resolve(spec, remat.discover(model).block_names)


def gpu_name() -> str:
    """This GPU as a rate table knows it (h200, h100, a100; h100 for any other)."""
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def report(me: Rank, plan, times: list, tokens: int, *, unit: str) -> None:
    """Rank 0's last lines: the median step without the first (tokens/s per ``unit`` and in all),
    beside the plan's whole step; on CUDA every rank's peak beside the plan's."""
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median without the first step
    planned = plan.notes.get("predicted_step_s")
    me.say(f"median step {steady:.3f} s: {tokens / steady:,.0f} tokens/s per {unit}, "
           f"{tokens * me.world / steady:,.0f} in all ({me.world} {unit}s)"
           + (f"; planned {planned:.3f} s for the whole step (forward, backward and the optimizer's "
              f"{plan.notes.get('predicted_optimizer_s', 0.0):.3f} s)" if planned else ""))
    if me.cuda:
        peaks = [None] * me.world
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
        predicted = plan.notes.get("predicted_peak_bytes")
        me.say("peak per rank (GiB): " + ", ".join(f"{b / 2 ** 30:.2f}" for b in peaks)
               + (f"; planned {predicted / 2 ** 30:.2f}" if predicted else ""))
