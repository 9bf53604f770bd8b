"""Long context on one GPU (issue 28): per sequence length, HF checkpointing beside remat's plan.

The model is the issue's: a Llama-3.1-8B shape (32 layers, hidden 4096, MLP 14336, vocab 128256)
with LoRA r=16 on every linear layer (PEFT), bf16, batch 1, AdamW on the LoRA weights; or, with
``--model llama-1b``, the llama-1b preset fully fine-tuned with AdamW. Per length, in one process:

- ``hf``: Hugging Face gradient checkpointing (non-reentrant), the model's own head;
- ``hf_offload``: the same with transformers' ``offload`` checkpointing where it has one;
- ``liger``: HF checkpointing with Liger's fused linear cross-entropy as the loss, where
  liger-kernel imports (it patches the model class: give it last);
- ``remat``: ``remat.plan`` at ``--budget`` (measured on the GPU; ``--fake`` plans with fake
  tensors, as ``remat plan`` does without a GPU), applied, then trained.

Each row records the peak (``max_memory_allocated``), the step time of the last of ``--steps``
steps (optimizer step included), tokens/s, the loss, and for remat the plan, its predicted peak
and step and how long planning took; "oom" where the GPU ran out of memory. A length where the
planner finds no plan records its NoPlanFits message (the floor it names).

    PYTHONPATH=src python benchmarks/longctx.py --seqs 65536,131072 --out DIR [--fake] [--model llama-1b]
    PYTHONPATH=src python benchmarks/longctx.py --longest --strategies hf,hf_offload,liger --out DIR

``--longest``: per strategy, the longest length it trains: doubling from ``--start`` (16k) until a
length fails, then bisecting the gap down to ``--resolution`` (16k) tokens; each try is a row,
then a ``longest`` row per strategy.

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
from _optimizer import allocate_state
from remat.planner import default_host_limit
from remat.profiling.profiler import progress_printer
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
    allocate_state(optimizer)  # so that a first step's peak holds it, as every later one does
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
        print(f"step {len(times)}: {times[-1]:.3f} s, peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB",
              flush=True)
    tokens = batch["input_ids"].numel()
    return dict(peak_GiB=round(torch.cuda.max_memory_allocated() / GiB, 3), step_s=round(times[-1], 3),
                steps_s=[round(t, 3) for t in times],
                tokens_per_s=round(tokens / times[-1]), loss=float(loss))


def free():
    gc.collect()
    torch.cuda.empty_cache()


def checkpointed(model, offload: bool):
    """Hugging Face checkpointing of every layer, non-reentrant; ``offload``: its saved inputs in
    host memory, where the installed transformers has that (``activation_checkpointing_enable``'s
    ``offload``), else RuntimeError."""
    import inspect
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
    kwargs_name = next(p for p in inspect.signature(enable).parameters if p.endswith("checkpointing_kwargs"))
    kwargs = {kwargs_name: {"use_reentrant": False}}
    if offload:
        if "offload" not in inspect.signature(enable).parameters:
            raise RuntimeError("this transformers has no offloaded activation checkpointing")
        kwargs["offload"] = True
    enable(**kwargs)


def with_liger(model):
    """Liger's fused linear cross-entropy as the model's loss (patched into the model class, so this
    strategy runs last in a process); RuntimeError where liger-kernel does not import."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as error:
        raise RuntimeError(f"liger-kernel does not import: {error}") from error
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=base)


def attempt(strategy: str, seq: int, args) -> dict:
    """One strategy at one length: built, set up, trained ``args.steps`` steps; the record."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    record = dict(model=args.model, seq=seq, budget=args.budget, strategy=strategy)
    model = None
    try:
        model, lora = build(args.model)
        if strategy in ("hf", "hf_offload", "liger"):
            checkpointed(model, offload=strategy == "hf_offload")
            if strategy == "liger":
                with_liger(model)
            if lora:
                model.enable_input_require_grads()
        else:
            started = time.perf_counter()
            # the host that trains is this one: its pinned-memory limit holds for a fake profile too
            plan = remat.plan(model, batch, budget=args.budget, optimizer="adamw",
                              host_memory=default_host_limit(), progress=progress_printer(),
                              **({"device": "fake"} if args.fake else {}))
            record.update(plan_s=round(time.perf_counter() - started, 1), plan=plan.summary(),
                          predicted_peak_GiB=round(plan.notes["predicted_peak_bytes"] / GiB, 3),
                          predicted_step_s=plan.notes.get("predicted_step_s"),
                          host_bytes=plan.notes.get("host_bytes"), profiled=plan.notes.get("profiled"))
            remat.apply(model, plan)
        if not (args.plan_only and strategy == "remat"):
            record.update(train(model, batch, args.steps))
    except torch.OutOfMemoryError:
        record["result"] = "oom"
    except Exception as error:  # noqa: BLE001  (a row records why it did not run)
        record["result"] = f"{type(error).__name__}: {str(error)[:500]}"
        if not isinstance(error, (RuntimeError, ValueError)):
            traceback.print_exc()
    model = batch = ids = None
    free()
    return record


def longest(strategy: str, args, write) -> None:
    """The longest length ``strategy`` trains: doubling from ``--start`` until one fails (out of
    memory, or no plan), then halving the gap down to ``--resolution`` tokens. Every try is written."""
    good, bad, seq = 0, None, args.start
    while bad is None and seq <= args.max_seq:
        record = attempt(strategy, seq, args)
        write(record)
        good, bad = (seq, None) if "result" not in record else (good, seq)
        seq *= 2
    while bad is not None and bad - good > args.resolution:
        seq = (good + bad) // 2 // args.resolution * args.resolution
        record = attempt(strategy, seq, args)
        write(record)
        good, bad = (seq, bad) if "result" not in record else (good, seq)
    write(dict(model=args.model, strategy=strategy, longest=good, first_failing=bad, resolution=args.resolution))


NAMES = {"hf": "HF gradient checkpointing", "hf_offload": "HF checkpointing, offload=True",
         "liger": "Liger fused loss + HF checkpointing", "remat": "remat plan"}
MODELS = {"llama-8b-lora": "Llama-3.1-8B shape, LoRA r=16 on every linear", "llama-1b": "llama-1b, full fine-tune"}


def plot(paths, out: str) -> str:
    """Tokens/s against sequence length per model and strategy, from the records in ``paths`` (rows
    that trained; the last record of a (model, strategy, length) wins, so give the runs in order),
    each point labelled with its tokens/s and each strategy's first length out of memory marked with
    an x; written to ``out``. Labels are placed by :func:`remat.prove.plot.place_labels`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from remat.prove.plot import place_labels
    rows, failed = {}, {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "seq" not in r:
                    continue
                key = (r["model"], r["strategy"])
                if "tokens_per_s" in r:
                    rows.setdefault(key, {})[r["seq"]] = r["tokens_per_s"]
                elif "result" in r:
                    failed[key] = min(failed.get(key, r["seq"]), r["seq"])
    models = sorted({m for m, _ in rows}, key=lambda m: list(MODELS).index(m) if m in MODELS else len(MODELS))
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False, dpi=120)
    placing = []
    for ax, model in zip(axes[0], models):
        labels, points, longest, lines = [], [], [], []
        for strategy in [s for s in NAMES if (model, s) in rows] + sorted(s for m, s in rows if m == model
                                                                          and s not in NAMES):
            line_points = rows[(model, strategy)]
            seqs = sorted(line_points)
            line, = ax.plot(seqs, [line_points[s] for s in seqs], marker="o", label=NAMES.get(strategy, strategy))
            longest.append(seqs[-1])
            lines.append([(seq, line_points[seq]) for seq in seqs])
            for seq in seqs:
                labels.append(ax.annotate(f"{line_points[seq]:,.0f}", (seq, line_points[seq]), fontsize=7,
                                          color=line.get_color(), textcoords="offset points", xytext=(0, 0),
                                          arrowprops=dict(arrowstyle="-", color=line.get_color(), alpha=0.5,
                                                          linewidth=0.7, shrinkA=1, shrinkB=5)))
                points.append((seq, line_points[seq]))
            oom = failed.get((model, strategy))
            if oom is not None and oom > seqs[-1]:
                last = line_points[seqs[-1]]
                ax.plot([seqs[-1], oom], [last, last], linestyle=":", color=line.get_color(), linewidth=1)
                ax.plot([oom], [last], marker="x", markersize=8, color=line.get_color(), linestyle="none")
                points.append((oom, last))
                lines.append([(seqs[-1], last), (oom, last)])
        ax.set_xscale("log", base=2)
        ticks = [2 ** k for k in range(14, 21) if 2 ** k <= max(longest + list(failed.values())) * 1.01]
        ax.set_xticks(ticks, labels=[f"{t // 1024:,}k" for t in ticks])
        ax.set_xlabel("tokens in the sequence (batch 1); x: the first length that ran out of memory")
        ax.set_ylabel("tokens/s: higher is better")
        ax.set_title(f"{MODELS.get(model, model)}\n1 x H100 80GB, budget 76 GiB, bf16, AdamW", fontsize=10)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
        ax.grid(alpha=0.3)
        legend = ax.legend(fontsize=8, loc="upper right")
        for text in labels:
            text.set_in_layout(False)
        placing.append((ax, labels, points, legend, lines))
    figure.tight_layout()
    for ax, labels, points, legend, lines in placing:
        labelled = [text.xy for text in labels]
        place_labels(figure, ax, labels, labelled, obstacles=[legend], markers=points, lines=lines)
    figure.savefig(out)
    plt.close(figure)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="65536,131072")
    parser.add_argument("--model", choices=("llama-8b-lora", "llama-1b"), default="llama-8b-lora")
    parser.add_argument("--budget", default="76GiB")
    parser.add_argument("--strategies", default="hf,remat",
                        help="comma-separated: hf, hf_offload, liger (last: it patches the model class), remat")
    parser.add_argument("--longest", action="store_true",
                        help="per strategy, the longest length it trains (doubling from --start, then bisecting)")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--max-seq", type=int, default=1 << 20)
    parser.add_argument("--resolution", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fake", action="store_true", help="plan with fake tensors (as without a GPU)")
    parser.add_argument("--plan-only", action="store_true", help="remat rows: plan (and time the planning), do not train")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--plot", nargs="+", metavar="JSONL",
                        help="no GPU run: plot tokens/s per length from these records into --out/longctx.png")
    args = parser.parse_args(argv)
    if args.plot:
        print(plot(args.plot, os.path.join(args.out, "longctx.png")))
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "longctx.jsonl"), "a") as sink:
        sink.write(json.dumps({"environment": environment(torch.device("cuda"))}) + "\n")

        def write(record):
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            print(json.dumps(record), flush=True)
        for strategy in args.strategies.split(","):
            if args.longest:
                longest(strategy, args, write)
                continue
            for seq in args.seqs.split(","):
                write(attempt(strategy, int(seq), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
