"""Issue 44 on a GPU: the models that read their cache or write their state in place, with every block
treatment beside an untouched copy on CUDA, where ``offload`` and ``full+offload`` really move tensors.

    PYTHONPATH=src python3 benchmarks/issue44_gpu.py [--models pi0,xlstm] [--out "$OUT/issue44_gpu.jsonl"]

The models and batches are ``tests/registry_zoo.py``'s (PI0: its VLM's prefix cache read by its
action expert inside the training forward; xLSTM with its default ``use_cache=True``: each block's
state written in place after it returns), moved to CUDA in fp32. Each row: two SGD steps beside an
untouched copy (same batch, same seed before each forward), the loss of each step compared bitwise
and every parameter gradient by its norm-wise relative difference (CUDA's attention backward is not
deterministic run to run, so a gradient may differ at fp32 rounding, ~1e-6), whether every parameter
the untouched model trains got a gradient (PI0's vision tower reaches the loss only through the
cache), and the bytes the offload engine moved. One row failing records its error; the others go on.
A table prints last. About a minute on one H100.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SPECS = ("keep", "full", "selective", "attn-saved", "attention", "mlp", "offload", "full+offload", "every:2",
         "segments:2")


def _to(batch, device):
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def run_row(model_type: str, spec: str, device: str = "cuda", steps: int = 2) -> dict:
    import torch

    import registry_zoo as rz
    import remat
    import zoo
    from remat.treat.treatments import engine_of
    case = rz.case(model_type)
    model = zoo.build(case).to(device)
    reference = copy.deepcopy(model)
    batch = _to(case.batch(model), device)
    # min_bytes=0: the registry's tiny models save tensors under the engine's 1 MiB default, and with it the
    # offload rows moved nothing (the first H200 run, offloaded_bytes 0): every saved tensor moves here
    remat.apply(model, spec, blocks=case.blocks, offload_options=dict(min_bytes=0) if "offload" in spec else None)
    losses_equal, worst, missing = True, 0.0, []
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(steps):
        losses = []
        for m in (model, reference):
            torch.manual_seed(100 + step)
            loss = case.loss(m, {k: v.clone() if hasattr(v, "clone") else v for k, v in batch.items()})
            loss.backward()
            losses.append(loss.detach())
        losses_equal = losses_equal and bool(torch.equal(*losses))
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if (p.grad is None) != (q.grad is None):
                missing.append(name)
            elif p.grad is not None:
                worst = max(worst, float((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm().clamp_min(1e-30)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    engine = engine_of(model)
    moved = engine.stats().get("bytes_packed", 0) if engine is not None else 0
    return {"losses_equal": losses_equal, "max_rel_grad": worst, "missing_grads": missing[:3], "offloaded_bytes": moved}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="pi0,xlstm")
    parser.add_argument("--specs", default=",".join(SPECS))
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "issue44_gpu.jsonl"))
    parser.add_argument("--device", default="cuda", help="cpu runs the plumbing (offload is a no-op there)")
    args = parser.parse_args(argv)
    import torch
    import transformers
    warnings.simplefilter("ignore")
    stamp = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
             "date": datetime.date.today().isoformat()}
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as out:
        for model_type in args.models.split(","):
            for spec in args.specs.split(","):
                start = time.perf_counter()
                try:
                    row = {"model": model_type, "spec": spec, **run_row(model_type, spec, args.device)}
                except Exception as error:  # noqa: BLE001 - one failing row is recorded, the rest go on
                    row = {"model": model_type, "spec": spec, "error": f"{type(error).__name__}: {error}"[:400],
                           "trace": traceback.format_exc()[-1500:]}
                row.update(stamp, seconds=round(time.perf_counter() - start, 2))
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
    print(f"{'model':8s} {'spec':14s} {'loss ==':8s} {'max rel grad':>13s} {'missing':>8s} {'offloaded':>12s}")
    for row in rows:
        if "error" in row:
            print(f"{row['model']:8s} {row['spec']:14s} ERROR {row['error'][:90]}")
            continue
        print(f"{row['model']:8s} {row['spec']:14s} {str(row['losses_equal']):8s} {row['max_rel_grad']:13.1e} "
              f"{len(row['missing_grads']):8d} {row['offloaded_bytes']:12d}")


if __name__ == "__main__":
    main()
