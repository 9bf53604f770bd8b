"""``remat plan``: the fastest plan that fits a memory budget, from a preset or config.json.

The model is built on the ``meta`` device (no weights, no GPU) and profiled with fake
tensors at the rates of ``--gpu``; see :mod:`remat.planner`. ``--out`` writes the plan as
JSON for ``remat.apply(model, remat.Plan.load(path))``.
"""
from __future__ import annotations

import sys

HELP = "the fastest plan that fits a memory budget (no GPU or weights needed)"
EXAMPLES = """examples:
  remat plan --model llama-8b --batch 4 --seq 4096 --budget 40GiB
  remat plan --model llama-1b --batch 4 --seq 4096 --budget 24GiB --gpu h100 --out plan.json
  remat plan --model path/to/config.json --batch 8 --seq 2048 --budget 70GB --optimizer adamw
  remat plan --model llama-70b --batch 1 --seq 4096 --budget 70GiB --optimizer adamw --fsdp 8
"""


def add_model_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a preset (llama-1b, llama-8b, ...) or a config.json path")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--gpu", default="h100", help="rates to plan for: h100, h200, a100 (default h100)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="model dtype")
    parser.add_argument("--optimizer", default="none", choices=("none", "adamw", "adamw8bit"),
                        help="optimizer state to count (default none: forward+backward, as remat bench)")
    parser.add_argument("--no-offload", action="store_true", help="plan without offload treatments")
    parser.add_argument("--fsdp", type=int, default=1, metavar="WORLD",
                        help="plan for one of WORLD FSDP2 ranks sharing the model (default 1: no sharding)")


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--budget", required=True, help="peak memory budget, e.g. 24GiB or 80GB")
    parser.add_argument("--out", help="write the plan as JSON here")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--phases", action="store_true", help="also print every phase of the step (timeline)")


def profile_from_args(args):
    """Build the model on the meta device and profile it; progress on stderr after ~2 s."""
    import torch

    from remat.integrations.presets import build_model, load_config
    from remat.profiling.profiler import profile, progress_printer
    if args.batch < 1 or args.seq < 1:
        raise ValueError(f"--batch and --seq must be at least 1, got {args.batch} and {args.seq}")
    say = progress_printer()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = load_config(args.model)
    say(f"building {args.model} on the meta device")
    model = build_model(config, device="meta", dtype=dtype)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    prof = profile(model, ids, gpu=args.gpu, optimizer=args.optimizer, progress=say)
    if args.fsdp != 1:
        from remat.planning.sharding import block_param_bytes, shard
        prof = shard(prof, args.fsdp, block_param_bytes(model, prof))
    return prof


def treatments_from_args(prof, args):
    from remat.planner import _allowed
    allowed = _allowed(prof, None)
    if args.no_offload:
        allowed = [t for t in allowed if "offload" not in t]
    return allowed


def describe(plan) -> str:
    """Blocks grouped into runs of one treatment: ``0-7 full, 8-15 keep``."""
    runs, names = [], list(plan.blocks)
    for i, name in enumerate(names):
        t = plan.blocks[name]
        if runs and runs[-1][2] == t:
            runs[-1][1] = i
        else:
            runs.append([i, i, t])
    return ", ".join(f"{a}-{b} {t}" if a != b else f"{a} {t}" for a, b, t in runs)


def explain(prof, sim, budget=None) -> list:
    """Lines that say what sets the peak, what it is made of, and where the step's time goes."""
    from remat.units import format_size as f
    terms = sim.peak_terms()
    lines = []
    head = f"{sim.head}" + (f"({sim.chunk_tokens} tokens a chunk)" if sim.head == "chunked" else "")
    budget_text = f" of {f(budget)} budget" if budget else ""
    lines.append(f"peak       {f(sim.peak_bytes)}{budget_text}, set in {sim.peak_at}")
    lines.append(f"           = static {f(terms['static'])} (params, buffers, optimizer state)"
                 f" + carried {f(terms['carried'])} (what earlier phases keep)"
                 f" + the phase's own {f(terms['phase'])}"
                 + (f" + offload engine {f(terms['engine'])}" if terms["engine"] else ""))
    if sim.bound_bytes != sim.peak_bytes:
        lines.append(f"           at most {f(sim.bound_bytes)} whatever the copy timing (set in {sim.bound_at})")
    lines.append(f"step       {sim.step_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s (predicted, head {head})")
    stages = sim.stages()
    parts = []
    for name, st in stages.items():
        wait = f", {st['wait_s']:.3f} s waiting for copies" if st["wait_s"] > 5e-4 else ""
        parts.append(f"{name} {st['seconds']:.3f} s (peak {f(st['peak_bytes'])}{wait})")
    lines.append("stages     " + "; ".join(parts))
    if sim.offload_bytes:
        lines.append(f"offload    {f(sim.offload_bytes)} handed to the engine, {f(sim.moved_bytes)} moved each way, "
                     f"{sim.exposed_copy_s:.3f} s of the step spent waiting for copies")
    return lines


def timeline_lines(sim) -> list:
    from remat.units import format_size as f
    lines = [f"{'phase':<72} {'start s':>8} {'dur ms':>7} {'peak':>11} {'engine':>10}"]
    for p in sim.timeline:
        lines.append(f"{p.name[:72]:<72} {p.start_s:8.4f} {1e3 * (p.end_s - p.start_s):7.2f} "
                     f"{f(p.peak_bytes):>11} {f(p.engine_bytes) if p.engine_bytes else '':>10}")
    return lines


def run(args) -> int:
    import json

    from remat.planning.simulator import simulate
    from remat.planning.solver import solve
    from remat.units import format_size, parse_size
    budget = parse_size(args.budget)
    prof = profile_from_args(args)
    plan = solve(prof, budget, treatments=treatments_from_args(prof, args))
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, sort_keys=True))
        return 0
    sim = simulate(prof, plan)
    source = "measured" if prof.rates.measured else "roofline estimate"
    print(f"model      {args.model}  batch {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"optimizer {args.optimizer}, rates {prof.rates.name} ({source})")
    print(f"plan       {plan.summary()}")
    print(f"blocks     {describe(plan)}")
    print(f"static     {format_size(prof.static_bytes)}")
    for line in explain(prof, sim, budget):
        print(line)
    if args.phases:
        for line in timeline_lines(sim):
            print(line)
    if args.out:
        print(f"written    {args.out}", file=sys.stderr)
    return 0
