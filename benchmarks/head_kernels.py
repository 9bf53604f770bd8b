"""The chunked head alone beside Liger's fused linear cross-entropy: time, peak, and where the GPU time goes.

``head_bench.py`` times the whole bench model, where the head is about a tenth of a step and a
percent of the step is within its run-to-run spread. This script takes the head out of the
model: hidden states [tokens x hidden] and the LM head's weight [vocab x hidden] (bf16, the
bench model's shapes by default: 4 x 4096 tokens, hidden 2048, vocab 128256; random targets,
every 7th ignored), and per variant runs forward and backward of the loss with both
gradients wanted, as the model's step does:

- ``liger``: ``LigerFusedLinearCrossEntropyLoss`` (skipped, with the reason, when it does not import);
- ``plain``: ``F.cross_entropy(F.linear(h, w).float(), y)``, the unchunked reference;
- ``chunked:N``: remat's ``chunked_cross_entropy`` at chunk N, as it runs (the weight gradient
  summed by remat's choice: target rows for this bf16 head);
- ``chunked:N@fp32sum``: the weight gradient summed in fp32; ``chunked:N@bf16sum``: in bf16 with
  no target rows (the floor the target rows add to).

Per variant: median and spread of ``--steps`` timed forward+backward passes (CUDA events, after
``--warmup`` untimed ones), the peak above what was allocated before the pass, and one more pass
under ``torch.profiler`` (``_trace.trace_step``: GPU time per kernel category and per kernel
name, the ``--top`` costliest, and the pass's GPU-busy and idle time, in the row's ``trace``).
Never a timing inside a unit test. (The records of session 18 were written before the profile
went through ``_trace``: their rows hold ``kernels``, ``profiled_busy_s`` and ``profiled_span_s``.)

Usage (GPU machine, repository root; Liger from its wheel):
    PYTHONPATH=src python3 benchmarks/head_kernels.py --out "$OUT"
Writes ``head_kernels.json`` and prints one line per variant and the kernel tables.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch
import torch.nn.functional as F

from remat.prove.anchors import fused_loss, fused_loss_unavailable
from remat.head import chunked_loss

from _trace import format_breakdown, trace_step  # benchmarks/_trace.py
from head_bench import _Bf16Sum, _accumulator_restored, _fp32_sum  # the whole-model bench's A/B sums


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4 * 4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunks", default="1024,2048", help="comma-separated chunk sizes")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


SUMS = {"fp32sum": _fp32_sum, "bf16sum": _Bf16Sum}


@contextlib.contextmanager
def _summed_by(name):
    """remat's weight-gradient sum replaced by ``SUMS[name]`` inside the block (None: remat's own)."""
    with _accumulator_restored():
        if name is not None:
            chunked_loss._accumulator = lambda weight, *_: SUMS[name](weight)
        yield


def variants(args):
    """name -> (loss(h, w, y), the accumulator's name or None)."""
    out = {"liger": (None, None), "plain": (lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y), None)}
    for c in (int(c) for c in args.chunks.split(",") if c):
        loss = (lambda c: lambda h, w, y: chunked_loss.chunked_cross_entropy(h, w, None, y, chunk_tokens=c))(c)
        out[f"chunked:{c}"] = (loss, None)
        for name in SUMS:
            out[f"chunked:{c}@{name}"] = (loss, name)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(out))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {', '.join(out)}")
        out = {k: out[k] for k in wanted}
    return out


def measure(loss_fn, accumulator, h, w, y, args):
    def step():
        h.grad = w.grad = None
        loss = loss_fn(h, w, y)
        loss.backward()
        return loss.detach()

    with _summed_by(accumulator):
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        trace = trace_step(step, cuda=True, top=args.top)
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_above_inputs_gib": peak / 2 ** 30, "loss": float(loss), "trace": trace}


def main(argv=None):
    args = parse(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    y[::7] = -100
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
            "hidden": args.hidden, "vocab": args.vocab, "distinct_targets": int(torch.unique(y).numel())}
    print(json.dumps(info), flush=True)
    rows = {}
    for name, (loss_fn, accumulator) in variants(args).items():
        if name == "liger":
            why = fused_loss_unavailable("liger")
            if why:
                rows[name] = {"skipped": why}
                continue
            loss_fn = fused_loss("liger")
        torch.cuda.empty_cache()
        rows[name] = measure(loss_fn, accumulator, h, w, y, args)
        r = rows[name]
        print(f"{name:22s} {r['step_s'] * 1e3:8.3f} ms (min {r['min_s'] * 1e3:.3f}, max {r['max_s'] * 1e3:.3f})  "
              f"peak +{r['peak_above_inputs_gib']:.3f} GiB  loss {r['loss']:.5f}\n  {format_breakdown(r['trace'])}",
              flush=True)
        for kernel, _category, seconds, count in r["trace"]["top_kernels"]:
            print(f"    {seconds * 1e3:8.3f} ms x{count:<4d} {kernel}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "head_kernels.json"), "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
