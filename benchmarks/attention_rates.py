"""The rates a long-context step runs at, beside what the fake-tensor roofline charges for them.

Per op, on the GPU and on fake tensors priced by :mod:`remat.profiling._meters` with the rates of
``--gpu``: causal flash SDPA forward and backward (batch 1, 32 query heads, 8 key/value heads as
the llama presets have, head dims 64 and 128) at each ``--seqs`` length, and the block's large bf16
matmuls (hidden x MLP for llama-1b and llama-8b shapes) at 65,536 tokens. What this measures is
what :data:`remat.planning.costs.GPUS` holds for attention and what a GPU profile measures of it
before a long-context plan (:func:`remat.profiling.rates.measured_rates`).

    PYTHONPATH=src python benchmarks/attention_rates.py --out DIR [--seqs 4096,16384,65536,131072]

Writes ``DIR/attention_rates.jsonl``: one record per op and shape (measured seconds, the
roofline's seconds, the FLOPs and the rate they imply).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.planning.costs import rates_for
from remat.profiling._meters import _Tracker


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def attention_case(seq, head_dim, device):
    q = torch.randn(1, 32, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def measure_attention(seq, head_dim) -> tuple:
    q, k, v = attention_case(seq, head_dim, "cuda")
    forward = timed(lambda: sdpa(q, k, v))
    out = sdpa(q, k, v)
    grad = torch.randn_like(out)
    both = timed(lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), grad))
    return forward, both - forward


def roofline_attention(seq, head_dim, rates) -> tuple:
    with FakeTensorMode():
        q, k, v = attention_case(seq, head_dim, "cpu")
        # the fake profile runs the CUDA flash op (remat.profiling._fake._cuda_attention): K/V repeated
        k, v = (t.repeat_interleave(4, dim=1) for t in (k, v))
        tracker = _Tracker(rates)
        with tracker:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
            forward = tracker.seconds
            out.sum().backward()
        return forward, tracker.seconds - forward


def measure_matmul(tokens, hidden, inner) -> float:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(inner, hidden, device="cuda", dtype=torch.bfloat16)
    return timed(lambda: F.linear(x, w))


def roofline_matmul(tokens, hidden, inner, rates) -> float:
    with FakeTensorMode():
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        w = torch.empty(inner, hidden, dtype=torch.bfloat16)
        tracker = _Tracker(rates)
        with tracker:
            F.linear(x, w)
        return tracker.seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384,65536,131072")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rates = rates_for(args.gpu)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_rates.jsonl"), "w") as sink:
        def write(record):
            sink.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
        write({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "roofline_rates": args.gpu})
        for head_dim in (64, 128):
            for seq in map(int, args.seqs.split(",")):
                flops = 4 * seq * seq * head_dim * 32 / 2  # causal: half of the formula's
                measured = measure_attention(seq, head_dim)
                roofline = roofline_attention(seq, head_dim, rates)
                for phase, m, r, f in (("forward", measured[0], roofline[0], flops),
                                       ("backward", measured[1], roofline[1], 2.5 * flops)):
                    write(dict(op="sdpa_causal", phase=phase, seq=seq, head_dim=head_dim, measured_s=round(m, 6),
                               roofline_s=round(r, 6), ratio=round(m / r, 3), tflops=round(f / m / 1e12, 1)))
                torch.cuda.empty_cache()
        for hidden, inner in ((2048, 8192), (4096, 14336), (4096, 4096)):
            tokens = 65536
            m = measure_matmul(tokens, hidden, inner)
            r = roofline_matmul(tokens, hidden, inner, rates)
            write(dict(op="linear", tokens=tokens, hidden=hidden, inner=inner, measured_s=round(m, 6),
                       roofline_s=round(r, 6), ratio=round(m / r, 3), tflops=round(2 * tokens * hidden * inner / m / 1e12, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
