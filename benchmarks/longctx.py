"""Long context on one GPU (issues 28, 38, 39): per sequence length, the stacks users run beside remat's plan.

The model is the issue's: a Llama-3.1-8B shape (32 layers, hidden 4096, MLP 14336, vocab 128256)
with LoRA r=16 on every linear layer (PEFT), bf16, batch 1, AdamW on the LoRA weights; or, with
``--model llama-1b``, the llama-1b preset fully fine-tuned with AdamW (``llama-tiny``: the CPU check
of this script). Per length, in one process, the rows of ``--strategies``:

- ``hf``: Hugging Face gradient checkpointing (non-reentrant), the model's own head;
- ``hf_offload`` / ``hf_every2``: transformers' ``offload`` / ``every_n_layers=2`` checkpointing,
  where the installed transformers has them (else the row records why not);
- ``liger``: HF checkpointing with Liger's fused linear cross-entropy alone as the loss (patched on
  the instance);
- ``liger_hf``: what ``use_liger_kernel=True`` turns on (rope, rms_norm, swiglu, fused linear CE) +
  HF checkpointing; ``liger_keep``: the same kernels without checkpointing (the ceiling, where it
  fits); ``liger_remat``: ``remat.plan`` on the Liger-patched model, measured (a fake-tensor profile
  would hand Triton fake tensors: refused with ``--fake``). Each Liger row builds its model inside
  :func:`remat.prove.stacks.liger_patched`, which puts ``modeling_llama`` back after the row, so
  rows may come in any order;
- ``compile_hf``: HF checkpointing, then ``torch.compile``; ``unsloth``: Unsloth's offloaded
  checkpointing where ``unsloth_zoo`` imports (else skipped, saying why);
- ``remat``: ``remat.plan`` at ``--budget`` (measured on the GPU; ``--fake`` plans with fake
  tensors, as ``remat plan`` does without a GPU), applied, then trained.

``--card 79.2GiB`` caps what the allocator may reserve for the whole run (an 80 GB card,
:mod:`remat.prove.card`), planning included. Each row records the allocated and reserved peaks,
the step time of the last of ``--steps`` steps (optimizer step included), tokens/s, the loss, for
remat the plan, its predicted peak and step and how long planning took, and its ratio to
``liger_hf`` and to the ceiling (``liger_keep``) of the same length where those ran; ``oom`` (with
the phase: build, plan or train, and the peaks reached) where the card ran out, ``skipped`` with
the reason where a row cannot run. A length where the planner finds no plan records its
NoPlanFits message (the floor it names). A table of every row is printed last.

    PYTHONPATH=src python benchmarks/longctx.py --seqs 65536 --card 79.2GiB --strategies liger_hf,hf,remat --out DIR
    PYTHONPATH=src python benchmarks/longctx.py --longest --strategies hf,hf_offload,liger --out DIR

``--longest``: per strategy, the longest length it trains: doubling from ``--start`` (16k) until a
length fails, then bisecting the gap down to ``--resolution`` (16k) tokens; each try is a row,
then a ``longest`` row per strategy.

Writes ``DIR/longctx.jsonl`` (one record per length and strategy, the environment first).
"""
from __future__ import annotations

import argparse
import contextlib
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
from remat.prove import stacks
from remat.prove.anchors import Skip
from remat.prove.bench import environment
from remat.prove.card import capped, parse_card
from remat.prove.strategies import hf_checkpointing

GiB = 2 ** 30
STRATEGIES = ("hf", "hf_offload", "hf_every2", "liger", "liger_hf", "liger_keep", "liger_remat", "compile_hf",
              "unsloth", "remat")
LIGER_SCOPED = ("liger_hf", "liger_keep", "liger_remat")   # built inside liger_patched
CEILINGS = ("liger_keep",)


def build(model_name: str, device: str = "cuda"):
    """(model, whether it is a LoRA model) for ``model_name``, in training mode on ``device``."""
    if model_name in ("llama-1b", "llama-tiny"):
        from remat.presets import build_model, load_config
        config = load_config(model_name)
        config.max_position_embeddings = 1 << 21
        return build_model(config, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32
                           ).train(), False
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  max_position_embeddings=1 << 21, rope_theta=500000.0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(torch.float32)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).train(), True


def _peaks(cuda: bool) -> dict:
    if not cuda:
        return {}
    return dict(peak_GiB=round(torch.cuda.max_memory_allocated() / GiB, 3),
                reserved_GiB=round(torch.cuda.max_memory_reserved() / GiB, 3))


def train(model, batch, steps: int, forward=None) -> dict:
    """``steps`` AdamW steps (its state allocated first, so every step's peak holds it); the peaks,
    the last step's time, tokens/s and the first loss. ``forward``: what runs the model (compiled)."""
    cuda = batch["input_ids"].device.type == "cuda"
    forward = model if forward is None else forward
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    allocate_state(optimizer)  # so that a first step's peak holds it, as every later one does
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, first = [], None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = forward(**batch).loss
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        first = float(loss.detach()) if first is None else first
        print(f"step {len(times)}: {times[-1]:.3f} s" + (f", peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB "
                                                          f"({torch.cuda.max_memory_reserved() / GiB:.2f} reserved)"
                                                          if cuda else ""), flush=True)
    tokens = batch["input_ids"].numel()
    return dict(_peaks(cuda), step_s=round(times[-1], 3), steps_s=[round(t, 3) for t in times],
                tokens_per_s=round(tokens / times[-1]), loss=first)


def free(cuda: bool = True):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def checkpointed(model, offload: bool = False, every_n_layers: int = 1):
    """Hugging Face checkpointing, non-reentrant; ``offload`` / ``every_n_layers``: transformers' own
    (:func:`remat.prove.strategies.hf_checkpointing`: Skip where the installed version has none)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not offload and every_n_layers == 1:
        enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
        kwargs_name = ("activation_checkpointing_kwargs" if enable.__name__ == "activation_checkpointing_enable"
                       else "gradient_checkpointing_kwargs")
        enable(**{kwargs_name: {"use_reentrant": False}})
        return
    method, kwargs_name = hf_checkpointing(base)
    method(**{kwargs_name: {"use_reentrant": False}}, every_n_layers=every_n_layers, offload=offload)


def with_liger_loss(model):
    """Liger's fused linear cross-entropy as the model's loss, on this instance only (no kernel of
    the modeling module changes); Skip where liger-kernel does not import."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as error:  # noqa: BLE001 - ImportError, or Triton failing at import
        raise Skip(f"liger-kernel does not import: {type(error).__name__}: {error}") from error
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=base)


def _unsloth(model):
    checkpointer = stacks.unsloth_checkpointer()
    checkpointed(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for module in base.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = lambda function, *a, **k: checkpointer.apply(function, *a)


def _plan(model, batch, args, record, device: str):
    if args.fake and record["strategy"] == "liger_remat":
        raise Skip("a fake-tensor profile hands Liger's Triton kernels fake tensors (issue 39); plan the Liger-patched "
                   "model measured (leave --fake out)")
    started = time.perf_counter()
    # the host that trains is this one: its pinned-memory limit holds for a fake profile too
    plan = remat.plan(model, batch, budget=args.budget, optimizer="adamw", host_memory=default_host_limit(),
                      progress=progress_printer(), **({"device": "fake"} if args.fake else {}),
                      **({"gpu": "h100"} if device == "cpu" else {}))
    record.update(plan_s=round(time.perf_counter() - started, 1), plan=plan.summary(),
                  predicted_peak_GiB=round(plan.notes["predicted_peak_bytes"] / GiB, 3),
                  predicted_step_s=plan.notes.get("predicted_step_s"),
                  host_bytes=plan.notes.get("host_bytes"), profiled=plan.notes.get("profiled"))
    remat.apply(model, plan)


def attempt(strategy: str, seq: int, args) -> dict:
    """One strategy at one length: built, set up, trained ``args.steps`` steps; the record."""
    device = args.device
    cuda = device == "cuda"
    generator = torch.Generator(device=device).manual_seed(1)
    vocab = 32000 if args.model != "llama-tiny" else 128
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    record = dict(model=args.model, seq=seq, budget=args.budget, strategy=strategy,
                  card_GiB=round(args.card.bytes / GiB, 3) if args.card else None)
    model, phase = None, "build"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        scope = stacks.liger_patched("llama", cuda) if strategy in LIGER_SCOPED else contextlib.nullcontext()
        with scope:
            model, lora = build(args.model, device)
            phase = "plan" if strategy in ("remat", "liger_remat") else "setup"
            forward = None
            if strategy in ("remat", "liger_remat"):
                _plan(model, batch, args, record, device)
            elif strategy == "unsloth":
                if not cuda:
                    raise Skip("Unsloth's offloaded checkpointing moves activations to host memory: GPU only")
                _unsloth(model)
                if lora:
                    model.enable_input_require_grads()
            elif strategy != "liger_keep":  # HF checkpointing, and what the row adds to it
                if strategy == "hf_offload" and not cuda:
                    raise Skip("offload moves activations to host memory: GPU only")
                if strategy == "liger" and not cuda:
                    raise Skip("Liger runs Triton kernels: GPU only")
                checkpointed(model, offload=strategy == "hf_offload", every_n_layers=2 if strategy == "hf_every2" else 1)
                if strategy == "liger":
                    with_liger_loss(model)
                if strategy == "compile_hf":
                    forward = torch.compile(model, **({"backend": args.compile_backend} if args.compile_backend else {}))
                if lora:  # the frozen embeddings' output must carry a gradient into the first checkpoint
                    model.enable_input_require_grads()
            phase = "train"
            if not (args.plan_only and strategy in ("remat", "liger_remat")):
                record.update(train(model, batch, args.steps, forward=forward))
            model = forward = None
    except Skip as why:
        record.update(result="skipped", reason=str(why))
    except torch.OutOfMemoryError:
        record.update(result="oom", phase=phase, **{f"oom_{k}": v for k, v in _peaks(cuda).items()})
    except Exception as error:  # noqa: BLE001  (a row records why it did not run)
        record.update(result=f"{type(error).__name__}: {str(error)[:500]}", phase=phase)
        if not isinstance(error, (RuntimeError, ValueError)):
            traceback.print_exc()
    model = batch = ids = None
    if strategy == "compile_hf":
        torch._dynamo.reset()
    free(cuda)
    return record


def relate(records: list) -> None:
    """Each trained record's ratio to ``liger_hf`` and to the ceiling at its length, where they trained."""
    for record in records:
        if "tokens_per_s" not in record:
            continue
        same = [r for r in records if r.get("seq") == record["seq"] and "tokens_per_s" in r]
        liger_hf = next((r for r in same if r["strategy"] == "liger_hf"), None)
        ceiling = max((r for r in same if r["strategy"] in CEILINGS), key=lambda r: r["tokens_per_s"], default=None)
        if liger_hf is not None:
            record["vs_liger_hf"] = round(record["tokens_per_s"] / liger_hf["tokens_per_s"], 3)
        if ceiling is not None:
            record.update(ceiling=ceiling["strategy"], vs_ceiling=round(record["tokens_per_s"] / ceiling["tokens_per_s"], 3))


def table(records: list) -> str:
    """Every row of the run: allocated and reserved peaks, tokens/s and the ratios, or why it did not train."""
    lines = ["| seq | strategy | card | peak allocated (predicted) | reserved | tokens/s | vs liger_hf | vs ceiling | "
             "plan / result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "seq" not in r:
            continue
        card = f"{r['card_GiB']:g} GiB" if r.get("card_GiB") else "none"
        predicted = f" ({r['predicted_peak_GiB']:.2f})" if r.get("predicted_peak_GiB") is not None else ""
        if "tokens_per_s" in r:
            peak = f"{r['peak_GiB']:.2f}" if r.get("peak_GiB") is not None else "-"
            reserved = f"{r['reserved_GiB']:.2f}" if r.get("reserved_GiB") is not None else "-"
            lines.append(f"| {r['seq']:,} | {r['strategy']} | {card} | {peak}{predicted} | {reserved} | "
                         f"{r['tokens_per_s']:,} | {r.get('vs_liger_hf', '')} | {r.get('vs_ceiling', '')} | "
                         f"{r.get('plan', '')} |")
        else:
            why = r.get("result", "planned only")
            if why == "oom":
                why = f"**oom** in {r.get('phase')}" + (f" ({r['oom_reserved_GiB']:.2f} GiB reserved)"
                                                        if r.get("oom_reserved_GiB") else "")
            elif r.get("reason"):
                why = f"{why}: {r['reason'][:120]}"
            lines.append(f"| {r['seq']:,} | {r['strategy']} | {card} | {predicted.strip()} | | | | | {why} |")
    return "\n".join(lines) + "\n"


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
                elif r.get("result") not in (None, "skipped"):
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
        ax.legend()
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
    parser.add_argument("--model", choices=("llama-8b-lora", "llama-1b", "llama-tiny"), default="llama-8b-lora")
    parser.add_argument("--budget", default="76GiB")
    parser.add_argument("--strategies", default="hf,remat", help=f"comma-separated, of: {', '.join(STRATEGIES)}")
    parser.add_argument("--card", help="emulate a card of this size (79.2GiB: an 80 GB H100): the allocator capped at it")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a check of this script's rows (llama-tiny), no peaks")
    parser.add_argument("--compile-backend", help="compile_hf's torch.compile backend (default inductor)")
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
    chosen = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        parser.error(f"--strategies names unknown rows {unknown}; known: {', '.join(STRATEGIES)}")
    try:
        args.card = parse_card(args.card, args.device) if args.card else None
    except ValueError as error:
        parser.error(str(error))
    os.makedirs(args.out, exist_ok=True)
    records = []
    with open(os.path.join(args.out, "longctx.jsonl"), "a") as sink, capped(args.card):
        environment_record = environment(torch.device(args.device))
        if args.card:
            environment_record["card"] = args.card.describe()
        sink.write(json.dumps({"environment": environment_record}) + "\n")

        def write(record):
            records.append(record)
            relate(records)   # against the rows of its length that ran before it
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            print(json.dumps(record), flush=True)
        for strategy in chosen:
            if args.longest:
                longest(strategy, args, write)
                continue
            for seq in args.seqs.split(","):
                write(attempt(strategy, int(seq), args))
    relate(records)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
