"""Train on sequences longer than one GPU holds: context parallelism with FSDP2, planned per rank.

    torchrun --nproc-per-node 4 examples/train_long.py --model llama-8b --seq 1048576 --cp 4 --budget 76GiB
    torchrun --nproc-per-node 4 examples/train_long.py --model llama-8b --seq 524288 --cp 2 --budget 76GiB
    torchrun --standalone --nproc-per-node 2 examples/train_long.py --device cpu --model llama-tiny --cp 2 --steps 2

How, on every rank:

1. The ranks form a ``dp x cp`` mesh (``world / --cp`` data-parallel groups of ``--cp`` ranks): the
   ranks of one CP group train on the same ``--batch`` sequences of ``--seq`` tokens, each holding
   ``--seq / --cp`` tokens of them (:func:`remat.parallel.shard_sequence`: a head and a tail chunk,
   torch's load-balanced layout, or with ``--contiguous`` one contiguous piece; labels shifted before
   the cut, so a rank's loss is its share of its sequences' loss). The model is sharded by FSDP2 over
   every rank (torchtitan's layout: CP ranks hold different parameter shards too).
2. The model is built on the ``meta`` device, and what CP cannot run is refused on every rank
   before anything else (a model whose attention is not SDPA, a ``--seq`` not divisible by
   ``2 x --cp``, or ``--cp`` with ``--contiguous``: :func:`remat.parallel.check_model`,
   :func:`remat.parallel.check_batch`).
3. Rank 0 plans: ``remat.plan(model, batch, budget, cp_world=cp, fsdp_world=world,
   optimizer="adamw")`` profiles one rank's share with fake tensors and charges the attention over
   the rest of the sequence, its exchange and buffers (:mod:`remat.planning.context`), and the
   optimizer's step; the plan is broadcast as plain data. When nothing fits, rank 0 prints the
   one-line reason (the smallest budget that fits) and every rank leaves cleanly, with exit code
   0: torchrun answers any other code with a traceback of its own.
4. ``remat.apply(model, plan)``, ``fully_shard`` on every block and the root, then real weights on
   the device (each rank its shards; ``--same-init``: the whole model initialised alike on every
   rank before sharding, so that runs on any number of ranks start from the same weights), AdamW.
5. ``--steps`` steps on random tokens (the same on the ranks of a CP group), forward and backward
   inside :func:`remat.parallel.context_parallel` (torch's ring attention on NCCL; on gloo an
   all-gather of keys and values, the same mathematics, so that a CPU checks it). FSDP2 averages
   gradients over all ranks, and a CP group's ranks each hold a share of their sequences' loss, so
   the backward runs on ``cp x`` the share. Rank 0 prints each step's loss (the mean over the
   data-parallel groups of their sequences' loss), tokens/s per GPU, and, on CUDA, every rank's
   peak beside the plan's and the step beside the plan's (forward, backward and the optimizer).

Python's garbage collector is kept out of the steps as in ``examples/train_fsdp.py``.
``--plan`` skips planning (a spec such as ``full``, or a plan file from ``remat plan --cp N --fsdp
M``). On the CPU (``--device cpu``, gloo) the same code runs end to end on a tiny model; there is
no peak memory to report there.
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
from remat.parallel import check_batch, check_model, context_parallel, shard_sequence


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, budget="76GiB")
    p.add_argument("--cp", type=int, default=2, help="ranks that split each sequence (context parallelism)")
    add_run_arguments(p, batch_help="sequences per CP group and step", seq_default=None,
                      seq_help="tokens per sequence, the whole sequence (default: 1048576 on CUDA, 64 on the CPU)",
                      steps=5)
    p.add_argument("--attention", default="auto", choices=("auto", "ring", "gather"),
                   help="CP attention: torch's ring (NCCL), an all-gather of K/V (any backend), or auto")
    p.add_argument("--contiguous", action="store_true",
                   help="cut each sequence into one contiguous piece a rank instead of a head and a tail chunk")
    p.add_argument("--same-init", action="store_true",
                   help="initialise the whole model alike on every rank before sharding (needs its unsharded "
                        "size on each device), for comparing runs on different numbers of ranks")
    add_output_arguments(p)
    args = p.parse_args(argv)
    check_gc_every(p, args)
    args.seq = args.seq or (1048576 if args.device == "cuda" else 64)
    me = start(args)
    try:
        failure = _train(args, me)
        # every rank done with its collectives before any leaves: gloo aborted a rank that destroyed its group
        # while the other still had a send in flight ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failure and me.rank == 0:
        print(f"train_long.py: {failure}", file=sys.stderr, flush=True)
    return 0  # also when nothing ran: torchrun turns any other exit code into a traceback of its own


def _train(args, me):
    """The run; returns a one-line reason when nothing can run (every rank returns it), else None."""
    rank, world, cuda, device = me.rank, me.world, me.cuda, me.device
    if args.cp < 1 or world % args.cp:
        return f"--cp {args.cp} must divide the {world} ranks (a CP group is --cp ranks of one data-parallel group)"
    cp, dp = args.cp, world // args.cp
    balance = not args.contiguous
    config = load_config(args.model)
    model = build_model(config, device="meta", dtype=me.dtype)
    example = torch.zeros(args.batch, args.seq, dtype=torch.long)
    try:  # what CP cannot run, refused on every rank before anything is planned or allocated
        check_model(model)
        check_batch({"input_ids": example}, cp, balance=balance)
    except ValueError as e:
        return f"error: {e}"
    from remat.planning.solver import NoPlanFits
    plan, failure = broadcast_plan(rank, lambda: _plan(model, example, args, world, cuda),
                                   refuse=(NoPlanFits, ValueError))
    if failure:
        return failure
    me.say(f"plan for one of {world} ranks ({dp} data-parallel x {cp} context-parallel, "
           f"{args.seq // cp:,} of {args.seq:,} tokens a rank): {plan.summary()}")
    if args.plan_out and rank == 0:
        plan.save(args.plan_out)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    groups = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    shards = init_device_mesh(device.type, (world,))   # FSDP2 over every rank, CP ranks included
    cp_group, dp_rank = groups["cp"], groups.get_local_rank("dp")
    remat.apply(model, plan)
    if args.same_init:
        materialise(model, device, seed=0)
    for _, block in remat.discover(model).blocks(model):
        fully_shard(block, mesh=shards)
    fully_shard(model, mesh=shards)
    if not args.same_init:
        materialise(model, device, seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    generator = torch.Generator().manual_seed(1000 + dp_rank)   # one batch per CP group
    tokens = args.batch * args.seq // cp                         # this rank's tokens a step
    collector = StepCollector(args.gc_every)
    times = []
    collector.start()
    for step in range(args.steps):
        collector.step(step)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
        local = shard_sequence({"input_ids": ids, "labels": ids}, cp_group, balance=balance)
        sync(cuda)
        start_s = time.perf_counter()
        with context_parallel(model, cp_group, attention=args.attention, balance=balance):
            loss = model(**local).loss
            (loss * cp).backward()    # FSDP2 divides by dp x cp; the CP shares must add up
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(cuda)
        times.append(time.perf_counter() - start_s)
        loss = loss.detach().float()
        dist.all_reduce(loss)          # the CP shares summed, and the data-parallel groups' losses
        me.say(f"step {step}: loss {loss.item() / dp:.6f}  {times[-1]:.3f} s  "
               f"{tokens / times[-1]:,.0f} tokens/s per GPU")
    collector.stop()
    report(me, plan, times, tokens, unit="GPU")
    return None


def _plan(model, example, args, world, cuda):
    """Rank 0's plan: ``--plan`` as given, else one rank of the ``cp x fsdp`` mesh planned with fake
    tensors at ``--gpu``'s rates (this GPU's)."""
    if args.plan:
        return spec_or_file(args.plan, model)
    gpu = args.gpu or (gpu_name() if cuda else "cpu")
    return remat.plan(model, example, args.budget, cp_world=args.cp, fsdp_world=world, optimizer="adamw", gpu=gpu,
                      cp_balance=not args.contiguous)


if __name__ == "__main__":
    sys.exit(main())
