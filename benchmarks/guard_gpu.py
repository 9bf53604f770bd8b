"""remat.Guard on a GPU (issue 14): a real out-of-memory step recovered, and varying lengths.

Two runs of the bench model (a preset, bf16, AdamW), each written as JSON lines to
``--out/guard.jsonl``:

1. ``oom``: the allocator is capped with ``torch.cuda.set_per_process_memory_fraction`` below
   what the guard's first budget plans for, so a step really runs out of memory; the guard
   re-plans at a smaller budget and redoes the step. The loss curve over ``--steps`` steps is
   compared with an uninterrupted run of an untouched copy (same weights, same batches, same
   seed), bit for bit, under ``torch.use_deterministic_algorithms(True)``.
2. ``lengths``: the sequence length changes every step (``--min-seq`` .. ``--max-seq``); the
   guard re-plans before every new longest batch; each step's peak is recorded against the
   budget. A step's peak is read from the allocator's statistics reset before the guard is
   called, so the planning work of that step (the first plan's measurement, later re-plans)
   counts in it; a per-step table (length, peak, re-planned) is printed.

``--profile-device`` is the guard's ``profile_device`` (default ``auto``: the first plan
measured on the GPU under an allocator cap at the budget, later ones on fake tensors).

Run: ``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python benchmarks/guard_gpu.py``.
"""
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _args import bench_parser  # noqa: E402

import remat  # noqa: E402
from remat.presets import build_model, load_config  # noqa: E402
from remat.prove.bench import environment  # noqa: E402
from remat.units import parse_size  # noqa: E402

GiB = 2 ** 30


def _batches(vocab, lengths, batch, seed=7):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for seq in lengths:
        ids = torch.randint(0, vocab, (batch, seq), generator=generator).cuda()
        out.append({"input_ids": ids, "labels": ids})
    return out


def _train(model, batches, run_step):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(3)
    losses, peaks = [], []
    for batch in batches:
        torch.cuda.reset_peak_memory_stats()   # before the guard: a re-plan's own memory is this step's
        losses.append(run_step(batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(torch.cuda.max_memory_allocated())
    return losses, peaks, optimizer


def _step(model):
    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach().float().item()
    return step


def oom_run(args, config, record):
    batches = _batches(config.vocab_size, [args.seq] * args.steps, args.batch)
    reference = build_model(config, device="cuda", dtype=torch.bfloat16)
    expected, ref_peaks, optimizer = _train(reference, batches, _step(reference))
    del reference, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = parse_size(args.cap)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    messages = []
    guard = remat.Guard(model, budget=args.first_budget, heads=["plain"], optimizer="adamw",
                        profile_device=args.profile_device, say=messages.append)
    got, peaks, _ = _train(model, batches, lambda batch: guard(_step(model), batch))
    torch.cuda.set_per_process_memory_fraction(1.0)
    record(run="oom", cap_bytes=cap, first_budget=args.first_budget, final_budget_bytes=guard.budget,
           recovered=guard.recovered, replans=guard.replans, plan=guard.plan.summary(), messages=messages,
           losses=got, reference_losses=expected, equal=got == expected,
           peak_bytes_max=max(peaks), reference_peak_bytes_max=max(ref_peaks))
    del model, guard
    gc.collect()
    torch.cuda.empty_cache()


def lengths_run(args, config, record):
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(args.min_seq, args.max_seq + 1, (args.steps,), generator=generator).tolist()
    batches = _batches(config.vocab_size, lengths, 1)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    messages = []
    budget = parse_size(args.lengths_budget)
    guard = remat.Guard(model, budget=budget, optimizer="adamw", profile_device=args.profile_device,
                        say=messages.append)  # any head: the loss need not be bitwise here
    replanned = []

    def step(batch):
        before = guard.replans
        loss = guard(_step(model), batch)
        replanned.append(guard.replans > before)
        return loss
    losses, peaks, _ = _train(model, batches, step)
    print(f"{'step':>4} {'seq':>5} {'peak GiB':>9} {'budget':>7} {'re-planned':>10}", flush=True)
    for index, (seq, peak, again) in enumerate(zip(lengths, peaks, replanned)):
        print(f"{index:>4} {seq:>5} {peak / GiB:>9.2f} {'OVER' if peak > budget else 'ok':>7} "
              f"{'yes' if again else '':>10}", flush=True)
    record(run="lengths", budget_bytes=budget, profile_device=args.profile_device, lengths=lengths, peaks=peaks,
           replanned=replanned, over_budget=sum(p > budget for p in peaks), replans=guard.replans,
           messages=messages, max_peak_GiB=max(peaks) / GiB)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--cap", default="30GiB", help="allocator cap for the out-of-memory run")
    parser.add_argument("--first-budget", default="40GiB", help="the guard's first budget (above the cap)")
    parser.add_argument("--min-seq", type=int, default=1024)
    parser.add_argument("--max-seq", type=int, default=8192)
    parser.add_argument("--lengths-budget", default="24GiB")
    parser.add_argument("--run", default="both", choices=("oom", "lengths", "both"))
    parser.add_argument("--profile-device", default="auto", choices=("auto", "fake", "cuda"),
                        help="remat.Guard's profile_device")
    parser.set_defaults(steps=20, batch=2, seq=4096)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    config = load_config(args.model)
    path = os.path.join(args.out, "guard.jsonl")
    env = environment(torch.device("cuda"))

    def record(**fields):
        line = dict(env, model=args.model, batch=args.batch, seq=args.seq, **fields)
        print(json.dumps({k: v for k, v in line.items()
                          if k not in ("losses", "reference_losses", "peaks", "replanned")}),
              flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    if args.run in ("oom", "both"):
        oom_run(args, config, record)
    if args.run in ("lengths", "both"):
        lengths_run(args, config, record)


if __name__ == "__main__":
    main()
