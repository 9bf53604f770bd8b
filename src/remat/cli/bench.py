"""``remat bench``: measure remat's plans beside the stock strategies, in one process.

The measuring is :mod:`remat.prove.bench`; this module picks defaults for the device (on a GPU
the bench model, ``llama-1b``: docs/design/diagnosis.md), checks every option before any model is
built (budgets with :func:`remat.units.parse_budget`, counts >= 1, ``--only`` and ``--anchors``
names, each ``--uniform`` spec), and writes the records, a markdown table and a plot into ``--out``.
Progress goes to stderr, the table to stdout. ``--card`` is parsed and checked against the GPU
(:func:`remat.prove.card.parse_card`) and ``--uncapped`` against the rows chosen before anything
is measured; a budget above the card is said on stderr (its plan may run out of memory there) and
measured all the same.

Without a GPU and without options that ask for the measuring bench, ``remat bench`` (``make
demo``) shows what a CPU proves instead (:mod:`remat.prove.demo`): bitwise-equal gradients per
treatment, the measured CPU peak beside the prediction, and the planner's predicted frontier for
``llama-1b`` on an H100. ``--device cpu`` (or a model, shapes, ``--only`` ...) runs the measuring
bench on the CPU; its step times are labelled as what they are on a CPU.
"""
from __future__ import annotations

import json
import os
import re
import sys

HELP = ("measure remat's plans beside the stock strategies (eager, HF checkpointing, every-2, "
        "op-level SAC, save_on_cpu, HF every-N/offload, torch.compile budgets, fused losses, the Liger / "
        "compile / Unsloth stacks) on one model and batch, optionally on an emulated card")
EXAMPLES = """examples:
  remat bench                 # on a GPU, the bench model; without one, what a CPU proves (under a minute)
  remat bench --model llama-1b --batch 4 --seq 4096 --budgets 10,16,25,32,45GiB --out results/  # GPU
  remat bench --model qwen-1.5b --batch 8 --seq 2048 --compile                                  # GPU
  remat bench --only eager,hf_full,remat:full,remat:selective
  remat bench --compile --anchors liger,cce --out results/   # GPU: remat+compile@ plans, fused-loss anchors
  remat bench --only eager,remat:full --json > records.jsonl   # records on stdout, nothing else
  remat bench --optimizer adamw --budgets 14GiB --card 15.5GiB --uncapped eager,liger_keep \
      --anchors stacks --out results/   # GPU: the stacks users run, every row on a 15.5 GiB card

Writes bench.jsonl (one JSON record per strategy), bench.md (a table) and bench.png (peak GiB
on x, tokens/s on y) into --out. An out-of-memory is recorded as 'oom', not a crash.
Without a GPU, plain `remat bench` proves gradients and CPU peaks per treatment and predicts
llama-1b's frontier on an H100 (labelled as predictions); --device cpu times the CPU instead.
--compile adds torch.compile at activation_memory_budget 1.0/0.5/0.2 and, at every budget, a
remat+compile@<budget> row: remat.plan(model, batch, budget, compile=True), applied, then
model.compile(). benchmarks/frontier.py runs the whole bench N times in fresh processes.
--card SIZE caps what the allocator may reserve at SIZE for every row (remat's, the anchors',
planning included; torch.cuda.set_per_process_memory_fraction), so a row runs out of memory
where a card of that size would: 79.2GiB is an H100 80GB as CUDA sees it (80GB is 74.5 GiB).
Each record has the allocated and the reserved peak; --uncapped names rows run on the whole GPU
(the ceilings, which need more than the card). --anchors stacks adds the stacks users run
(liger_hf, liger_keep, liger_remat@<budget>, compile_hf, unsloth); a row whose package does not
import is recorded as skipped, with the reason. Every row records its fraction of the ceiling:
the fastest no-recompute row (liger_keep or eager; compiled rows: compile_1 or
compile_1+mask_skip).
"""

GPU_DEFAULTS = dict(model="llama-1b", batch=4, seq=4096, budgets="10,16,25,32,45GiB")
CPU_DEFAULTS = dict(model="llama-tiny", batch=2, seq=128, budgets="auto")
AUTO_FRACTIONS = (0.45, 0.65, 0.85)  # of what eager adds above weights + gradients (see run)
DEFAULT_UNIFORM = "full,selective"


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="preset, JSON config file or folder holding config.json (default: "
                                        "llama-1b on a GPU, llama-tiny on the CPU)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--budgets", help="comma-separated memory budgets (e.g. 10,16,32GiB), or 'auto' "
                                          f"(weights and gradients + fractions {AUTO_FRACTIONS} of what "
                                          "eager's measured peak adds above them)")
    parser.add_argument("--uniform", default=DEFAULT_UNIFORM,
                        help="remat specs measured on every block, comma-separated (default: full,selective; any "
                             "spec remat.apply takes: every:2, segments:4, ...)")
    parser.add_argument("--only", help="comma-separated strategy names to run (e.g. eager,remat:full)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile with activation_memory_budget 1.0/0.5/0.2 and a "
                             "remat+compile@<budget> plan per budget (minutes)")
    parser.add_argument("--compile-backend", help="torch.compile backend of the compiled rows (default "
                                                  "inductor; aot_eager for a quick check of the wiring)")
    parser.add_argument("--anchors", default="",
                        help="comma-separated extra rows: fused-loss anchors on a keep model, liger (liger-kernel) "
                             "and cce (cut-cross-entropy), refused if they do not import; the stacks users run, "
                             "liger_hf, liger_keep, liger_remat, compile_hf, unsloth, or 'stacks' for all of them, "
                             "skipped with the reason where they cannot run")
    parser.add_argument("--optimizer", choices=("none", "adamw", "adamw-fused", "adamw-forloop"), default="none",
                        help="none: forward and backward (default); adamw: torch.optim.AdamW (foreach, torch's "
                             "default on a GPU) stepped after each backward, and remat's plans made for it; "
                             "adamw-fused: AdamW(fused=True), the HF Trainer's default; adamw-forloop: foreach=False")
    parser.add_argument("--card", help="emulate a card of this size on the GPU (e.g. 79.2GiB, 15.5GiB, 80GB): every row's "
                                       "allocator capped at it; refused without a CUDA GPU or above the GPU's size")
    parser.add_argument("--uncapped", default="",
                        help="with --card: comma-separated rows run on the whole GPU (ceilings that do not fit the card)")
    parser.add_argument("--json", action="store_true",
                        help="print the records as JSON lines on stdout (and nothing else)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    parser.add_argument("--out", default="remat-bench", help="output folder (default ./remat-bench)")


def run(args) -> int:
    import torch

    from remat.prove import bench, demo, report, stacks, strategies
    from remat.prove.anchors import FUSED_LOSSES
    from remat.prove.card import parse_card
    from remat.units import format_size, parse_budget

    _check_counts(args)
    _check_specs(args)
    if demo.is_requested(args, defaults=dict(uniform=DEFAULT_UNIFORM, steps=5, warmup=2, optimizer="none",
                                             card=None, uncapped="")):
        return _demo(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA GPU is visible; leave --device out to run on the CPU")
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    model = args.model or defaults["model"]
    batch, seq = args.batch or defaults["batch"], args.seq or defaults["seq"]
    budgets_arg = args.budgets or defaults["budgets"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    budgets = [] if budgets_arg == "auto" else [parse_budget(b) for b in _split_budgets(budgets_arg)]
    uniform = [s for s in args.uniform.split(",") if s]
    for name in (args.only or "").split(","):  # --only remat:<spec> implies measuring that spec
        if name.startswith("remat:") and name[len("remat:"):] not in uniform:
            uniform.append(name[len("remat:"):])
    compile_budgets = (1.0, 0.5, 0.2) if args.compile else ()
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    plan_rates = None if device == "cuda" else "cpu"  # on a GPU the planner measures it

    named = stacks.expand(a.strip() for a in args.anchors.split(",") if a.strip())
    fused = [a for a in named if a in FUSED_LOSSES]
    stack_rows = [a for a in named if a in stacks.STACKS]
    unknown = [a for a in named if a not in fused and a not in stack_rows]
    if unknown:
        raise ValueError(f"--anchors names unknown anchors {unknown}; known: "
                         f"{', '.join([*FUSED_LOSSES, *stacks.STACKS, 'stacks'])}")
    card = parse_card(args.card, device) if args.card else None
    uncapped = [n.strip() for n in args.uncapped.split(",") if n.strip()]
    if uncapped and card is None:
        raise ValueError(f"--uncapped {args.uncapped} lifts --card's cap from some rows, and no --card was given")
    options = dict(compile_plans=args.compile, compile_backend=args.compile_backend, gpu=plan_rates,
                   optimizer=args.optimizer)
    chosen = listed = strategies.strategies(budgets, uniform=uniform, compile_budgets=compile_budgets,
                                            fused_anchors=fused, stack_rows=stack_rows, **options)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [s for s in listed if s.name in wanted]
        auto_names = {"remat@auto", "remat+compile@auto"} if budgets_arg == "auto" else set()
        unknown = wanted - {s.name for s in chosen} - auto_names
        if unknown:
            raise ValueError(f"--only names unknown strategies {sorted(unknown)}; known: "
                             f"{', '.join(s.name for s in listed)}")
    unknown = set(uncapped) - {s.name for s in chosen}
    if unknown:
        raise ValueError(f"--uncapped names rows this run does not measure {sorted(unknown)}; measured: "
                         f"{', '.join(s.name for s in chosen)}")
    for budget in budgets if card is not None else ():
        if budget > card.bytes:
            print(f"remat bench: the budget {format_size(budget)} is more than the card's {format_size(card.bytes)}: "
                  "its plans may run out of memory on the card", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "bench.jsonl")
    if os.path.exists(jsonl):
        os.replace(jsonl, jsonl + ".previous")  # keep the last run's records, never append to them
    print(f"remat bench: {model}, batch {batch} x {seq}, {str(dtype).replace('torch.', '')} on "
          f"{gpu or device}{', ' + card.describe() if card else ''}; optimizer {args.optimizer}; "
          f"{len(chosen)} strategies", file=sys.stderr)
    run_options = dict(warmup=args.warmup, steps=args.steps, out_jsonl=jsonl, progress=sys.stderr,
                       optimizer=args.optimizer, card=card, uncapped_rows=uncapped)
    records = bench.run(model, batch_size=batch, seq=seq, device=device, dtype=dtype, strategy_list=chosen,
                        **run_options)
    auto_wanted = {"remat@auto", "remat+compile@auto"} & set((args.only or "").split(","))
    if budgets_arg == "auto" and (not args.only or auto_wanted):
        eager = next((r for r in records if r["strategy"] == "eager" and r.get("status") == "ok"), None)
        if eager is None:
            print("remat bench: eager did not run, so 'auto' budgets cannot be set", file=sys.stderr)
        else:
            floor = 2 * eager["static_bytes"]  # weights, and their gradients at the end of backward
            auto = [int(floor + (eager["peak_bytes"] - floor) * f) for f in AUTO_FRACTIONS]
            more = strategies.strategies(auto, uniform=(), anchors=False, **options)
            if args.only:
                more = [s for s in more if s.name.split("@")[0] + "@auto" in auto_wanted]
            records += bench.run(model, batch_size=batch, seq=seq, device=device, dtype=dtype,
                                 strategy_list=more, **run_options)
    bench.relate_all(records)
    with open(jsonl, "w") as f:  # written row by row as they ran; now with each row's ceiling
        f.writelines(json.dumps(record) + "\n" for record in records)
    table = report.markdown(records, title="remat bench")
    if device == "cpu":
        table += (f"\nCPU step times: the median and spread of {args.steps} timed steps after {args.warmup} warm-up "
                  "steps. On a CPU, and more on a shared one, they measure the machine's load as much as remat "
                  "(two runs can differ several-fold); the peaks and `loss = eager` are exact. Plain `remat bench` "
                  "without a GPU shows what a CPU proves instead.\n")
    per_budget = report.budget_table(records)
    if per_budget:
        table += "\n### At each budget\n\n" + per_budget
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(table)
    why_not = report.plot(records, os.path.join(args.out, "bench.png"))
    if args.json:
        for record in records:
            print(json.dumps(record))
        return 0
    print(table)
    print(f"records: {jsonl}\ntable:   {os.path.join(args.out, 'bench.md')}")
    print(f"plot:    {os.path.join(args.out, 'bench.png')}" if why_not is None else f"no plot: {why_not}")
    return 0


def _demo(args) -> int:
    """No GPU, no options for the measuring bench: what a CPU proves (:mod:`remat.prove.demo`)."""
    from remat.prove import demo
    print("remat bench: no CUDA GPU here, so this shows what a CPU proves (gradients, CPU peaks, and the "
          "planner's predictions for llama-1b on an H100); `remat bench --device cpu` times the CPU instead",
          file=sys.stderr)
    result = demo.run(args.out, say=lambda message: print(f"remat bench: {message}", file=sys.stderr, flush=True))
    if args.json:
        for record in result["records"]:
            print(json.dumps(record))
        return 0
    print(result["table"])
    out = args.out
    print(f"records: {os.path.join(out, 'bench.jsonl')}\ntable:   {os.path.join(out, 'bench.md')}")
    print(f"plot:    {result['plot']} (predicted frontier)" if result["plot"] else f"no plot: {result['why_no_plot']}")
    print(f"time:    {result['seconds']:.0f} s")
    failed = [r["strategy"] for r in result["records"] if r.get("grads_equal") is False]
    if failed:
        print(f"remat bench: gradients differ from the untouched model's for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _check_specs(args) -> None:
    """Every ``--uniform`` spec (and ``--only remat:<spec>``) is one remat.apply reads, checked on
    stand-in block names before any model is built."""
    from remat.planning.plans import resolve
    specs = [(f"--uniform {s}", s) for s in args.uniform.split(",") if s]
    specs += [(f"--only {n}", n[len("remat:"):]) for n in (args.only or "").split(",") if n.startswith("remat:")]
    for option, spec in specs:
        try:
            resolve(spec, [f"model.layers.{i}" for i in range(4)])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{option}: {e}") from None


def _check_counts(args) -> None:
    for option, least in (("batch", 1), ("seq", 1), ("steps", 1), ("warmup", 0)):
        value = getattr(args, option)
        if value is not None and value < least:
            raise ValueError(f"--{option} must be a whole number >= {least}, got {value}")


def _split_budgets(text: str) -> list:
    """'10,16,32GiB' -> ['10GiB', '16GiB', '32GiB']: a unit on the last applies to bare numbers."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unit = re.search(r"[A-Za-z]*$", parts[-1]).group() if parts else ""  # the suffix: '1e3GiB' -> 'GiB'
    return [p if re.search(r"[A-Za-z]$", p) else p + unit for p in parts]
