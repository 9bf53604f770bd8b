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
that need one (parameters without gradients, measured against predicted) are for the Python API.

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


def run(args) -> int:
    import torch

    from remat.cli.plan import check_model_arguments
    from remat.diagnosis import doctor
    from remat.presets import build_model, load_config
    from remat.units import parse_budget
    budget = parse_budget(args.budget) if args.budget else None
    check_model_arguments(args)
    if (args.reentrant or args.no_preserve_rng) and not args.hf_checkpointing:
        raise ValueError("--reentrant and --no-preserve-rng describe Hugging Face checkpointing: add --hf-checkpointing")
    chosen = [name for name, on in (("--plan", args.plan), ("--hf-checkpointing", args.hf_checkpointing),
                                    ("--callback", args.callback)) if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} describe different setups (remat refuses a model with Hugging Face "
                         "checkpointing, and a callback applies its own plan); pass one of them")
    if args.callback and budget is None:
        raise ValueError("--callback checks the plan RematCallback(budget=...) makes: add --budget, e.g. --budget 24GiB")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = build_model(load_config(args.model), device="meta", dtype=dtype)
    if args.plan:
        import remat
        remat.apply(model, remat.Plan.load(args.plan), strict=False)   # a plan for another model is reported
    if args.hf_checkpointing:
        _enable_hf_checkpointing(model, reentrant=args.reentrant, preserve_rng=not args.no_preserve_rng)
    callback = None
    if args.callback:
        from remat.integrations.hf import RematCallback
        callback = RematCallback(budget=budget)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    findings = doctor(model, ids if budget is not None else None, budget=budget, gpu=args.gpu,
                      optimizer=args.optimizer, compiled=args.compile, callback=callback, fsdp_world=args.fsdp)
    if not findings:
        print(f"remat doctor: no problems found in {args.model}"
              + ("" if budget is not None else " (pass --budget to check the checkpointing against a budget)"))
        return 0
    for finding in findings:
        print(finding)
    return 1 if any(f.severity == "error" for f in findings) else 0


def _enable_hf_checkpointing(model, *, reentrant: bool, preserve_rng: bool) -> None:
    """Hugging Face checkpointing on ``model`` through the installed transformers' current name
    (``activation_checkpointing_enable`` in transformers 5, where the old one warns)."""
    kwargs = {"use_reentrant": bool(reentrant)}
    if not preserve_rng:
        kwargs["preserve_rng_state"] = False
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
