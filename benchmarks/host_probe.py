"""How much host (CPU) time each treatment costs a step, beside the GPU time it costs.

Why: at world 4, eager plans heavy in ``selective`` measured 10-28% over their predicted step
while their GPUs were busy less than predicted; one rank's GPU at a time sat idle, waiting for
its host (``benchmarks/results/issue12``). The time model counts GPU time only. This probe
measures, on one GPU, a model of ``--layers`` blocks of a preset under each treatment: the
seconds the host takes to issue the forward and the backward (``time.perf_counter``, nothing
synchronised in between, so a GPU slower than its host does not show in it) and the seconds
the GPU takes for them (CUDA events). With ``--fsdp`` every block and the root are
``fully_shard``-ed over a process group of one rank, so FSDP2's hooks (all-gather, reshard,
reduce-scatter bookkeeping) add their host time as they do at any world size; the collectives
themselves are no-ops at world 1.

What it showed (``benchmarks/results/issue12/host_probe.md``) is why eager ``selective`` is not
planned under FSDP2 (:data:`remat.planning.sharding.EAGER_SELECTIVE_UNDER_FSDP2`).

Usage (a GPU machine): ``python benchmarks/host_probe.py --model llama-8b --layers 8 --fsdp
--out $OUT``. One JSON line per treatment and mode, medians of ``--steps`` steps; the
host share is ``host_s / gpu_s`` per phase (near 1 or above: that phase waits for its host).
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remat  # noqa: E402
from remat.presets import build_model, load_config, materialise  # noqa: E402

TREATMENTS = ("keep", "full", "selective", "selective+guard", "mlp", "attention")
"""``selective+guard``: ``selective`` with its in-place guard on every forward (before it watched
only a block's first forward of each call structure)."""


class _NeverSeen(set):
    """A treated block's ``guarded`` call structures that never holds one: the guard runs every time."""

    def __contains__(self, item):
        return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--layers", type=int, default=8, help="blocks in the probed model (the preset's shape)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--treatments", default=",".join(TREATMENTS))
    p.add_argument("--fsdp", action="store_true", help="also each treatment under fully_shard at world 1")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def probe(config, treatment, fsdp, args):
    """Median host and GPU seconds of the forward and the backward of ``args.steps`` steps."""
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    remat.apply(model, treatment.replace("+guard", ""))
    if treatment.endswith("+guard"):
        from remat.treat import patches
        for patch in patches.patches(model, tag="treatment"):
            if patch.state is not None:
                patch.state.guarded = _NeverSeen()
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    materialise(model, torch.device("cuda"), seed=0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    rows = []
    for step in range(args.steps + 2):  # two warm-up steps
        model.zero_grad(set_to_none=True)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events[0].record()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        events[1].record()
        loss.backward()
        t2 = time.perf_counter()
        events[2].record()
        torch.cuda.synchronize()
        if step >= 2:
            rows.append((t1 - t0, t2 - t1, events[0].elapsed_time(events[1]) / 1e3,
                         events[1].elapsed_time(events[2]) / 1e3))
    del model, loss
    gc.collect()  # FSDP2's hooks hold the model in reference cycles
    torch.cuda.empty_cache()
    host_f, host_b, gpu_f, gpu_b = (statistics.median(column) for column in zip(*rows))
    return dict(treatment=treatment, fsdp=fsdp, layers=config.num_hidden_layers, host_forward_s=host_f,
                host_backward_s=host_b, gpu_forward_s=gpu_f, gpu_backward_s=gpu_b,
                host_share_forward=host_f / gpu_f, host_share_backward=host_b / gpu_b)


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    config.use_cache = False
    modes = [False, True] if args.fsdp else [False]
    if args.fsdp:
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
    path = os.path.join(args.out, "host_probe.jsonl")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "a") as f:
        for fsdp in modes:
            for treatment in args.treatments.split(","):
                row = dict(probe(config, treatment, fsdp, args), model=args.model, seq=args.seq, batch=args.batch,
                           gpu=torch.cuda.get_device_name(), torch=torch.__version__)
                f.write(json.dumps(row) + "\n")
                print(f"{treatment:10s} fsdp={int(fsdp)}  forward host {row['host_forward_s'] * 1e3:6.1f} ms "
                      f"gpu {row['gpu_forward_s'] * 1e3:6.1f} ms ({row['host_share_forward']:.2f})  backward host "
                      f"{row['host_backward_s'] * 1e3:6.1f} ms gpu {row['gpu_backward_s'] * 1e3:6.1f} ms "
                      f"({row['host_share_backward']:.2f})", flush=True)


if __name__ == "__main__":
    main()
