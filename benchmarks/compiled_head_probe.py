"""Where a compiled plan's peak leaves its prediction: each treatment x head, compiled and eager.

The model is the bench's layer shapes (Llama-3.2-1B, 4 layers, bf16), batch 2 x 2048 tokens,
profiled once compiled (``remat.profile(model, ids, compile=True)``) and once eager. For uniform
``keep``, ``full``, ``attn-saved`` and the mix ``mix``, ``3x attn-saved, 1x keep`` (the plan that peaked 32%
over its compiled prediction on 2026-12-03), each with the plain head and the chunked head at 2048
tokens, the plan is applied and run compiled (``model.compile()``, dynamo reset before) and eager;
the peak is ``torch.cuda.max_memory_allocated()`` over two steps after three warm-up steps, beside
``simulate`` on the profile of the same mode (its timeline too). Where a peak is over its prediction
by more than 5%, or the head is chunked, a third step is recorded with the allocator's history: the
largest tensors alive at the peak and the allocation that set it, with the Python frames that
allocated them. The first records hold each profile's head costs and static bytes.

    PYTHONPATH=src python3 benchmarks/compiled_head_probe.py --out "$OUT"

Writes ``compiled_head_probe.jsonl`` (one record per row, written as it is measured) into ``--out``.
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import traceback

import torch

import remat
from remat.planning.plans import Plan
from remat.planning.simulator import simulate
from compiled_plan_validate import bench_like  # the same model, built the same way

HEADS = {"plain": None, "chunked": 2048}
SPECS = ("mix", "keep", "attn-saved", "full")
"""``mix``: 3x attn-saved, 1x keep (the last block kept)."""


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss


@contextlib.contextmanager
def warmed(model, ids, compiled: bool):
    """``model`` compiled in place (dynamo reset before) or eager, three warm-up steps run, for the
    ``with`` block; then its gradients dropped and its compile taken off."""
    import torch._dynamo
    torch._dynamo.reset()
    if compiled:
        model.compile()
    try:
        for _ in range(3):
            step(model, ids)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        yield
    finally:
        model.zero_grad(set_to_none=True)
        model._compiled_call_impl = None
        torch._dynamo.reset()


def measure(model, ids, compiled: bool):
    """Peak bytes over two steps after three warm-up steps."""
    with warmed(model, ids, compiled):
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            step(model, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def alive_at_peak(model, ids, compiled: bool, top=10):
    """The largest allocations alive at one step's peak, and the one that set it, with their frames."""
    with warmed(model, ids, compiled):
        torch.cuda.memory._record_memory_history(max_entries=500000)
        step(model, ids)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, best, best_live, setter = {}, 0, -1, {}, None
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live, setter = total, dict(live), event
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    biggest = sorted(best_live.values(), key=lambda e: -e["size"])[:top]

    def frames(event):
        """The Python frames that allocated it, innermost first: remat's, transformers', inductor's
        generated code and autograd's (the C++ frames and torch's plumbing left out)."""
        wanted = ("remat/", "transformers/", "torchinductor", "_inductor/", "autograd/", "_functorch/")
        kept = [f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']}:{f['name']}" for f in event.get("frames", [])
                if f["filename"].endswith(".py") and any(w in f["filename"] for w in wanted)]
        return kept[:10]
    return dict(traced_peak_growth_bytes=best, set_by=dict(bytes=setter["size"], frames=frames(setter)),
                largest=[dict(bytes=e["size"], frames=frames(e)) for e in biggest])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--eager", action="store_true", help="also run the rows eager, beside the eager profile")
    parser.add_argument("--specs", default=",".join(SPECS), help=f"which plans, in this order (of {', '.join(SPECS)})")
    parser.add_argument("--heads", default="plain,chunked", help="which heads: plain, chunked (2048 tokens)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    common = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__, remat=remat.__version__,
                  model="llama-1b (4 layers)", batch=2, seq=2048, dtype="bfloat16")
    model = bench_like()
    ids = torch.randint(0, model.config.vocab_size, (2, 2048), device="cuda")
    profiles = {"compiled": remat.profile(model, ids, compile=True)}
    print(f"compiled profile: {profiles['compiled'].notes.get('profile_seconds')} s", flush=True)
    if args.eager:
        profiles["eager"] = remat.profile(model, ids)
    names = profiles["compiled"].block_names
    specs = {"keep": ["keep"] * len(names), "full": ["full"] * len(names),
             "attn-saved": ["attn-saved"] * len(names),
             "mix": ["attn-saved"] * (len(names) - 1) + ["keep"]}
    # the plan that peaked over its prediction first, then the rows that tell where: a run cut short by
    # a time limit keeps what it wrote
    order = [(spec, (head, HEADS[head])) for spec in args.specs.split(",") for head in args.heads.split(",")]
    with open(os.path.join(args.out, "compiled_head_probe.jsonl"), "w") as out:
        for mode, prof in profiles.items():
            out.write(json.dumps(dict(common, mode=mode, calibration=prof.notes.get("calibration"),
                                      static_bytes=prof.static_bytes,
                                      heads=[dataclasses.asdict(h) for h in prof.heads])) + "\n")
        for mode, prof in profiles.items():
            for spec, (head, chunk) in order:
                treatments = specs[spec]
                plan = Plan(blocks=dict(zip(names, treatments)), head=head, chunk_tokens=chunk)
                record = dict(common, mode=mode, spec=spec, plan=plan.summary(), head=head, chunk_tokens=chunk)
                try:
                    sim = simulate(prof, plan)
                    record.update(predicted_peak_bytes=int(sim.peak_bytes), predicted_bound_bytes=int(sim.bound_bytes),
                                  predicted_peak_at=sim.peak_at,
                                  timeline=[phase._asdict() for phase in sim.timeline])
                    remat.apply(model, plan)
                    try:
                        record["peak_bytes"] = measure(model, ids, compiled=mode == "compiled")
                        record["peak_error"] = record["peak_bytes"] / record["predicted_peak_bytes"] - 1
                        if record["peak_error"] > 0.05 or head == "chunked":
                            record["at_peak"] = alive_at_peak(model, ids, compiled=mode == "compiled")
                    finally:
                        remat.remove(model)
                except Exception as error:  # noqa: BLE001 -- one failing row is recorded, the rest go on
                    record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()[:2000]
                print(json.dumps(record), flush=True)
                out.write(json.dumps(record) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
