"""``remat plan``: the fastest plan that fits a memory budget, from a preset or a config file.

The model is built on the ``meta`` device (no weights, no GPU) and profiled with fake tensors at the
rates of ``--gpu`` (:mod:`remat.planner`). ``--out`` writes the plan as JSON for
``remat.apply(model, remat.Plan.load(path))``; ``--json`` prints the same JSON on stdout and nothing
else, for scripts.

A vision-language config (LLaVA, PaliGemma, Qwen2-VL, Qwen2.5-VL) plans on image + text batches built
from the config alone (``--images`` per sequence of ``--image-size``, rounded as its processor rounds
it: :func:`remat.presets.image_text_batch`); the plan covers the vision tower's blocks, the language
model's and the head; the steps that read the batch's ids run for real, and the ``real`` line says where.

``--compile`` plans for the model compiled after ``remat.apply``: each block and the head are measured
compiled (:mod:`remat.profiling._compiled`), which fake tensors cannot do, so the model is built on the
GPU with random weights at the GPU's own rates; without CUDA the command stops before building
anything. The plan then runs compiled for four steps and is solved again if it peaked over the budget
(:func:`remat.planner.verified`; not for ``--fsdp``/``--ddp``); the ``measured`` line says its peak.

Everything cheap is checked before the model is built (``--budget``, ``--batch``/``--seq``/``--fsdp``/
``--ddp``, ``--gpu``, the ``--out`` folder; a ``--seq`` past the model's position table right after
the meta build: :func:`remat.planner.position_limit`), so a typo fails at once, not after a minute of
profiling. Once a step has run two seconds each stage prints a line on stderr, and one still running
says so every few seconds (a 70B solve takes tens of seconds); a batch whose profile takes minutes is
said so before anything is built (:func:`planning_notice`). When nothing fits, the error names the
smallest budget that does, why it sits a little above that plan's peak (the solver's margins), and
which options to change. This module also holds the helpers :mod:`remat.cli.estimate` shares.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

HELP = "the fastest plan that fits a memory budget (no GPU or weights needed)"
EXAMPLES = """examples:
  remat plan --model llama-8b --batch 4 --seq 4096 --budget 40GiB
  remat plan --model llama-1b --batch 4 --seq 4096 --budget 24GiB --gpu h100 --out plan.json
  remat plan --model mistral-7b.json --batch 8 --seq 2048 --budget 70GB --optimizer adamw8bit
  remat plan --model llama-70b --batch 1 --seq 4096 --budget 70GiB --optimizer adamw --fsdp 16
  remat plan --model llama-1b --batch 2 --seq 4096 --budget 40GiB --optimizer adamw --ddp 8
  remat plan --model llama-8b --batch 1 --seq 1048576 --budget 76GiB --optimizer adamw --cp 4 --fsdp 4
  remat plan --model llama-tiny --batch 2 --seq 128 --budget 4MiB --json
  remat plan --model llama-tiny --batch 2 --seq 128 --budget 1GiB --compile   # GPU
  remat plan --model qwen2-vl-2b --batch 2 --seq 1024 --images 1 --image-size 448x448 --budget 12GiB

--model takes a preset, a Hugging Face JSON config file of any name (mistral-7b.json) or a
folder holding config.json. A vision-language config (llava, paligemma, qwen2_vl, qwen2_5_vl)
trains on --images images per sequence (default 1) of --image-size HxW, counted in --seq.
--json prints the plan on stdout in the format --out writes.
--cp N plans one of N context-parallel ranks splitting each sequence (remat.parallel): --seq is the
whole sequence, each rank holds --seq/N tokens of activations and attends over the rest (torch's
ring attention), the sequence cut head-tail so that every rank attends alike (--cp-contiguous:
contiguous pieces, the last rank's attention charged); with --fsdp M, parameters, gradients and
optimizer state are sharded over M ranks.
--compile plans for `remat.apply(model, plan); model.compile()`: it builds the model on the GPU
with random weights and measures each block compiled (needs CUDA).
--kernels liger plans with liger-kernel's fused norms, gated MLP and rotary embedding on every block
of a family it serves (Llama, Mistral, Qwen2/3, Gemma/Gemma-2), stood in for on fake tensors here, and
its fused linear cross-entropy among the heads; `remat.apply(model, plan)` installs them per block
(pip install remat[kernels]). --kernels both profiles each block class both ways and keeps the faster.
"""

PROGRESS_AFTER_S = 2.0  # quiet for quick runs; a line per stage once a run takes longer
HEARTBEAT_S = 5.0
STAGE_HEARTBEAT_S = 15.0  # a profiling stage still running says so this often

LONG_PLAN_CHUNKS = 6000
"""Chunks of the chunked head's profile (a fake-tensor run per chunk, at every chunk size the head is
profiled at) from which ``remat plan`` says before it starts that planning will take minutes."""
SECONDS_PER_CHUNK = 0.01
"""What one such chunk took on a 2-core CPU (llama-tiny at 1M and 10M tokens): the estimate's rate."""
EXPAND_IDS_FROM = 2 ** 22
"""Tokens a step from which the batch of zeros is one id expanded (8 bytes, not 8 a token): a
fake-tensor profile keeps no values of a batch this long anyway."""


def add_model_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help="a preset (llama-tiny, llama-1b, llama-8b, ...), a JSON config file or a folder "
                             "holding config.json")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--gpu", default="h100", help="rates to plan for: h100, h200, a100 (default h100)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="model dtype")
    parser.add_argument("--optimizer", default="none",
                        choices=("none", "adamw", "adamw-fused", "adamw-forloop", "adamw8bit"),
                        help="optimizer state and step to count: adamw is torch.optim.AdamW's default (foreach), "
                             "adamw-fused AdamW(fused=True), the Trainer's default (default none: forward+backward, "
                             "as remat bench)")
    parser.add_argument("--no-offload", action="store_true", help="plan without offload treatments")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="pinned host memory offloaded tensors may take on the machine that trains, e.g. "
                             "100GiB (default: no limit; the plan prints how much it pins)")
    parser.add_argument("--fsdp", type=int, default=1, metavar="WORLD",
                        help="plan for one of WORLD FSDP2 ranks sharing the model (default 1: no sharding)")


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--budget", required=True,
                        help="peak memory budget of one device, e.g. 24GiB or 80GB (at most 64 TiB)")
    parser.add_argument("--cp", type=int, default=1, metavar="WORLD",
                        help="plan for one of WORLD context-parallel ranks splitting each --seq-token sequence "
                             "(default 1); combine with --fsdp for a cp x fsdp mesh")
    parser.add_argument("--cp-contiguous", action="store_true",
                        help="with --cp: the sequence cut into contiguous pieces (shard_sequence(balance=False)) "
                             "instead of head-tail chunks")
    parser.add_argument("--ddp", type=int, default=1, metavar="WORLD",
                        help="plan for one of WORLD DDP ranks, each holding the whole model "
                             "(default 1; not with --fsdp)")
    parser.add_argument("--kernels", default=None, choices=("stock", "liger", "both"),
                        help="liger: run the blocks' norms, gated MLP and rotary embedding with liger-kernel's fused "
                             "kernels (and Liger's fused loss among the heads); both: profile both ways, the faster "
                             "chosen per block class; default: the model's modules (pip install remat[kernels])")
    parser.add_argument("--out", help="write the plan as JSON here")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON on stdout (the --out format) and nothing else")
    parser.add_argument("--phases", action="store_true", help="also print every phase of the step (timeline)")
    add_image_arguments(parser)
    parser.add_argument("--compile", nargs="?", const="model", choices=("model", "blocks"),
                        help="plan for the model compiled after remat.apply: 'model' (the default; model.compile()) "
                             "or 'blocks' (block.compile() on each block, the rest eager, as FSDP2 trains "
                             "compiled): measured compiled on this machine's GPU with random weights, no offload, "
                             "and the plan run compiled before it is printed (needs CUDA; --gpu is not used)")


def add_image_arguments(parser) -> None:
    parser.add_argument("--images", type=int, default=None, metavar="N",
                        help="vision-language models: images per sequence (default 1), their tokens counted in --seq")
    parser.add_argument("--image-size", default=None, metavar="HxW",
                        help="vision-language models: image height x width in pixels, e.g. 448x448 (default: the "
                             "vision tower's size; Qwen2-VL 448x448, rounded as its processor rounds)")


def image_size_of(text):
    """``--image-size`` as ``(height, width)``: ``448x448``, or ``448`` for a square; None stays None."""
    if text is None:
        return None
    parts = text.lower().replace("*", "x").split("x")
    try:
        size = tuple(int(p) for p in parts)
    except ValueError:
        size = ()
    if len(size) == 1:
        size = size * 2
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"--image-size must be HEIGHTxWIDTH in pixels, e.g. 448x448 (or 448 for a square), "
                         f"got {text!r}")
    return size


def check_image_arguments(args, config) -> None:
    """``--images`` and ``--image-size`` fit the model: a text model takes neither, a vision-language
    model at least one image of a size its tower takes (ValueError naming the option)."""
    from remat.presets import check_images_fit, is_vision_language
    images, size = getattr(args, "images", None), image_size_of(getattr(args, "image_size", None))
    if not is_vision_language(config):
        if images is not None or size is not None:
            given = "--images" if images is not None else "--image-size"
            raise ValueError(f"{given} is for vision-language models; {args.model} is a "
                             f"{type(config).__name__} (text only): leave it out")
        return
    check_images_fit(config, images=1 if images is None else images, seq=args.seq, image_size=size)


def check_model_arguments(args) -> None:
    """Refuse bad numbers before anything slow runs; ValueError says which option and what to pass."""
    from remat.planning.costs import rates_for
    for option in ("batch", "seq", "fsdp"):
        value = getattr(args, option)
        if value < 1:
            raise ValueError(f"--{option} must be a whole number >= 1, got {value}"
                             + ("; leave --fsdp out (or pass 1) to plan without sharding" if option == "fsdp" else ""))
    ddp = getattr(args, "ddp", 1)
    if ddp < 1:
        raise ValueError(f"--ddp must be a whole number >= 1, got {ddp}; leave --ddp out (or pass 1) to plan "
                         "without DDP")
    if ddp != 1 and args.fsdp != 1:
        raise ValueError(f"--fsdp {args.fsdp} and --ddp {ddp}: a model is either sharded (FSDP2) or replicated (DDP) "
                         "over its ranks, not both; pass one of them")
    cp = getattr(args, "cp", 1)
    if cp < 1:
        raise ValueError(f"--cp must be a whole number >= 1, got {cp}; leave --cp out (or pass 1) to plan without "
                         "context parallelism")
    if cp != 1 and ddp != 1:
        raise ValueError(f"--cp {cp} with --ddp {ddp} is not modelled: shard the model with --fsdp instead")
    chunks = cp if getattr(args, "cp_contiguous", False) else 2 * cp
    if cp != 1 and args.seq % chunks:
        how = "" if chunks == cp else f" as a head and a tail chunk each (--cp-contiguous: a multiple of {cp})"
        raise ValueError(f"--seq {args.seq} cannot be split evenly over --cp {cp} ranks{how}: pass a multiple of "
                         f"{chunks} (e.g. {-(-args.seq // chunks) * chunks})")
    if cp != 1 and getattr(args, "compile", None):
        raise ValueError("--cp with --compile is not planned: context parallelism runs eager (drop --compile)")
    rates_for(args.gpu)  # ValueError naming the known GPUs


def progress(stream=None, after_s: float = PROGRESS_AFTER_S):
    """The ``say`` callback: a stderr line per stage once the command has run ``after_s``."""
    from remat.profiling.profiler import progress_printer
    return progress_printer(stream, after_s=after_s)


def planning_notice(args):
    """The line that says, before anything is built, that profiling ``args``' batch takes minutes
    (None when it takes less): the chunked head runs once per chunk of tokens at each of its chunk
    sizes (:data:`remat.planning.costs.CHUNK_CANDIDATES`), :data:`SECONDS_PER_CHUNK` each."""
    from remat.planning.costs import CHUNK_CANDIDATES
    tokens = args.batch * args.seq // max(1, getattr(args, "cp", 1))
    sizes = [c for c in CHUNK_CANDIDATES if c < tokens]
    chunks = sum(-(-tokens // c) for c in sizes)
    if chunks < LONG_PLAN_CHUNKS:
        return None
    minutes = chunks * SECONDS_PER_CHUNK / 60
    took = f"about {minutes:,.0f} minutes" if minutes < 120 else f"about {minutes / 60:,.0f} hours"
    fast = int(LONG_PLAN_CHUNKS / sum(1 / c for c in sizes))
    return (f"{tokens:,} tokens a step: the chunked head is profiled one chunk at a time, {chunks:,} chunks at "
            f"{len(sizes)} chunk sizes, {took} on a 2-core CPU; each stage is printed as it starts and again "
            f"every {STAGE_HEARTBEAT_S:.0f} s while it runs (Ctrl-C stops it). Under {fast:,} tokens a step plans "
            "in about a minute or less")


@contextmanager
def heartbeat(say, every_s: float = STAGE_HEARTBEAT_S):
    """``say``, wrapped: while the block runs, a stage that has said nothing for ``every_s`` seconds
    is said again with how long it has run (``still profiling ... after 45 s``), so a long profile
    never looks hung."""
    lock, stop = threading.Lock(), threading.Event()
    stage = {"message": None, "started": 0.0, "said": 0.0}

    def wrapped(message):
        with lock:
            now = time.perf_counter()
            stage.update(message=message, started=now, said=now)
        say(message)

    def beat():
        while not stop.wait(min(every_s, 1.0)):
            with lock:
                now = time.perf_counter()
                if stage["message"] is None or now - stage["said"] < every_s:
                    continue
                stage["said"] = now
                line = f"still {stage['message']} after {now - stage['started']:.0f} s"
            say(line)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield wrapped
    finally:
        stop.set()
        thread.join()


def check_length(args, model) -> None:
    """``--seq`` fits the model's position table (:func:`remat.planner.position_limit`; a rotary or
    ALiBi model has none): a ValueError naming the table and the longest ``--seq`` otherwise."""
    from remat.planner import position_limit
    limit = position_limit(model)
    if limit is not None and args.seq > limit[0]:
        positions, where = limit
        raise ValueError(f"--seq {args.seq:,} is longer than the {positions:,} positions {args.model} has ({where}): "
                         f"a training step would fail in its position embedding. Pass --seq {positions} or less, or a "
                         "config with a larger position table")


@contextmanager
def working(say, message: str, every_s: float = HEARTBEAT_S):
    """Say ``message``, then that its first word (``solving``) is still running every ``every_s``
    seconds until the block ends."""
    say(message)
    stop, start, doing = threading.Event(), time.perf_counter(), message.split()[0]

    def beat():
        while not stop.wait(every_s):
            say(f"still {doing} after {time.perf_counter() - start:.0f} s")
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def check_compile(args) -> None:
    """``--compile`` needs CUDA: say so before the model is built (a ValueError, the CLI's one line)."""
    if not getattr(args, "compile", False):
        return
    import torch
    if not torch.cuda.is_available():
        raise ValueError("--compile measures the compiled blocks on a GPU; this machine has no CUDA device. Drop "
                         "--compile for an eager plan (made on the meta device at --gpu's rates; compile usually "
                         "lowers memory, so an eager plan is conservative in memory), or run remat plan --compile "
                         "on the GPU that trains")


def profile_from_args(args, say):
    """Build the model on the meta device and profile it, telling ``say`` each stage; with
    ``--compile``, build it on the GPU with random weights and profile it compiled. Returns
    ``(profile, model, ids)``: the model and batch it measured, which a compiled plan is measured on."""
    import torch

    from remat.planning.kernels import kernel_choices, with_kernels
    from remat.presets import build_model, load_config
    from remat.profiling.profiler import profile
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    kernels = {"both": ("stock", "liger")}.get(getattr(args, "kernels", None), getattr(args, "kernels", None))
    config = load_config(args.model)
    check_image_arguments(args, config)
    if getattr(args, "compile", False):
        say(f"building {args.model} on {torch.cuda.get_device_name()} with random weights")
        model = build_model(config, device="cuda", dtype=dtype)
        ids = batch_from_args(args, config, dtype, random=True)
        device = next(model.parameters()).device
        ids = {k: v.to(device) for k, v in ids.items()} if isinstance(ids, dict) else ids.to(device)
        prof = profile(model, ids, optimizer=args.optimizer, progress=say, compile=args.compile, kernels=kernels)
    else:
        say(f"building {args.model} on the meta device")
        model = build_model(config, device="meta", dtype=dtype)
        check_length(args, model)
        ids = batch_from_args(args, config, dtype)
        cp = getattr(args, "cp", 1)
        if cp != 1:
            from remat.planner import cp_piece
            say(f"profiling one of {cp} context-parallel ranks: {args.seq // cp} of the {args.seq} tokens")
            ids = cp_piece(model, ids, cp, balance=not getattr(args, "cp_contiguous", False))
        with heartbeat(say) as beating:
            prof = profile(model, ids, gpu=args.gpu, optimizer=args.optimizer, progress=beating, kernels=kernels)
    candidates = [finish_profile(args, model, with_kernels(prof, choice), say) for choice in kernel_choices(prof)]
    if len(candidates) > 1:
        from remat.planner import fastest_kernels
        from remat.units import parse_budget
        say("choosing the kernels per block class")
        return fastest_kernels(candidates, parse_budget(args.budget)), model, ids
    return candidates[0], model, ids


def finish_profile(args, model, prof, say):
    """``prof`` as the command plans it: context-parallel, host limit, FSDP or DDP ranks as ``args`` say."""
    cp = getattr(args, "cp", 1)
    if cp != 1 and not getattr(args, "compile", False):
        from remat.planner import attention_shape
        from remat.planning.context import context
        prof = context(prof, cp, attention_shape(model), balance=not getattr(args, "cp_contiguous", False))
    host = getattr(args, "host_memory", None)
    if host is not None or prof.device == "cuda":
        from dataclasses import replace

        from remat.planner import default_host_limit
        from remat.units import parse_budget
        prof = replace(prof, host_limit=parse_budget(host) if host is not None else default_host_limit())
    if args.fsdp != 1:
        from remat.planning.sharding import shard
        from remat.profiling.profiler import block_param_bytes
        say(f"sharding for {args.fsdp} FSDP ranks")
        prof = shard(prof, args.fsdp, block_param_bytes(model, prof))
    if getattr(args, "ddp", 1) != 1:
        from remat.planner import replicated
        say(f"replicating for {args.ddp} DDP ranks")
        prof = replicated(prof, model, args.ddp)
    return prof


def batch_from_args(args, config, dtype, random=False):
    """The batch a plan is made for: token ids (``random``: drawn, for a real model; else zeros), or a
    vision-language model's image + text batch (:func:`remat.presets.image_text_batch`)."""
    import torch

    from remat.presets import image_text_batch, is_vision_language
    if is_vision_language(config):
        return image_text_batch(config, batch=args.batch, seq=args.seq, images=getattr(args, "images", None) or 1,
                                image_size=image_size_of(getattr(args, "image_size", None)), dtype=dtype)
    if random:
        return torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if args.batch * args.seq >= EXPAND_IDS_FROM:
        return torch.zeros(1, 1, dtype=torch.long).expand(args.batch, args.seq)
    return torch.zeros(args.batch, args.seq, dtype=torch.long)


def images_line(args, config) -> str:
    """What a vision-language plan's batch holds, in words (empty for a text model)."""
    from remat.presets import image_geometry, is_vision_language
    if not is_vision_language(config):
        return ""
    images = getattr(args, "images", None) or 1
    (height, width), tokens = image_geometry(config, image_size_of(getattr(args, "image_size", None)))
    return (f"{images} per sequence, {height}x{width} pixels, {tokens} image tokens each "
            f"({images * tokens} of the {args.seq} tokens)")


def treatments_from_args(prof, args):
    from remat.planner import allowed_treatments
    allowed = allowed_treatments(prof, None)
    if args.no_offload:
        allowed = [t for t in allowed if "offload" not in t]
    return allowed


def solve_from_args(prof, budget, treatments, say, measured_on=None):
    """:func:`remat.planner.solve_profiled` (as ``remat.plan`` solves: a compiled profile within its
    margin, its plan marked compiled), with a heartbeat on stderr while it runs. ``measured_on``:
    ``(model, ids)`` a compiled plan is measured on before it is returned, as ``remat.plan``
    measures it (:func:`remat.planner.verified`); None for plans one GPU does not run (FSDP, DDP)."""
    from remat.planner import solve_profiled, verified
    from remat.units import format_size
    with working(say, f"solving for {format_size(budget)}: {len(prof.block_names)} blocks, "
                      f"{len(treatments)} treatments, {len(prof.heads)} head options"):
        if measured_on is None or not prof.notes.get("compile"):
            return solve_profiled(prof, budget, treatments=treatments)
    model, ids = measured_on
    return verified(model, ids, prof, budget, treatments=treatments, progress=say)


def measured_line(verified) -> str:
    """A compiled plan's ``notes["verified"]`` in words: its measured peak and step, and the plans
    measured over the budget before it, or why it was not measured."""
    from remat.units import format_size as f
    if isinstance(verified, str):
        return verified
    before = [f"{t['plan']} peaked {f(t['peak_bytes'])}" for t in verified["tries"][:-1]]
    return (f"peak {f(verified['peak_bytes'])}, step {verified['step_s']:.3f} s, measured compiled on this GPU"
            + (f" (over the budget before it: {'; '.join(before)})" if before else ""))


def no_fit_message(error, budget, args) -> str:
    """The CLI's words for :class:`~remat.planning.solver.NoPlanFits`: the smallest budget that
    fits, why it is above that plan's predicted peak, and the options that would help."""
    from remat.planning.plans import OFFLOADING_TREATMENTS
    from remat.planning.solver import OFFLOAD_MARGIN
    from remat.units import format_size as f
    if error.host_limited:  # the GPU budget would do: the host's pinned memory is what stops it
        # only --host-memory limits the host here (without it a plan on the meta device has no host limit,
        # and a --compile plan never offloads): the API's words for its own default do not apply
        text, _, rest = str(error).partition(" Give offload more host memory (")
        after = rest.find(", raise the GPU budget")
        if after < 0:
            return str(error)
        return (text + f" Give offload more host memory (a larger --host-memory than {args.host_memory}, or none: "
                "without it remat plan sets no host limit and prints what the plan pins)" + rest[after:])
    plan, smallest = error.plan, error.smallest_peak
    peak = plan.notes["predicted_peak_bytes"]
    text = (f"no plan fits {f(budget)}. The smallest budget that fits is {f(smallest)}, with the plan "
            f"{plan.summary()} (predicted peak {f(peak)}, set in {plan.notes.get('peak_at')}).")
    if smallest > peak:
        offloads = any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values())
        why = (f"keeps {OFFLOAD_MARGIN:.0%} of the budget free for plans that offload, in case copies run late"
               if offloads else "rounds each block's memory up to a small step of the budget while it searches")
        text += f" The budget is above the peak because the solver {why}."
    fixes = [f"raise --budget to at least {f(smallest)}", "lower --batch or --seq"]
    if args.optimizer == "adamw":
        fixes.append("count 8-bit optimizer state (--optimizer adamw8bit)")
    if args.fsdp == 1:
        fixes.append("shard the model over ranks (--fsdp WORLD)")
    if getattr(args, "cp", 1) == 1 and getattr(args, "ddp", 1) == 1:
        fixes.append("split each sequence over ranks (--cp WORLD)")
    return text + " To fit: " + ", ".join(fixes) + "."


def kernel_lines(plan) -> list:
    """What the plan's kernels are, where it has any, and the blocks Liger's kernels do not serve."""
    lines = []
    if plan.kernels is not None or plan.head == "liger":
        liger = sum(plan.kernel_of(name) == "liger" for name in plan.blocks)
        lines.append(f"kernels    Liger's fused norms, gated MLP and rotary embedding on {liger} of {len(plan.blocks)} "
                     "blocks" + ("; head: Liger's fused linear cross-entropy" if plan.head == "liger" else ""))
    stock = plan.notes.get("kernels_stock") or {}
    if stock:
        first = next(iter(stock))
        lines.append(f"stock      {len(stock)} blocks keep stock modules ({first}: {stock[first]})")
    if plan.notes.get("kernels"):
        lines.append(f"kernels    {plan.notes['kernels']}")
    return lines


def check_out_path(path) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--out {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist; "
                         "create it or write the plan elsewhere")


def describe(plan) -> str:
    """Blocks grouped into runs of one treatment: ``0-7 full, 8-15 keep``; a tiled one with its
    chunk where the plan names it: ``0-13 full+tiled(8192), 14-15 full+tiled(2048)``."""
    runs, names = [], list(plan.blocks)
    for i, name in enumerate(names):
        t = plan.blocks[name]
        if plan.tile_of(name) is not None:
            t = f"{t}({plan.tile_of(name)})"
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
    per = " per GPU" if prof.comm is not None or prof.notes.get("cp_world") else ""
    lines.append(f"step       {sim.step_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s{per} (predicted, head {head}"
                 + (f"; the optimizer's step {_seconds(sim.optimizer_s)} included" if sim.optimizer_s else "") + ")")
    if prof.notes.get("cp_world"):
        n = prof.notes
        who = "each rank (head-tail chunks)" if n.get("cp_balance", False) else "the last rank (contiguous pieces)"
        lines.append(f"context    {n['cp_world']} ranks split each {n['cp_seq']:,}-token sequence: {prof.seq:,} tokens "
                     f"of activations a rank; {who} attends {_seconds(n['cp_attention_s'])} beyond its share "
                     f"and waits {_seconds(n['cp_exposed_s'])} for keys and values ({f(n['cp_exchange_bytes'])} over "
                     "its link a step, recompute not counted)")
    stages = sim.stages()
    parts = []
    for name, st in stages.items():
        wait = f", {st['wait_s']:.3f} s waiting for copies" if st["wait_s"] > 5e-4 else ""
        parts.append(f"{name} {st['seconds']:.3f} s (peak {f(st['peak_bytes'])}{wait})")
    if sim.comm_s:  # FSDP2/DDP: time the GPU waited for collectives, already inside the stages above
        parts.append(f"exposed communication {sim.exposed_comm_s:.3f} s (of {sim.comm_s:.3f} s of collectives, "
                     "the rest hidden behind compute)")
        overhead = sim.comm_copy_s + sim.comm_launch_s + sim.comm_contention_s
        if overhead:  # also inside the stages: what the collectives cost the compute stream
            parts.append(f"collective overheads {overhead:.3f} s (copies {sim.comm_copy_s:.3f}, launches "
                         f"{sim.comm_launch_s:.3f}, compute slowed beside the link {sim.comm_contention_s:.3f})")
    lines.append("stages     " + "; ".join(parts))
    if sim.offload_bytes:
        lines.append(f"offload    {f(sim.offload_bytes)} handed to the engine, {f(sim.moved_bytes)} moved each way, "
                     f"{sim.exposed_copy_s:.3f} s of the step spent waiting for copies")
    return lines


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.01 else f"{x * 1e3:.2f} ms"


def timeline_lines(sim) -> list:
    from remat.units import format_size as f
    lines = [f"{'phase':<72} {'start s':>8} {'dur ms':>7} {'peak':>11} {'engine':>10}"]
    for p in sim.timeline:
        lines.append(f"{p.name[:72]:<72} {p.start_s:8.4f} {1e3 * (p.end_s - p.start_s):7.2f} "
                     f"{f(p.peak_bytes):>11} {f(p.engine_bytes) if p.engine_bytes else '':>10}")
    return lines


def run(args) -> int:
    import json

    from remat.planning.solver import NoPlanFits
    from remat.units import format_size, parse_budget
    budget = parse_budget(args.budget)
    check_model_arguments(args)
    check_out_path(args.out)
    check_compile(args)
    notice = None if getattr(args, "compile", None) else planning_notice(args)
    if notice:
        print(f"remat plan: {notice}", file=sys.stderr, flush=True)
    say = progress(after_s=0.0 if notice else PROGRESS_AFTER_S)
    prof, model, ids = profile_from_args(args, say)
    treatments = treatments_from_args(prof, args)
    one_gpu = args.fsdp == 1 and getattr(args, "ddp", 1) == 1 and getattr(args, "cp", 1) == 1
    try:
        plan = solve_from_args(prof, budget, treatments, say, measured_on=(model, ids) if one_gpu else None)
    except NoPlanFits as e:
        raise ValueError(no_fit_message(e, budget, args)) from None
    if args.out:
        plan.save(args.out)
        print(f"written    {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, sort_keys=True))
        return 0
    from remat.planning.simulator import simulate
    with working(say, "simulating the plan"):
        sim = simulate(prof, plan)
    source = "measured" if prof.rates.measured else "roofline estimate"
    print(f"model      {args.model}  batch {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"optimizer {args.optimizer}, rates {prof.rates.name} ({source})")
    if plan.notes.get("compile"):
        then = ("block.compile() on each block (before fully_shard under FSDP2)"
                if plan.notes.get("compile_scope") == "blocks" else "model.compile()")
        print(f"compiled   planned for compiled execution: remat.apply(model, plan), then {then} "
              "(costs measured compiled; run otherwise, its peak and time are not these)")
    images = images_line(args, model.config)
    if images:
        print(f"images     {images}")
    print(f"plan       {plan.summary()}")
    print(f"blocks     {describe(plan)}")
    for line in kernel_lines(plan):
        print(line)
    if plan.notes.get("ran_for_real"):
        print(f"real       {plan.notes['ran_for_real']}")
    if plan.notes.get("verified") is not None:
        print(f"measured   {measured_line(plan.notes['verified'])}")
    print(f"static     {format_size(prof.static_bytes)}")
    for line in explain(prof, sim, budget):
        print(line)
    if plan.notes.get("allocator_reserve_bytes"):
        print(f"card       runs on a card of {format_size(plan.notes['card_bytes'])} or more: the peak plus "
              f"{format_size(plan.notes['allocator_reserve_bytes'])} kept for the caching allocator "
              f"({plan.notes['allocator']})")
    if plan.notes.get("host_bytes"):
        limit = plan.notes.get("host_limit")
        print(f"host       {format_size(plan.notes['host_bytes'])} of pinned host memory for the offloaded tensors "
              + (f"(limit {format_size(limit)})" if limit else
                 "(no limit given: the machine that trains must pin this much; --host-memory to plan within it)"))
    if args.phases:
        for line in timeline_lines(sim):
            print(line)
    return 0
