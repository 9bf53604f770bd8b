"""The planner's FSDP2 prediction against one rank's measured peak and step time.

Run under torchrun, one process per GPU:

    PYTHONPATH=src torchrun --nproc_per_node 2 benchmarks/fsdp_validate.py --out $OUT

Each rank builds the same model (same seed), profiles it unsharded on its GPU, turns the
profile into one rank's view with :func:`remat.planning.sharding.shard`, predicts each plan, then
applies the plan, shards every block and the root with ``fully_shard`` and measures
``torch.cuda.max_memory_allocated`` over timed steps (bench protocol: outputs dropped
before backward, no optimizer). Rank 0 writes ``fsdp_validate.jsonl`` and prints a table.
``--device cpu`` (gloo) runs the same logic on a tiny model to check the script itself:
there is no peak to measure on the CPU, so only predictions are printed.
"""
import argparse
import gc
import json
import os
import statistics

import torch
import torch.distributed as dist

import remat
from remat.prove.bench import timed_steps
from remat.presets import build_model, load_config
from remat.profiling.profiler import profile
from remat.planning.sharding import shard
try:
    from remat.profiling.profiler import block_param_bytes
except ImportError:  # before block_param_bytes moved to the profiler
    from remat.planning.sharding import block_param_bytes
from remat.planning.simulator import simulate

GiB = 2 ** 30


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--plans", default="keep,full", help="uniform specs to check")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    config = load_config(args.model)
    dtype = torch.bfloat16 if cuda else torch.float32
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    rows = []
    for spec in args.plans.split(","):
        model = build_model(config, device=device, dtype=dtype)
        prof = profile(model, ids, device="cuda" if cuda else "fake", gpu=None if cuda else "cpu",
                       head_modes=("plain",))
        sharded = shard(prof, world, block_param_bytes(model, prof))
        predicted = simulate(sharded, spec)
        single = simulate(prof, spec)
        remat.apply(model, spec)
        for _, block in remat.discover(model).blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()
        timed_steps(step, 1, cuda=cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, loss = timed_steps(step, args.steps, cuda=cuda)
        row = dict(model=args.model, batch=args.batch, seq=args.seq, world=world, strategy=spec,
                   predicted_peak_bytes=predicted.peak_bytes, predicted_step_s=predicted.step_s,
                   single_gpu_predicted_peak_bytes=single.peak_bytes, step_s=statistics.median(times),
                   loss=float(loss), peak_at=predicted.peak_at)
        if cuda:
            row.update(peak_bytes=torch.cuda.max_memory_allocated(), gpu=torch.cuda.get_device_name())
            row["peak_error_pct"] = 100 * (row["predicted_peak_bytes"] / row["peak_bytes"] - 1)
            row["step_error_pct"] = 100 * (row["predicted_step_s"] / row["step_s"] - 1)
        rows.append(row)
        del model, step
        gc.collect()  # FSDP's hooks hold the model in reference cycles
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(args.out, "fsdp_validate.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{'strategy':10s} {'1-GPU pred':>10s} {'pred GiB':>9s} {'meas GiB':>9s} {'err%':>6s} "
              f"{'pred s':>7s} {'meas s':>7s} {'err%':>6s}")
        for r in rows:
            meas = r.get("peak_bytes")
            print(f"{r['strategy']:10s} {r['single_gpu_predicted_peak_bytes'] / GiB:10.2f} "
                  f"{r['predicted_peak_bytes'] / GiB:9.2f} "
                  + (f"{meas / GiB:9.2f} {r['peak_error_pct']:6.1f} " if meas else f"{'-':>9s} {'-':>6s} ")
                  + f"{r['predicted_step_s']:7.3f} {r['step_s']:7.3f} "
                  + (f"{r['step_error_pct']:6.1f}" if meas else "-"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
