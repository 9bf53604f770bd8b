"""``remat verify``: a treatment checked against the untouched model, on a preset or a config file.

The model is built with random weights (no download) on this machine's GPU, else its CPU, dropout set
to ``--dropout`` wherever its config has a dropout field (the config's own by default: most LLM
configs have none, and dropout is what shows a recompute that draws other masks), and
:func:`remat.verify` runs it untouched and treated on one random batch of ``--batch`` x ``--seq``
tokens: the loss and every gradient, bitwise / within rounding / wrong, a float64 re-run where it
fits, and on a GPU the measured peak and step beside the plan's prediction. What is verified is
``--spec`` (``full``, ``tiled``, ``every:2`` ...), a saved plan (``--plan``), or the plan ``remat
plan`` makes for ``--budget``. ``remat doctor --verify`` runs the same check on a doctor's setup.

Exit status: 0 (bitwise or within rounding), 1 (wrong), 2 for a usage mistake (as every command).
"""
from __future__ import annotations

HELP = "run the untouched and the treated model on one batch: every gradient bitwise, within rounding or wrong"
EXAMPLES = """examples:
  remat verify --model llama-tiny --spec full
  remat verify --model llama-tiny --spec full+tiled --tile-tokens 32 --head chunked --dropout 0.1
  remat verify --model llama-tiny --batch 2 --seq 128 --budget 6MiB      # the plan remat plan makes
  remat verify --model llama-tiny --spec tiled --json

A saved plan: remat verify --model <config> --plan plan.json --batch 1 --seq 1024.
Run it before a long job, on the batch shape you train (a shorter one where the untouched model does
not fit: a treatment's arithmetic does not depend on the length). Verdicts: bitwise (every tensor
torch.equal to the untouched model's), within rounding (differences that shrink by orders of magnitude
in a float64 re-run, or within sqrt(eps) of the gradient scale where float64 cannot run), wrong.
"""


def add_arguments(parser) -> None:
    from remat.cli.plan import add_model_arguments
    add_model_arguments(parser)
    parser.set_defaults(batch=2, seq=128, dtype=None)
    what = parser.add_argument_group("what to verify (one of)")
    what.add_argument("--spec", help="a treatment for every block or a spec: full, selective, tiled, full+tiled, "
                                     "every:2, first:4:offload ...")
    what.add_argument("--plan", help="a remat plan (JSON, from `remat plan --out`)")
    what.add_argument("--budget", help="plan for this budget first (as remat plan does), then verify that plan")
    parser.add_argument("--head", choices=("plain", "chunked"), help="the LM head: chunked computes the loss a chunk "
                                                                     "of tokens at a time")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="tokens per chunk of the chunked head")
    parser.add_argument("--tile-tokens", type=int, default=None, help="tokens per chunk of the tiled treatments")
    parser.add_argument("--dropout", type=float, default=None, metavar="P",
                        help="every dropout probability of the config (default: the config's own)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where to run (default: cuda where there is one)")
    parser.add_argument("--no-float64", action="store_true",
                        help="no float64 re-run: judge differences against the gradient scale only")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args) -> int:
    import json

    import torch

    from remat.cli.plan import check_model_arguments
    from remat.diagnosis import verify
    check_model_arguments(args)
    chosen = [f"--{n}" for n in ("spec", "plan", "budget") if getattr(args, n)]
    if len(chosen) != 1:
        raise ValueError("pass what to verify: --spec (e.g. --spec full), --plan plan.json or --budget 24GiB"
                         if not chosen else f"{' and '.join(chosen)} each say what to verify; pass one of them")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be a probability in [0, 1), got {args.dropout}")
    for option in ("chunk_tokens", "tile_tokens"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be a whole number >= 1, got {value}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device; drop --device (the CPU is used)")
    model, batch, dtype_name = build(args, device)
    spec = _what(args, model, batch)
    result = verify(model, batch, spec, head=args.head, chunk_tokens=args.chunk_tokens, tile_tokens=args.tile_tokens,
                    float64=False if args.no_float64 else None)
    if args.json:
        print(json.dumps(as_dict(result), indent=1, sort_keys=True))
    else:
        print(result)
    return 1 if result.verdict == "wrong" else 0


def build(args, device: str):
    """``(model, batch, dtype name)``: the preset or config with random weights on ``device``, dropout set,
    and one batch of random token ids (a vision-language model's images and text)."""
    import torch

    from remat.cli.plan import batch_from_args
    from remat.presets import build_model, load_config
    name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    config = load_config(args.model)
    if getattr(args, "dropout", None) is not None:
        set_dropout(config, args.dropout)
    model = build_model(config, device=device, dtype=dtype)
    batch = batch_from_args(args, config, dtype, random=True)
    if isinstance(batch, dict):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    else:
        batch = {"input_ids": batch.to(device)}
    return model, batch, name


def set_dropout(config, p: float) -> None:
    """Every dropout probability of ``config`` (and of its text and vision parts) to ``p``."""
    for key, value in config.to_dict().items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                ("dropout" in key or key.endswith("pdrop")) and "layerdrop" not in key:
            setattr(config, key, p)
    for part in ("text_config", "vision_config"):
        if getattr(config, part, None) is not None:
            set_dropout(getattr(config, part), p)


def _what(args, model, batch):
    import remat
    if args.spec:
        return args.spec
    if args.plan:
        return remat.Plan.load(args.plan)
    from remat.cli.plan import progress
    from remat.units import parse_budget
    return remat.plan(model, batch, parse_budget(args.budget), gpu=args.gpu, optimizer=args.optimizer,
                      progress=progress())


def as_dict(result) -> dict:
    """The result as JSON-ready data (infinite differences as None)."""
    import dataclasses
    import math

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value
    return clean(dataclasses.asdict(result))
