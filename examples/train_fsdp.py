"""Train a model under FSDP2 with the plan remat makes for one rank's memory budget.

    torchrun --nproc-per-node 8 examples/train_fsdp.py --model llama-8b --budget 40GiB
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --device cpu --model llama-tiny --steps 2

How, on every rank:

1. Build the model on the ``meta`` device: no memory, no weights (``--model`` is a preset or any
   Hugging Face ``config.json``).
2. Rank 0 plans: ``remat.plan(model, batch, budget, fsdp_world=world, optimizer="adamw")``
   profiles the unsharded model with fake tensors and solves for one rank's view of FSDP2
   (parameters, gradients and optimizer state 1/world; two blocks and the root unsharded; see
   ``remat.planning.sharding``), its step time counting FSDP2's all-gathers and reduce-scatters
   (what compute does not hide). The plan is broadcast as plain data (``plan.to_dict()``), so
   every rank applies the same plan: a fake-tensor profile is deterministic, a measured one is
   not (each rank would time its own kernels), and the broadcast covers both. Planning on
   every rank instead would also profile ``world`` times.
3. ``remat.apply(model, plan)``, then ``fully_shard`` on every block and then on the root
   (remat first: its checkpoint then runs inside the FSDP2 unit, and recomputing a block
   all-gathers nothing more). ``--compile`` compiles each block between the two, as torchtitan does,
   and plans for that: rank 0 builds the unsharded model on its GPU with random weights and
   plans with ``compile="blocks"`` (each block class x treatment measured compiled, the
   embeddings and head eager; see ``remat.profiling._compiled``). Where the unsharded model
   does not fit rank 0's GPU (or on the CPU) it plans eager with fake tensors among the
   treatments that compile block by block (the measured ones but ``selective`` and ``attn-saved``,
   whose per-op policies an eager FSDP2 profile leaves out, and no offload, which splits a compiled
   graph at its hooks): an eager plan's memory is an over-estimate under compile, its step time an
   under-estimate of the gain.
4. ``to_empty`` on the device and the model's own weight init (each rank initialises only its
   shards), AdamW, and ``--steps`` steps on random tokens. Rank 0 prints the loss, tokens/s
   (per GPU and in all) and, on CUDA, every rank's peak beside the plan's prediction.

Python's garbage collector is off during the steps and runs between them every ``--gc-every``
steps (0: Python's automatic collection; :class:`remat.integrations.collector.StepCollector`),
as torchtitan and torchtnt train: a collection that
starts on one rank in the middle of a step holds every other rank at the next collective (a
DDP plan on 2 x H100 ran 5.5% slower with automatic collection, a selective-heavy FSDP2 plan ~14%;
``benchmarks/results/issue12``).

``--plan`` skips planning: a spec (``full``, ``every:2``, ...) or a plan file from
``remat plan --fsdp N --out plan.json``. On the CPU (``--device cpu``, gloo) the same code
runs end to end on a tiny model; there is no peak memory to report there.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

import remat
from _launch import (add_model_arguments, add_output_arguments, add_run_arguments, broadcast_plan, check_gc_every,
                     gpu_name, report, spec_or_file, start, sync)
from remat.integrations.collector import StepCollector
from remat.presets import build_model, load_config, materialise
from remat.planning.costs import MEASURED_TREATMENTS
from remat.planning.plans import TILED_TREATMENTS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, budget="40GiB")
    add_run_arguments(p, batch_help="sequences per rank and step", seq_default=4096, steps=10)
    p.add_argument("--compile", action="store_true", help="torch.compile each block (after remat, before FSDP2)")
    add_output_arguments(p)
    args = p.parse_args(argv)
    check_gc_every(p, args)
    collector = StepCollector(args.gc_every)

    me = start(args)
    rank, world, cuda, device = me.rank, me.world, me.cuda, me.device
    config = load_config(args.model)
    model = build_model(config, device="meta", dtype=me.dtype)
    plan, _ = broadcast_plan(rank, lambda: _plan(model, config, args, world, cuda))
    me.say(f"plan for one of {world} ranks: {plan.summary()}")
    if args.plan_out and rank == 0:
        plan.save(args.plan_out)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    remat.apply(model, plan)
    for _, block in remat.discover(model).blocks(model):
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialise(model, device, seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    tokens = args.batch * args.seq
    times = []
    collector.start()
    for step in range(args.steps):
        collector.step(step)   # between steps: every --gc-every steps, on every rank at once
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
        sync(cuda)
        start_s = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(cuda)
        times.append(time.perf_counter() - start_s)
        loss = loss.detach()
        dist.all_reduce(loss)
        me.say(f"step {step}: loss {loss.item() / world:.4f}  {times[-1]:.3f} s  "
               f"{tokens / times[-1]:,.0f} tokens/s per rank")
    collector.stop()
    report(me, plan, times, tokens, unit="rank")
    dist.destroy_process_group()


def _plan(model, config, args, world, cuda):
    """Rank 0's plan: ``--plan`` as given, else planned (compiled where it can be measured)."""
    if args.plan:
        return spec_or_file(args.plan, model)
    dtype = next(model.parameters()).dtype
    return (_compiled_plan(config, args, world, dtype) if args.compile and cuda else None) or \
        _fake_plan(model, args, world, cuda)


def _compiled_plan(config, args, world, dtype):
    """The plan for every block compiled alone (``compile="blocks"``), measured on rank 0's GPU
    with the unsharded model at random weights; None (and why, on stderr) when it does not fit."""
    model = None
    try:
        model = build_model(config, device="cuda", dtype=dtype)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
        return remat.plan(model, ids, args.budget, fsdp_world=world, optimizer="adamw", compile="blocks")
    except torch.cuda.OutOfMemoryError:
        print("remat: the unsharded model does not fit rank 0's GPU to be measured compiled; planning eager "
              "among the treatments that compile block by block instead", file=sys.stderr)
        return None
    finally:
        del model
        torch.cuda.empty_cache()


def _fake_plan(model, args, world, cuda):
    """The eager plan from a fake-tensor profile at ``--gpu``'s rates (this GPU's); with ``--compile``,
    among the treatments that compile block by block."""
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    gpu = args.gpu or (gpu_name() if cuda else "cpu")
    # no offload (it splits a compiled graph); an eager profile sharded for FSDP2 has neither selective
    # nor attn-saved (their per-op policies), no tiled (eager only)
    op_policies = ("selective", "attn-saved")
    treatments = [t for t in MEASURED_TREATMENTS if t not in op_policies and t not in TILED_TREATMENTS] \
        if args.compile else None
    return remat.plan(model, ids, args.budget, fsdp_world=world, optimizer="adamw", gpu=gpu, treatments=treatments)


if __name__ == "__main__":
    main()
