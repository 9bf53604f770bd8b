"""``remat doctor``: the problems of a training setup, worst first, for a preset or a config file.

The model is built on the ``meta`` device (no weights, no GPU), as ``remat plan`` builds it,
optionally with a saved remat plan applied (``--plan``; applied even when it was made for another
model, which is then reported), with Hugging Face checkpointing on (``--hf-checkpointing``, with
``--reentrant`` / ``--no-preserve-rng`` for its keywords) or to be trained by a
``RematCallback(budget=--budget)`` (``--callback``), and :func:`remat.diagnosis.doctor`
looks at it. With ``--budget`` remat profiles the model at ``--batch`` x ``--seq`` (as ``remat
estimate`` does: the same peak to the byte) and says whether the setup fits -- "does not fit:
predicted X > budget Y" is an error, with the plan that fits or the floor -- and, when it fits,
whether its checkpointing is needed at all or another plan fits faster. ``--compile`` says that training compiles the model after
``remat.apply`` (the meta model here is never compiled): a plan made for compile on a model
that runs eagerly, or the reverse, is reported. A meta model runs no real step, so the checks
that need one (parameters without gradients, measured against predicted) are for the Python API, or
``--verify``: the model is then built with random weights on this machine's GPU (else its CPU), and
after the findings :func:`remat.verify` runs the setup (``--plan`` or ``--hf-checkpointing``) against
the untouched model on one random batch and prints its table; gradients beyond rounding are an error.

The setups users switch on with one flag are read as they are (``setup-vs-plan``: the setup's
predicted peak and step beside remat's plan at ``--budget``): ``--every-n-layers N`` and
``--hf-offload`` (transformers' ``activation_checkpointing_kwargs={"every_n_layers": N, "offload": True}``,
with ``--hf-checkpointing``), ``--fsdp-checkpointing`` / ``--fsdp-checkpointing-offload`` (accelerate's
FSDP2 ``fsdp_activation_checkpointing`` and its offload), ``--liger`` (``use_liger_kernel=True``).

Exit status: 0 when nothing or only warnings and notes were found, 1 when an error was, 2 for a
usage mistake (as every command).
"""
from __future__ import annotations

HELP = "the problems of a training setup (checkpointing, budget, plan), worst first"
EXAMPLES = """examples:
  remat doctor --model llama-tiny
  remat doctor --model llama-1b --batch 4 --seq 4096 --budget 60GiB --hf-checkpointing
  remat doctor --model llama-tiny --batch 2 --seq 128 --budget 8MiB     # the model as it is: does it fit?
  remat doctor --model llama-tiny --batch 2 --seq 128 --budget 4MiB --callback   # the plan RematCallback makes
  remat doctor --model llama-8b --batch 2 --seq 4096 --budget 40GiB --plan plan.json
  remat doctor --model llama-8b --plan plan.json --compile
  remat doctor --model llama-1b --batch 4 --seq 4096 --budget 48GiB --hf-checkpointing --every-n-layers 2
  remat doctor --model llama-1b --batch 4 --seq 4096 --budget 30GiB --hf-checkpointing --hf-offload
  remat doctor --model llama-1b --batch 4 --seq 4096 --budget 30GiB --fsdp-checkpointing-offload
  remat doctor --model llama-1b --batch 4 --seq 4096 --budget 16GiB --liger --hf-checkpointing
  remat doctor --model llama-tiny --batch 2 --seq 128 --dtype fp32 --hf-checkpointing --verify --dropout 0.1

A setup over its budget is an error (exit status 1) with the plan that fits or the floor: for
--model llama-1b --batch 4 --seq 4096 --budget 20GiB, "[error] does not fit: predicted 53.06 GiB >
budget 20.00 GiB for the model as it is", and the plan that fits 20 GiB.

In a script (a real step, TrainingArguments and an accelerate config too):
  from remat.diagnosis import doctor
  for finding in doctor(model, batch, training_args=args, budget="40GiB"): print(finding)
"""


def add_arguments(parser) -> None:
    from remat.cli.plan import add_model_arguments
    add_model_arguments(parser)
    parser.set_defaults(batch=1, seq=512)
    parser.add_argument("--budget", help="peak memory budget of one device, e.g. 24GiB (enables the plan checks)")
    parser.add_argument("--plan", help="a remat plan (JSON, from `remat plan --out`) applied to the model")
    parser.add_argument("--compile", action="store_true",
                        help="training compiles the model after remat.apply (model.compile()): checks --plan was "
                             "made for that (remat plan --compile)")
    parser.add_argument("--hf-checkpointing", action="store_true",
                        help="Hugging Face checkpointing on (what activation_checkpointing=True does; "
                             "gradient_checkpointing=True in transformers 4)")
    parser.add_argument("--callback", action="store_true",
                        help="the model trains with RematCallback(budget=--budget): checks the plan it will make")
    parser.add_argument("--reentrant", action="store_true", help="with --hf-checkpointing: use_reentrant=True")
    parser.add_argument("--no-preserve-rng", action="store_true",
                        help="with --hf-checkpointing: preserve_rng_state=False")
    parser.add_argument("--every-n-layers", type=int, default=None, metavar="N",
                        help="with --hf-checkpointing: checkpoint every N-th layer (transformers >= 5.16)")
    parser.add_argument("--hf-offload", action="store_true",
                        help="with --hf-checkpointing: offload=True, the checkpoints' inputs held in pinned host "
                             "memory (transformers >= 5.16)")
    parser.add_argument("--fsdp-checkpointing", action="store_true",
                        help="accelerate's FSDP2 activation checkpointing (fsdp_activation_checkpointing: true)")
    parser.add_argument("--fsdp-checkpointing-offload", action="store_true",
                        help="... with its offload of each checkpointed layer's input "
                             "(fsdp_activation_checkpointing_offload: true, accelerate >= 1.15)")
    parser.add_argument("--liger", action="store_true", help="the Trainer applies Liger's kernels (use_liger_kernel=True)")
    parser.add_argument("--verify", action="store_true",
                        help="run the setup (--plan or --hf-checkpointing) against the untouched model on one random "
                             "batch with remat.verify: every gradient bitwise, within rounding or wrong")
    parser.add_argument("--dropout", type=float, default=None, metavar="P",
                        help="every dropout probability of the config (default: the config's own); with --verify, "
                             "dropout is what shows a recompute that draws other masks")


def run(args) -> int:
    from types import SimpleNamespace

    import torch

    from remat.cli.plan import check_model_arguments
    from remat.diagnosis import SEVERITIES, doctor
    from remat.presets import build_model, load_config
    from remat.units import parse_budget
    budget = parse_budget(args.budget) if args.budget else None
    check_model_arguments(args)
    if (args.reentrant or args.no_preserve_rng or args.every_n_layers or args.hf_offload) and not args.hf_checkpointing:
        raise ValueError("--reentrant, --no-preserve-rng, --every-n-layers and --hf-offload describe Hugging Face "
                         "checkpointing: add --hf-checkpointing")
    if args.every_n_layers is not None and args.every_n_layers < 1:
        raise ValueError(f"--every-n-layers must be a whole number >= 1, got {args.every_n_layers}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be a probability in [0, 1), got {args.dropout}")
    fsdp_checkpointing = args.fsdp_checkpointing or args.fsdp_checkpointing_offload
    chosen = [name for name, on in (("--plan", args.plan), ("--hf-checkpointing", args.hf_checkpointing),
                                    ("--callback", args.callback), ("--fsdp-checkpointing", fsdp_checkpointing)) if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} describe different setups (remat refuses a model with Hugging Face "
                         "checkpointing, and a callback applies its own plan); pass one of them")
    if args.callback and budget is None:
        raise ValueError("--callback checks the plan RematCallback(budget=...) makes: add --budget, e.g. --budget 24GiB")
    device = "meta"
    if args.verify:
        if not (args.plan or args.hf_checkpointing):
            raise ValueError("--verify runs a setup against the untouched model: add --plan plan.json or "
                             "--hf-checkpointing (for a callback's plan: remat plan ... --out plan.json, then --plan)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.hf_offload and device == "cpu":
            raise ValueError("--verify with --hf-offload needs a GPU: transformers' offload=True pins host memory, "
                             "which this machine (no CUDA) cannot do; verify without --hf-offload here")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = load_config(args.model)
    if args.dropout is not None:
        from remat.cli.verify import set_dropout
        set_dropout(config, args.dropout)
    model = build_model(config, device=device, dtype=dtype)
    if args.plan:
        import remat
        remat.apply(model, remat.Plan.load(args.plan), strict=False)   # a plan for another model is reported
    if args.hf_checkpointing:
        _enable_hf_checkpointing(model, reentrant=args.reentrant, preserve_rng=not args.no_preserve_rng,
                                 every_n_layers=args.every_n_layers, offload=args.hf_offload)
    callback = None
    if args.callback:
        from remat.integrations.hf import RematCallback
        callback = RematCallback(budget=budget)
    accelerate_config = None
    if fsdp_checkpointing:
        accelerate_config = {"fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True,
                                             "fsdp_activation_checkpointing_offload": args.fsdp_checkpointing_offload}}
    training_args = SimpleNamespace(use_liger_kernel=True) if args.liger else None
    if device == "meta":
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    else:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    findings = doctor(model, ids if budget is not None or args.verify else None, budget=budget, gpu=args.gpu,
                      optimizer=args.optimizer, compiled=args.compile, callback=callback, fsdp_world=args.fsdp,
                      accelerate_config=accelerate_config, training_args=training_args)
    verified = None
    if args.verify:
        from remat.diagnosis import verify
        from remat.diagnosis.verification import findings_of
        verified = verify(model, {"input_ids": ids})
        findings = sorted(findings + findings_of(verified), key=lambda f: (SEVERITIES.index(f.severity), -f.cost))
    if not findings:
        print(f"remat doctor: no problems found in {args.model}"
              + ("" if budget is not None else " (pass --budget to check the checkpointing against a budget)"))
    for finding in findings:
        print(finding)
    if verified is not None:
        print(verified)
    return 1 if any(f.severity == "error" for f in findings) else 0


def _enable_hf_checkpointing(model, *, reentrant: bool, preserve_rng: bool, every_n_layers=None,
                             offload: bool = False) -> None:
    """Hugging Face checkpointing on ``model`` through the installed transformers' current name
    (``activation_checkpointing_enable`` in transformers 5, where the old one warns); ``every_n_layers``
    and ``offload`` as transformers >= 5.16 takes them (ValueError where it does not)."""
    import inspect
    kwargs = {"use_reentrant": bool(reentrant)}
    if not preserve_rng:
        kwargs["preserve_rng_state"] = False
    extra = {k: v for k, v in (("every_n_layers", every_n_layers), ("offload", offload)) if v}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if not callable(enable):
        enable = model.gradient_checkpointing_enable
        name = "gradient_checkpointing_kwargs"
    else:
        name = "activation_checkpointing_kwargs"
    if extra and not set(extra) <= set(inspect.signature(enable).parameters):
        import transformers
        raise ValueError(f"--every-n-layers and --hf-offload need transformers >= 5.16 (every_n_layers= and offload= "
                         f"on activation_checkpointing_enable); this is transformers {transformers.__version__}")
    enable(**{name: kwargs}, **extra)
