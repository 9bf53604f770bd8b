"""A step stopped by the offload pool's limit on a GPU: nothing may stay alive once the caller drops the model.

Found by verify_gpu.py (issue 45): after an offloaded step failed on the pinned limit, the model and ~3 GiB per
failed step stayed allocated for the rest of the process. The cause: the engine's pack hook handed back the
tensors it keeps in place (those under ``min_bytes``) as themselves, grad_fn included, and a saved output that
holds its own grad_fn is a cycle gc cannot see; a graph never differentiated is never freed. Scenarios: a failing
step under offload (twice: a leak grows), then ``remat.verify(model, batch, "offload")`` whose float64 twin hits
the same limit. Each prints the memory still allocated after gc and, for the largest CUDA tensor left, what
refers to it. Exits 1 when any scenario leaves more than 64 MiB allocated.

    PYTHONPATH=src python3 benchmarks/offload_failure_gpu.py [--out results.jsonl]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import types

import torch

import remat
from remat.cli.verify import set_dropout
from remat.presets import build_model, load_config

LEAK_BYTES = 64 << 20


def big_cuda_tensors(exclude: set) -> list:
    found = []
    for obj in gc.get_objects():
        try:
            if (isinstance(obj, torch.Tensor) and obj.is_cuda and id(obj) not in exclude
                    and obj.untyped_storage().nbytes() > 32 << 20):
                found.append(obj)
        except Exception:  # objects gc lists that fail isinstance/attribute access mid-teardown
            pass
    return found


def print_referrers(obj, depth: int = 0, seen: set | None = None, max_depth: int = 3) -> None:
    seen = set() if seen is None else seen
    for referrer in gc.get_referrers(obj):
        if id(referrer) in seen or isinstance(referrer, types.FrameType) or len(seen) > 60:
            continue
        if isinstance(referrer, list) and len(referrer) > 10000:  # gc.get_objects()'s own list
            continue
        seen.add(id(referrer))
        text = ("keys=" + ",".join(map(str, list(referrer)[:6]))) if isinstance(referrer, dict) else str(referrer)
        print("  " * depth + "<-", type(referrer).__name__, text[:100].replace("\n", " "))
        if depth < max_depth and not isinstance(referrer, types.ModuleType):
            print_referrers(referrer, depth + 1, seen, max_depth)


def failing_step(model, batch) -> str:
    remat.apply(model, "offload", offload_options=dict(host_memory_limit=2 << 30))
    try:
        model(**batch).loss.backward()
    except ValueError as error:
        return f"raised: {str(error)[:100]}"
    return "did not raise (the limit was not reached)"


def verify_offload(model, batch) -> str:
    report = remat.verify(model, batch, "offload")
    return f"verdict {report.verdict}; float64: {str(report.float64)[:100]}"


def scenario(name: str, run) -> dict:
    config = load_config("llama-1b")
    set_dropout(config, 0.1)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 2048), device="cuda")
    before = torch.cuda.memory_allocated()
    outcome = run(model, {"input_ids": ids, "labels": ids})
    exclude = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    del model, ids
    gc.collect()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated()
    print(f"== {name}: {outcome}\n   allocated after gc {left / 2**30:.3f} GiB (model and batch: "
          f"{before / 2**30:.3f} GiB)", flush=True)
    leaked = big_cuda_tensors(exclude)
    if leaked:
        biggest = max(leaked, key=lambda t: t.untyped_storage().nbytes())
        print(f"   {len(leaked)} CUDA tensors over 32 MiB alive; the biggest {tuple(biggest.shape)} "
              f"{biggest.dtype}, referred to by:")
        print_referrers(biggest)
    del leaked
    gc.collect()
    torch.cuda.empty_cache()
    return {"scenario": name, "outcome": outcome, "allocated_after_gc_bytes": left,
            "model_and_batch_bytes": before, "leaked": left > LEAK_BYTES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append one JSON record per scenario here")
    args = parser.parse_args()
    records = [scenario("failing step under offload", failing_step),
               scenario("failing step under offload, again", failing_step),
               scenario("verify offload", verify_offload)]
    for record in records:
        record.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.out:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
    return 1 if any(record["leaked"] for record in records) else 0


if __name__ == "__main__":
    sys.exit(main())
