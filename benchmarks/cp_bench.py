"""Context parallelism with FSDP2 on GPUs (issue 32): rows of (length, strategy), the longest length
each strategy trains, and a gradient check against one GPU.

Model: the Llama-3.1-8B shape (``--model llama-8b``), full fine-tune, AdamW, bf16, one sequence of
``--seq`` tokens per CP group; the ranks form a ``dp x cp`` mesh, FSDP2 over every rank
(torchtitan's layout), forward and backward inside :func:`remat.parallel.context_parallel`
(torch's ring attention), the sequence cut head-tail (balanced; ``--contiguous``: contiguous pieces,
planned for with ``cp_balance=False``). Strategies:

- ``remat``: ``remat.plan(model, batch, --budget, cp_world=cp, fsdp_world=world, optimizer="adamw")``
  planned on rank 0 with fake tensors at this GPU's rates, broadcast, applied before ``fully_shard``;
- ``hf_full``: Hugging Face gradient checkpointing of every block (non-reentrant), its own head;
- ``torch_ac``: torch's ``apply_activation_checkpointing`` (non-reentrant ``checkpoint_wrapper``) on
  every block;
- ``eager``: nothing.

The anchors carry what the planner predicts for them (their uniform plan on the same profile:
``full`` or ``keep`` with the plain head), so every row has a predicted peak and step beside the
measured ones. A row measures ``--warmup`` steps, resets the allocator's peak, then ``--steps``
timed steps (forward, backward, optimizer): every rank's peak, the median step and its spread,
tokens/s per GPU, the loss.

Modes (one JSON line per row in ``OUT/cp_bench.jsonl``, the environment first):

    # the issue's rows on 4 x H100: 1M tokens CP 4 and 2 x 2, each strategy
    python benchmarks/cp_bench.py --sweep --nproc 4 --seqs 1048576 --cps 4,2 --out OUT
    # 2 x H100: 262,144 and 524,288 tokens
    python benchmarks/cp_bench.py --sweep --nproc 2 --seqs 262144,524288 --cps 2 --out OUT
    # the longest length each strategy trains (doubling from the first --seqs until it fails)
    python benchmarks/cp_bench.py --sweep --longest --nproc 4 --seqs 131072 --cps 4 --out OUT
    # gradients of a short run (4k tokens, 2 GPUs, CP 2) against one GPU's
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --grad-check --seq 4096 --out OUT

``--sweep`` (no torchrun) starts one ``torchrun`` per row, so that a row that runs out of memory (one
rank raises while the others wait in a collective) cannot hang the next: a rank that runs out writes
a marker and leaves, the process group's timeout (``--pg-timeout-s``) ends the others, and the row
is recorded ``oom`` (or ``timeout`` past ``--row-timeout-s``). A row alone: ``torchrun
--nproc-per-node N benchmarks/cp_bench.py --row --seq S --cp C --strategy remat --out OUT``.

``--grad-check``: every rank builds the model alike (seed 0, on its GPU); rank 0 runs one step over
the whole sequence alone (no CP: the reference), then every rank runs CP steps untouched (``keep``,
ring attention and the all-gather path) and under each remat treatment and the chunked head, the
gradients summed over the CP ranks in fp32 (the untouched ring run also with contiguous pieces:
torch's ring without its load balancing). Passes when every treatment's largest gradient error
(per parameter, ``|g - ref| / |ref|`` in norm) is within ``--grad-slack`` x the untouched ring run's
own (both bf16 against the same one-GPU reference).

Meant for GPUs (NCCL). ``--device cpu`` runs a row or the gradient check on gloo with a tiny model
(the all-gather path), to check the script itself; it reports no peaks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import remat
from _optimizer import allocate_state
from remat.presets import build_model, load_config, materialise
from remat.parallel import context_parallel, shard_sequence
from remat.prove.bench import environment

GiB = 2 ** 30
STRATEGIES = ("remat", "hf_full", "torch_ac", "eager")
ANCHOR_PLANS = {"hf_full": "full", "torch_ac": "full", "eager": "keep"}
GRAD_CASES = (("full", None), ("selective", None), ("attention", None), ("mlp", None), ("offload", None),
              ("full+offload", None), ("tiled", None), ("full+tiled", None), ("full+offload+tiled", "chunked"),
              ("keep", "chunked"), ("full", "chunked"), ("attn-saved", None), ("attn-saved+offload+tiled", "chunked"))


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="start one torchrun per row (run without torchrun)")
    mode.add_argument("--row", action="store_true", help="one row (under torchrun; the default under torchrun)")
    mode.add_argument("--grad-check", action="store_true", help="gradients against one GPU (under torchrun)")
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--seq", type=int, default=4096, help="a row's whole sequence")
    p.add_argument("--cp", type=int, default=2, help="a row's CP degree")
    p.add_argument("--strategy", default="remat", choices=STRATEGIES)
    p.add_argument("--seqs", default="262144,524288", help="--sweep: lengths")
    p.add_argument("--cps", default="2", help="--sweep: CP degrees (each divides --nproc)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="--sweep: strategies")
    p.add_argument("--longest", action="store_true", help="--sweep: double each strategy's length until it fails")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="--longest: stop here")
    p.add_argument("--nproc", type=int, default=2, help="--sweep: GPUs (torchrun --nproc-per-node)")
    p.add_argument("--budget", default="76GiB")
    p.add_argument("--gpu", help="rates to plan with (default: this GPU's)")
    p.add_argument("--attention", default="auto", choices=("auto", "ring", "gather"))
    p.add_argument("--contiguous", action="store_true",
                   help="cut each sequence into contiguous pieces instead of head-tail chunks (balance=False)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--grad-slack", type=float, default=1.5)
    p.add_argument("--row-timeout-s", type=int, default=3600)
    p.add_argument("--pg-timeout-s", type=int, default=900)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


# ---------------------------------------------------------------- the driver

def sweep(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    sink = os.path.join(args.out, "cp_bench.jsonl")
    strategies = args.strategies.split(",")
    rows = []
    for cp in (int(c) for c in args.cps.split(",")):
        for strategy in strategies:
            seqs = [int(s) for s in args.seqs.split(",")]
            while seqs:
                seq = seqs.pop(0)
                record = run_row(args, seq, cp, strategy, sink)
                rows.append(record)
                print(line(record), flush=True)
                if args.longest and record.get("result", "ok") == "ok" and seq * 2 <= args.max_seq:
                    seqs = [seq * 2]
    if args.longest:
        longest = {}
        for r in rows:
            if r.get("result", "ok") == "ok":
                key = (r["strategy"], r["cp"])
                longest[key] = max(longest.get(key, 0), r["seq"])
        with open(sink, "a") as f:
            f.write(json.dumps({"longest": {f"{s}/cp{c}": n for (s, c), n in sorted(longest.items())}}) + "\n")
        for (s, c), n in sorted(longest.items()):
            print(f"longest  {s:<9} CP {c}: {n:,} tokens", flush=True)
    return 0


def run_row(args, seq, cp, strategy, sink) -> dict:
    marker = os.path.join(args.out, f".oom-{strategy}-{seq}-{cp}")
    for rank in range(args.nproc):
        if os.path.exists(f"{marker}.{rank}"):
            os.remove(f"{marker}.{rank}")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(args.nproc), os.path.abspath(__file__), "--row",
               "--model", args.model, "--seq", str(seq), "--cp", str(cp), "--strategy", strategy,
               "--budget", args.budget, "--attention", args.attention, "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--device", args.device, "--pg-timeout-s", str(args.pg_timeout_s),
               "--out", args.out] + (["--gpu", args.gpu] if args.gpu else []) + (
                   ["--contiguous"] if args.contiguous else [])
    base = dict(model=args.model, seq=seq, cp=cp, world=args.nproc, strategy=strategy, balance=not args.contiguous)
    before = _lines(sink)
    try:
        done = subprocess.run(command, timeout=args.row_timeout_s, text=True, capture_output=True)
        code, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        code, tail = None, "timeout"
    after = _lines(sink)
    if len(after) > len(before):
        return json.loads(after[-1])
    ooms = [r for r in range(args.nproc) if os.path.exists(f"{marker}.{r}")]
    result = "oom" if ooms else ("timeout" if code is None else f"exit {code}")
    record = dict(base, result=result, oom_ranks=ooms, tail=tail[-1500:])
    for rank in ooms:  # what the rank knew when it ran out: its plan, the prediction, the failing step
        with open(f"{marker}.{rank}") as f:
            text = f.read()
        if text:
            record.setdefault("oom", {})[rank] = json.loads(text)
    with open(sink, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def _lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [x for x in f.read().splitlines() if x.strip()]


def line(r) -> str:
    if r.get("result", "ok") != "ok":
        return f"{r['strategy']:<9} {r['seq']:>9,} CP {r['cp']}: {r['result']}"
    peak = f"{max(r['peak_bytes']) / GiB:.2f} GiB" if r.get("peak_bytes") else "not measured (CPU)"
    pred = r.get("predicted_peak_bytes")
    return (f"{r['strategy']:<9} {r['seq']:>9,} CP {r['cp']}: peak {peak}"
            + (f" (predicted {pred / GiB:.2f}" + (f", {r['peak_error']:+.1%})" if "peak_error" in r else ")")
               if pred else "")
            + f", step {r['step_s']:.3f} s" + (f" (predicted {r['predicted_step_s']:.3f}, {r['step_error']:+.1%})"
                                                if r.get("predicted_step_s") else "")
            + f", {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, loss {r['loss']:.4f}"
            + (f"  [{r['plan']}]" if r.get("plan") else ""))


# ---------------------------------------------------------------- one row, under torchrun

def setup(args):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = load_config(args.model if cuda or args.model != "llama-8b" else "llama-tiny")
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq)
    return cuda, device, dtype, config


def row(args) -> int:
    cuda, device, dtype, config = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    cp, dp = args.cp, world // args.cp
    model = build_model(config, device="meta", dtype=dtype)
    example = torch.zeros(1, args.seq, dtype=torch.long)
    record = dict(model=args.model, seq=args.seq, cp=cp, world=world, dp=dp, strategy=args.strategy,
                  budget=args.budget, balance=not args.contiguous, **environment(device))
    box = [None]
    if rank == 0:
        box[0] = predicted(model, example, args, world, cuda)
    dist.broadcast_object_list(box, src=0)
    plan_data, notes = box[0]
    record.update(notes)
    if rank == 0:
        print(json.dumps(notes), flush=True)
    if notes.get("result"):
        _write(args, record, rank)
        dist.destroy_process_group()
        return 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    groups = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    shards = init_device_mesh(device.type, (world,))
    block_class = type(next(iter(remat.discover(model).blocks(model)))[1])
    if args.strategy == "remat":
        remat.apply(model, remat.Plan.from_dict(plan_data, source="rank 0's plan"))
    elif args.strategy == "hf_full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.strategy == "torch_ac":
        from functools import partial

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                       check_fn=lambda m: isinstance(m, block_class))
    for module in model.modules():
        if isinstance(module, block_class):
            fully_shard(module, mesh=shards)
    fully_shard(model, mesh=shards)
    materialise(model, device, seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    allocate_state(optimizer)  # so that a first step's peak holds it, as every later one does
    generator = torch.Generator().manual_seed(1000 + groups.get_local_rank("dp"))
    marker = os.path.join(args.out, f".oom-{args.strategy}-{args.seq}-{cp}.{rank}")
    times, loss = [], None
    try:
        for step in range(args.warmup + args.steps):
            if step == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=generator).to(device)
            local = shard_sequence({"input_ids": ids, "labels": ids}, groups["cp"], balance=not args.contiguous)
            _sync(cuda)
            start = time.perf_counter()
            with context_parallel(model, groups["cp"], attention=args.attention, balance=not args.contiguous):
                loss = model(**local).loss
                (loss * cp).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(cuda)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as error:
        said = f"step {step + 1} of {args.warmup + args.steps}: {str(error).splitlines()[0][:400]}"
        print(f"rank {rank} {said}", flush=True)
        with open(marker, "w") as f:   # the driver reads it; the other ranks end at the process group's timeout
            f.write(json.dumps(dict(record, error=said, peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)))
        os._exit(3)
    loss = loss.detach().float()
    dist.all_reduce(loss)
    peaks = [None] * world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated() if cuda else 0)
    step_s = statistics.median(times)
    record.update(result="ok", loss=loss.item() / dp, step_s=round(step_s, 4),
                  step_spread_s=round(max(times) - min(times), 4), steps=len(times),
                  tokens_per_s_per_gpu=round(args.seq // cp / step_s, 1), peak_bytes=peaks if cuda else None)
    if cuda and record.get("predicted_peak_bytes"):
        record["peak_error"] = round(max(peaks) / record["predicted_peak_bytes"] - 1, 4)
    if record.get("predicted_step_s"):
        record["step_error"] = round(step_s / record["predicted_step_s"] - 1, 4)
    _write(args, record, rank)
    if rank == 0:
        print(line(record), flush=True)
    dist.destroy_process_group()
    return 0


def predicted(model, example, args, world, cuda):
    """Rank 0: ``(plan as data, notes)`` for the row: remat's plan at the budget, or an anchor's
    uniform plan on the same profile (its prediction); ``notes["result"]`` when nothing fits."""
    from remat.planning.solver import NoPlanFits
    gpu = args.gpu or (_gpu_name() if cuda else "cpu")
    # planned with fake tensors (the model is on meta), so the host is given: this one's pinned
    # memory, shared by the ranks it runs
    from remat.planner import default_host_limit, host_share
    kwargs = dict(cp_world=args.cp, fsdp_world=world, optimizer="adamw", gpu=gpu,
                  host_memory=host_share(default_host_limit()) if cuda else None, cp_balance=not args.contiguous)
    started = time.perf_counter()
    try:
        if args.strategy == "remat":
            plan = remat.plan(model, example, args.budget, **kwargs)
        else:
            plan = remat.plan(model, example, "60TiB", treatments=[ANCHOR_PLANS[args.strategy]], heads=["plain"],
                              **kwargs)
    except NoPlanFits as e:
        return None, dict(result=f"no plan fits: {e}", smallest_peak_bytes=e.smallest_peak)
    n = plan.notes
    notes = dict(plan=plan.summary(), plan_s=round(time.perf_counter() - started, 1),
                 predicted_peak_bytes=n["predicted_peak_bytes"], predicted_step_s=n["predicted_step_s"],
                 predicted_optimizer_s=n.get("predicted_optimizer_s"),
                 predicted_tokens_per_s=n["predicted_tokens_per_s"],
                 host_bytes=n.get("host_bytes"), cp_exposed_s=n.get("cp_exposed_s"),
                 cp_attention_s=n.get("cp_attention_s"), cp_exchange_bytes=n.get("cp_exchange_bytes"))
    return plan.to_dict(), notes


# ---------------------------------------------------------------- gradients against one GPU

def grad_check(args) -> int:
    cuda, device, dtype, config = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config, device=device, dtype=dtype, seed=0)   # alike on every rank
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    reference = None
    if rank == 0:   # one GPU over the whole sequence, untouched
        model(**batch).loss.backward()
        reference = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    dist.barrier()
    results = {}

    def case(name, spec, head, attention, balance=True):
        """One CP step of ``model`` under ``spec``; each gradient summed over the CP ranks in fp32,
        one parameter at a time (an 8B model's fp32 gradients would not fit beside it)."""
        remat.apply(model, spec, head=head)
        local = shard_sequence(batch, balance=balance)
        with context_parallel(model, attention=attention, balance=balance):
            model(**local).loss.backward()
        errors = {}
        for n, p in model.named_parameters():
            g = p.grad.float()
            dist.all_reduce(g)
            if rank == 0:
                want = reference[n].float()
                errors[n] = ((g - want).norm() / want.norm().clamp_min(1e-30)).item()
        if rank == 0:
            worst = max(errors, key=errors.get)
            results[name] = dict(worst=errors[worst], param=worst, median=statistics.median(errors.values()))
        model.zero_grad(set_to_none=True)
        remat.remove(model)
        if cuda:
            torch.cuda.empty_cache()

    ring = "ring" if cuda else "gather"
    case(f"keep/{ring}", "keep", None, ring)
    case(f"keep/{ring}/contiguous", "keep", None, ring, balance=False)
    if cuda:
        case("keep/gather", "keep", None, "gather")
    for spec, head in GRAD_CASES:
        case(f"{spec}" + (f"+{head}" if head else ""), spec, head, ring)
    if rank == 0:
        untouched = results[f"keep/{ring}"]["worst"]
        allowed = untouched * args.grad_slack
        record = dict(kind="grad_check", model=args.model, seq=args.seq, cp=world, slack=args.grad_slack,
                      untouched_worst=untouched, cases=results,
                      passed=all(r["worst"] <= allowed for k, r in results.items() if not k.startswith("keep/")),
                      **environment(device))
        _write(args, record, rank)
        for k, r in results.items():
            print(f"{k:<28} worst {r['worst']:.3e} ({r['param']}), median {r['median']:.3e}"
                  + ("" if k.startswith("keep/") else f"  {'PASS' if r['worst'] <= allowed else 'FAIL'}"), flush=True)
    dist.destroy_process_group()
    return 0


def _write(args, record, rank):
    if rank != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cp_bench.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _gpu_name():
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = arguments(argv)
    if args.sweep:
        return sweep(args)
    code = grad_check(args) if args.grad_check else row(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as tests/fsdp_worker.py: skip the teardown, where torch 2.13 (CPU) once aborted a finished rank


if __name__ == "__main__":
    sys.exit(main())
