"""The budget is a card (issue 38): remat.plan made and trained inside a card-sized cap, on one GPU.

Per (budget, sequence length) row, in one process: the card is emulated with
``torch.cuda.set_per_process_memory_fraction(card / total)`` (the allocator frees its cache and
retries before it raises, as a card of that size does), ``remat.plan`` runs inside it (planning's
own peak and its warnings recorded, beside an uncapped planning run with ``--uncapped-too``), the
plan is applied (expandable segments switched on by ``remat.apply``), AdamW's state allocated before
the first step (``_optimizer.allocate_state``: every measured step holds it), and ``--steps`` steps
run: allocated and reserved peaks, the prediction and the reserve the plan expects, tokens/s of
the last step. "oom" where the card ran out of memory.

    PYTHONPATH=src python benchmarks/card_check.py --model llama-1b --batch 4 --seqs 4096 \
        --budgets 14GiB --card-extra 1.5GiB [--compile] --out DIR
    PYTHONPATH=src python benchmarks/card_check.py --model llama-8b-lora --seqs 65536,131072 \
        --budgets 76GiB --card 79.2GiB --out DIR

Writes ``DIR/card_check.jsonl``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import remat  # noqa: E402
from _optimizer import allocate_state  # noqa: E402
from longctx import build  # noqa: E402
from remat.units import format_size, parse_size  # noqa: E402

GiB = 2 ** 30


def cap(card: int) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card / total) if card else 1.0)


def free_all():
    gc.collect()
    cap(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def planned(args, model, batch, budget: int, card: int, rec: dict):
    cap(card)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = remat.plan(model, batch, budget, optimizer=args.optimizer, compile=args.compile)
    rec.update(plan_s=round(time.perf_counter() - start, 1),
               planning_peak_gib=round(torch.cuda.max_memory_allocated() / GiB, 3),
               planning_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 3),
               planning_warnings=[str(w.message)[:200] for w in caught if "remat" in str(w.message)])
    return plan


def row(args, seq: int, budget: int, card: int) -> dict:
    rec = dict(model=args.model, batch=args.batch, seq=seq, budget_gib=round(budget / GiB, 3),
               card_gib=round(card / GiB, 3), compile=args.compile, optimizer=args.optimizer,
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    model = opt = None
    try:
        model, _ = build(args.model)
        ids = torch.randint(0, 128000, (args.batch, seq), device="cuda")
        batch = {"input_ids": ids, "labels": ids}
        if args.uncapped_too:
            uncapped = {}
            planned(args, model, batch, budget, 0, uncapped)
            rec["uncapped_plan_s"] = uncapped["plan_s"]
            rec["uncapped_planning_peak_gib"] = uncapped["planning_peak_gib"]
        plan = planned(args, model, batch, budget, card, rec)
        n = plan.notes
        rec.update(plan=plan.summary(), predicted_peak_gib=round(n["predicted_peak_bytes"] / GiB, 3),
                   predicted_step_s=n["predicted_step_s"], peak_at=n.get("peak_at"),
                   plan_card_gib=round(n.get("card_bytes", 0) / GiB, 3),
                   allocator=n.get("allocator"), verified=str(n.get("verified"))[:300])
        remat.apply(model, plan)
        if args.compile:
            model.compile()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                **({"fused": True} if args.optimizer == "adamw-fused" else {}))
        allocate_state(opt)
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated()
        rec.update(peak_gib=round(peak / GiB, 3), reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 3),
                   peak_error=round(peak / n["predicted_peak_bytes"] - 1, 4), step_s=round(times[-1], 3),
                   step_error=round(times[-1] / n["predicted_step_s"] - 1, 4),
                   tok_s=round(args.batch * seq / times[-1]), under_budget=peak <= budget)
    except torch.OutOfMemoryError as e:
        rec.update(error="oom", detail=str(e)[:300], peak_gib=round(torch.cuda.max_memory_allocated() / GiB, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 3))
    except Exception as e:  # one row's failure is recorded; the others run
        rec.update(error=f"{type(e).__name__}: {str(e)[:400]}")
    del model, opt
    if args.compile:
        torch._dynamo.reset()
    free_all()
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama-8b-lora", "llama-1b"), default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqs", default="4096")
    p.add_argument("--budgets", default="14GiB")
    p.add_argument("--card", default=None, help="the card's size (default: each budget plus --card-extra)")
    p.add_argument("--card-extra", default="1GiB")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw-fused"))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--uncapped-too", action="store_true", help="also time planning without the cap")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    for seq in [int(s) for s in args.seqs.split(",")]:
        for budget in [parse_size(b) for b in args.budgets.split(",")]:
            card = parse_size(args.card) if args.card else budget + parse_size(args.card_extra)
            rec = row(args, seq, budget, card)
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "card_check.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{args.model} {args.batch}x{seq} budget {format_size(budget)} card {format_size(card)}: "
                  + (rec.get("error") or f"peak {rec['peak_gib']} (pred {rec['predicted_peak_gib']}, "
                     f"{rec['peak_error']:+.2%}) reserved {rec['reserved_gib']} (plan made for a card of "
                     f"{rec['plan_card_gib']}) {rec['tok_s']} tok/s, planned in {rec['plan_s']} s "
                     f"at {rec['planning_peak_gib']} GiB"), flush=True)


if __name__ == "__main__":
    main()
