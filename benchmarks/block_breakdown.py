"""Where one decoder block's GPU time goes at long context (issue 28): kernels by kind.

The block is layer 0 of ``benchmarks/longctx.py``'s model (Llama-3.1-8B shape, LoRA r=16 on every
linear layer, bf16) run alone on ``--seqs`` tokens: a forward and a backward with nothing
recomputed, traced after a warm-up by ``_trace.trace_step``, whose categories sort the kernels:
``gemm`` (cuBLAS/CUTLASS matmuls), ``attention`` (flash / cuDNN / memory-efficient SDPA),
``elementwise`` and the rest (norms, RoPE, SwiGLU, LoRA's scaling and adds, casts, copies).
This is the floor a plan cannot go under at that length: every block runs it once per step
whatever is kept, recomputed or offloaded, so the share outside matmuls and attention is what
fused kernels could take off it.

    PYTHONPATH=src python benchmarks/block_breakdown.py --seqs 65536,131072 --out DIR

Writes ``DIR/block_breakdown.jsonl`` (the environment first, then one record per length).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trace import trace_step  # noqa: E402  (sibling scripts of benchmarks/)
from remat.prove.bench import environment  # noqa: E402


def one_block(seq: int):
    """Layer 0 of longctx's model with its rotary embedding, and its inputs at ``seq`` tokens."""
    from longctx import build
    model, _ = build("llama-8b-lora")
    base = model.get_base_model().model
    base.layers = base.layers[:1]
    hidden = torch.randn(1, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq, device="cuda")[None]
    rotary = base.rotary_emb(hidden, positions)
    return base.layers[0], hidden, positions, rotary


def measure(seq: int) -> dict:
    block, hidden, positions, rotary = one_block(seq)

    def step():
        out = block(hidden, position_embeddings=rotary, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    step()
    traced = trace_step(step)
    seconds = traced["kernel_s"]
    total = sum(seconds.values())
    return dict(seq=seq, block_fwd_bwd_s=round(total, 4), kernel_s=seconds,
                outside_matmul_attention_share=round(1 - (seconds["gemm"] + seconds["attention"]) / total, 3),
                top_kernels=traced["top_kernels"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="65536")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "block_breakdown.jsonl"), "w") as out:
        out.write(json.dumps({"environment": environment(torch.device("cuda"))}) + "\n")
        for seq in (int(s) for s in args.seqs.split(",")):
            record = measure(seq)
            print(json.dumps(record), flush=True)
            out.write(json.dumps(record) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
