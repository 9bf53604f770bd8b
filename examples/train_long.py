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
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import remat
from remat.integrations.collector import StepCollector
from remat.presets import build_model, load_config, materialise
from remat.parallel import check_batch, check_model, context_parallel, shard_sequence


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8b", help="preset name or a config.json path")
    p.add_argument("--budget", default="76GiB", help="memory budget of one rank (GPU)")
    p.add_argument("--plan", help="apply this spec or plan file instead of planning")
    p.add_argument("--cp", type=int, default=2, help="ranks that split each sequence (context parallelism)")
    p.add_argument("--batch", type=int, default=1, help="sequences per CP group and step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence, the whole sequence "
                                                         "(default: 1048576 on CUDA, 64 on the CPU)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--gpu", help="rates to plan with (h100, h200, a100); default: this GPU's")
    p.add_argument("--attention", default="auto", choices=("auto", "ring", "gather"),
                   help="CP attention: torch's ring (NCCL), an all-gather of K/V (any backend), or auto")
    p.add_argument("--contiguous", action="store_true",
                   help="cut each sequence into one contiguous piece a rank instead of a head and a tail chunk")
    p.add_argument("--same-init", action="store_true",
                   help="initialise the whole model alike on every rank before sharding (needs its unsharded "
                        "size on each device), for comparing runs on different numbers of ranks")
    p.add_argument("--plan-out", help="rank 0 writes the plan it used here")
    p.add_argument("--gc-every", type=int, default=50,
                   help="collect Python's garbage between steps every N steps, never during one (0: automatic)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.seq = args.seq or (1048576 if cuda else 64)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; pass --device cpu (gloo) to try it on the CPU")
    if cuda:  # before the process group, so that NCCL knows each rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        failure = _train(args, rank, world, cuda, say)
    finally:
        dist.destroy_process_group()
    if failure and rank == 0:
        print(f"train_long.py: {failure}", file=sys.stderr, flush=True)
    return 0  # also when nothing ran: torchrun turns any other exit code into a traceback of its own


def _train(args, rank, world, cuda, say):
    """The run; returns a one-line reason when nothing can run (every rank returns it), else None."""
    if args.cp < 1 or world % args.cp:
        return f"--cp {args.cp} must divide the {world} ranks (a CP group is --cp ranks of one data-parallel group)"
    cp, dp = args.cp, world // args.cp
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        warnings.filterwarnings("ignore", message="DTensor random operators")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]

    config = load_config(args.model)
    model = build_model(config, device="meta", dtype=dtype)
    example = torch.zeros(args.batch, args.seq, dtype=torch.long)
    try:  # what CP cannot run, refused on every rank before anything is planned or allocated
        check_model(model)
        check_batch({"input_ids": example}, cp, balance=not args.contiguous)
    except ValueError as e:
        return f"error: {e}"
    plan, failure = _plan_on_rank0(model, example, args, rank, world, cuda)
    if failure:
        return failure
    say(f"plan for one of {world} ranks ({dp} data-parallel x {cp} context-parallel, "
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
        local = shard_sequence({"input_ids": ids, "labels": ids}, cp_group, balance=not args.contiguous)
        _sync(cuda)
        start = time.perf_counter()
        with context_parallel(model, cp_group, attention=args.attention, balance=not args.contiguous):
            loss = model(**local).loss
            (loss * cp).backward()    # FSDP2 divides by dp x cp; the CP shares must add up
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(cuda)
        times.append(time.perf_counter() - start)
        loss = loss.detach().float()
        dist.all_reduce(loss)          # the CP shares summed, and the data-parallel groups' losses
        say(f"step {step}: loss {loss.item() / dp:.6f}  {times[-1]:.3f} s  {tokens / times[-1]:,.0f} tokens/s per GPU")
    collector.stop()
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    planned = plan.notes.get("predicted_step_s")
    say(f"median step {steady:.3f} s: {tokens / steady:,.0f} tokens/s per GPU, {tokens * world / steady:,.0f} in all "
        f"({world} GPUs)" + (f"; planned {planned:.3f} s for the whole step (forward, backward and the optimizer's "
                              f"{plan.notes.get('predicted_optimizer_s', 0.0):.3f} s)" if planned else ""))
    if cuda:
        peaks = [None] * world
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
        predicted = plan.notes.get("predicted_peak_bytes")
        say("peak per rank (GiB): " + ", ".join(f"{b / 2 ** 30:.2f}" for b in peaks)
            + (f"; planned {predicted / 2 ** 30:.2f}" if predicted else ""))
    return None


def _plan_on_rank0(model, example, args, rank, world, cuda):
    """Rank 0 plans (or reads ``--plan``) and broadcasts ``(plan as data, failure)``: every rank gets
    the same plan, or the same one-line reason that nothing fits."""
    from remat.planning.solver import NoPlanFits
    box = [None]
    if rank == 0:
        try:
            if args.plan and os.path.isfile(args.plan):
                plan = remat.Plan.load(args.plan)
            elif args.plan:
                from remat.planning.plans import resolve
                plan = resolve(args.plan, remat.discover(model).block_names)
            else:
                gpu = args.gpu or (_gpu_name() if cuda else "cpu")
                plan = remat.plan(model, example, args.budget, cp_world=args.cp, fsdp_world=world,
                                  optimizer="adamw", gpu=gpu, cp_balance=not args.contiguous)
            box[0] = (plan.to_dict(), None)
        except NoPlanFits as e:
            box[0] = (None, str(e))   # "no plan fits X: the smallest budget that fits is Y (plan) ..."
        except ValueError as e:
            box[0] = (None, f"error: {e}")
    dist.broadcast_object_list(box, src=0)
    data, failure = box[0]
    if failure:
        return None, failure
    return remat.Plan.from_dict(data, source="the plan broadcast by rank 0"), None


def _gpu_name():
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
