"""Compiled plans on a GPU: predicted vs measured peak and step time, from the least compiled peak to keep's.

The model is the bench's layer shapes (Llama-3.2-1B, 4 layers, bf16), batch 2 x 2048 tokens,
profiled once with ``remat.profile(model, ids, compile=True)``. For budgets at 0.0, 0.5 and 1.0 of
the way from the least compiled peak to the keep plan's (times 1.01), the solver's plan is applied,
the model compiled in place (``model.compile()``, dynamo reset before), three steps warm it up and
seven are timed (``torch.cuda.synchronize`` around each); the peak is
``torch.cuda.max_memory_allocated()`` over the timed steps. Criteria: peak within 5%, step time
within 10% of the plan's prediction (``tests/test_plan_compile.py`` asserts the peak; a step
time is a measurement, so it is judged here, not in a test). A last row ("user") is the user's
flow: ``remat.plan(model, ids, "30GiB", compile=True)``, ``remat.apply``, ``model.compile()``.

    PYTHONPATH=src python3 benchmarks/compiled_plan_validate.py --out "$OUT"   # ~5 min on an H100

Writes ``compiled_plan_validate.jsonl`` (one record per budget, an ``error`` field where a row
failed; the others still run) into ``--out`` and prints a table last.
"""
import argparse
import datetime
import json
import os
import statistics
import time
import traceback

import torch

import remat
from remat.planning.plans import OFFLOADING_TREATMENTS
from remat.planning.simulator import simulate
from remat.planning.solver import solve
from remat.presets import build_model, load_config

WHERE = (0.0, 0.5, 1.0)


def bench_like():
    config = load_config("llama-1b")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    return build_model(config, device="cuda", dtype=torch.bfloat16)


def measure_compiled(model, ids, steps=7):
    """(peak bytes, median step seconds, spread) of ``model`` compiled in place."""
    import torch._dynamo
    torch._dynamo.reset()
    model.compile()
    try:
        for _ in range(3):  # compile and warm up
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return torch.cuda.max_memory_allocated(), statistics.median(times), max(times) - min(times)
    finally:
        model.zero_grad(set_to_none=True)
        model._compiled_call_impl = None
        torch._dynamo.reset()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    common = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__, remat=remat.__version__,
                  model="llama-1b (4 layers)", batch=2, seq=2048, dtype="bfloat16")
    model = bench_like()
    ids = torch.randint(0, model.config.vocab_size, (2, 2048), device="cuda")
    prof = remat.profile(model, ids, compile=True)
    assert prof.notes["compile"] is True and not set(prof.treatments(0)) & set(OFFLOADING_TREATMENTS)
    low = min(simulate(prof, t, head=h.mode, chunk_tokens=h.chunk_tokens).bound_bytes
              for t in prof.treatments(0) for h in prof.heads)
    high = max(simulate(prof, "keep", head=h.mode, chunk_tokens=h.chunk_tokens).bound_bytes for h in prof.heads)
    rows = []
    budgets = [(where, int((low + where * (high - low)) * 1.01)) for where in WHERE] + [("user", 30 * 2**30)]
    with open(os.path.join(args.out, "compiled_plan_validate.jsonl"), "w") as out:
        for where, budget in budgets:
            record = dict(common, where=where, budget_bytes=budget)
            try:
                # "user": the user's flow, remat.plan(compile=True) measuring its own plan, at 30 GiB
                plan = (remat.plan(model, ids, budget, compile=True) if where == "user" else solve(prof, budget))
                remat.apply(model, plan)
                try:
                    peak, step_s, spread = measure_compiled(model, ids)
                finally:
                    remat.remove(model)
                record.update(plan=plan.summary(), peak_bytes=peak, step_s=step_s, step_spread_s=spread,
                              predicted_peak_bytes=plan.notes["predicted_peak_bytes"],
                              predicted_step_s=plan.notes["predicted_step_s"])
                record["peak_error"] = peak / record["predicted_peak_bytes"] - 1
                record["step_error"] = step_s / record["predicted_step_s"] - 1
                record["within"] = abs(record["peak_error"]) <= 0.05 and abs(record["step_error"]) <= 0.10
            except Exception as error:  # noqa: BLE001 -- one failing row is recorded, the rest go on
                record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
            print(json.dumps(record), flush=True)
            out.write(json.dumps(record) + "\n")
            rows.append(record)
    print(f"\n{'where':>5}  {'plan':<34} {'peak GiB':>9} {'pred':>7} {'err':>7}  {'step ms':>8} {'pred':>7} {'err':>7}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['where']:>5}  error: {r['error'][:90]}")
            continue
        print(f"{r['where']:>5}  {r['plan'][:34]:<34} {r['peak_bytes'] / 2**30:>9.2f} "
              f"{r['predicted_peak_bytes'] / 2**30:>7.2f} {r['peak_error']:>+7.1%}  {r['step_s'] * 1e3:>8.1f} "
              f"{r['predicted_step_s'] * 1e3:>7.1f} {r['step_error']:>+7.1%}  {'yes' if r['within'] else 'NO'}")


if __name__ == "__main__":
    main()
