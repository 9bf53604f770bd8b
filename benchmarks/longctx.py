"""Long context on one GPU (issue 28): per sequence length, HF checkpointing beside remat's plan.

The model is the issue's: a Llama-3.1-8B shape (32 layers, hidden 4096, MLP 14336, vocab 128256)
with LoRA r=16 on every linear layer (PEFT), bf16, batch 1, AdamW on the LoRA weights; or, with
``--model llama-1b``, the llama-1b preset fully fine-tuned with AdamW. Per length, in one process:

- ``hf``: Hugging Face gradient checkpointing (non-reentrant), the model's own head;
- ``hf_offload``: the same with transformers' ``offload`` checkpointing where it has one;
- ``remat``: ``remat.plan`` at ``--budget`` (measured on the GPU; ``--fake`` plans with fake
  tensors, as ``remat plan`` does without a GPU), applied, then trained.

Each row records the peak (``max_memory_allocated``), the step time of the last of ``--steps``
steps (optimizer step included), tokens/s, the loss, and for remat the plan, its predicted peak
and step and how long planning took; "oom" where the GPU ran out of memory. A length where the
planner finds no plan records its NoPlanFits message (the floor it names).

    PYTHONPATH=src python benchmarks/longctx.py --seqs 65536,131072 --out DIR [--fake] [--model llama-1b]

Writes ``DIR/longctx.jsonl`` (one record per length and strategy, the environment first).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

import remat
from remat.prove.bench import environment

GiB = 2 ** 30


def build(model_name: str):
    if model_name == "llama-1b":
        from remat.presets import build_model, load_config
        config = load_config("llama-1b")
        config.max_position_embeddings = 1 << 21
        return build_model(config, device="cuda", dtype=torch.bfloat16).train(), False
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  max_position_embeddings=1 << 21, rope_theta=500000.0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(torch.float32)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).train(), True


def train(model, batch, steps: int) -> dict:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tokens = batch["input_ids"].numel()
    return dict(peak_GiB=round(torch.cuda.max_memory_allocated() / GiB, 3), step_s=round(times[-1], 3),
                tokens_per_s=round(tokens / times[-1]), loss=float(loss))


def free():
    gc.collect()
    torch.cuda.empty_cache()


def length(seq: int, args, write) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    base = dict(model=args.model, seq=seq, budget=args.budget)
    for strategy in args.strategies.split(","):
        model = None
        record = dict(base, strategy=strategy)
        try:
            model, lora = build(args.model)
            if strategy in ("hf", "hf_offload"):
                kwargs = {"use_reentrant": False}
                if strategy == "hf_offload":
                    import inspect
                    if "offload" not in inspect.signature(type(model).gradient_checkpointing_enable).parameters:
                        raise RuntimeError("this transformers has no offloaded gradient checkpointing")
                    kwargs = {"gradient_checkpointing_kwargs": kwargs, "offload": True}
                    model.gradient_checkpointing_enable(**kwargs)
                else:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
                if lora:
                    model.enable_input_require_grads()
            else:
                started = time.perf_counter()
                plan = remat.plan(model, batch, budget=args.budget, optimizer="adamw",
                                  **({"device": "fake"} if args.fake else {}))
                record.update(plan_s=round(time.perf_counter() - started, 1), plan=plan.summary(),
                              predicted_peak_GiB=round(plan.notes["predicted_peak_bytes"] / GiB, 3),
                              predicted_step_s=plan.notes.get("predicted_step_s"),
                              host_bytes=plan.notes.get("offload_bytes"))
                remat.apply(model, plan)
            record.update(train(model, batch, args.steps))
        except torch.OutOfMemoryError:
            record["result"] = "oom"
        except Exception as error:  # noqa: BLE001  (a row records why it did not run)
            record["result"] = f"{type(error).__name__}: {str(error)[:500]}"
            traceback.print_exc()
        model = None
        free()
        write(record)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="65536,131072")
    parser.add_argument("--model", choices=("llama-8b-lora", "llama-1b"), default="llama-8b-lora")
    parser.add_argument("--budget", default="76GiB")
    parser.add_argument("--strategies", default="hf,remat", help="comma-separated: hf, hf_offload, remat")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fake", action="store_true", help="plan with fake tensors (as without a GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "longctx.jsonl"), "a") as sink:
        sink.write(json.dumps({"environment": environment(torch.device("cuda"))}) + "\n")

        def write(record):
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            print(json.dumps(record), flush=True)
        for seq in args.seqs.split(","):
            length(int(seq), args, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
