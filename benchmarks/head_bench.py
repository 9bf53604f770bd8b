"""Chunked LM head on the DESIGN.md bench model, with its anchors measured in the same process.

One GPU, one process: forward+backward steps of the bench model (``llama-1b`` preset, bf16, SDPA,
batch 4 x 4096, random ids, ``labels=ids``, outputs dropped before backward as the HF Trainer does)
under each strategy:

- ``none``: eager, no checkpointing (anchor);
- ``hf_full``: ``model.gradient_checkpointing_enable(use_reentrant=False)`` (anchor);
- ``full``: ``remat.apply(m, "full")``;
- ``full+chunked``: ``remat.apply(m, "full", head="chunked")`` (default chunk, plus the sizes in
  ``--chunks`` as ``full+chunked:N``);
- ``chunked``: ``remat.apply(m, "keep", head="chunked")``, the head alone (and ``chunked:N`` for
  each size in ``--chunks``); ``chunked:N@fp32sum``: the same with the weight gradient summed in
  fp32 as before the target-rows sum (``remat.head.chunked_loss._TargetRows``), an A/B in one
  process (restored after the row);
- ``liger`` / ``cce``: a ``keep`` model whose head and loss are Liger's
  ``LigerFusedLinearCrossEntropyLoss`` / Apple's ``cut_cross_entropy.linear_cross_entropy`` on the
  final hidden states and the LM head's weight (:func:`remat.prove.anchors.fused_loss_forward`;
  recorded with the reason when the package does not import).

Per strategy: peak (``max_memory_allocated`` after a reset, over the timed steps), the peak of
one more forward alone (up to the loss: equal to the step's peak where the head's forward sets it), static bytes
(allocated before a step), step time (median and spread), tokens/s, ratio to eager and to
``hf_full``, loss and its relative difference to eager's, and for chunked rows the chunk size
(the planner predicts the head's peak from a profile of it, not from a formula).

Accuracy (``--parts accuracy``): the gradient error of each bf16 head path against an fp32
reference of the same weights, on the bench model cut to ``--accuracy-layers`` layers (vocab
128256), one sequence of ``--accuracy-seq`` tokens with every 7th label ignored (the chunked paths at
``--accuracy-chunk``): ``plain`` (the model's
own head), ``chunked`` (remat, keep + chunked head), ``chunked@fp32sum`` (the same, its weight
gradient summed in fp32), ``chunked@bf16sum`` (a control: summed in bf16, no target rows),
``liger``, ``cce``. Error is
``|g - g_ref| / |g_ref|`` (L2) per parameter of interest (lm_head, embed_tokens, the first
down_proj) and over all parameters together; the loss's relative error beside it.

``--trace``: after each row's timed steps, one more step under ``torch.profiler``
(``benchmarks/_trace.py``): kernel seconds per category (gemm, elementwise, attention, ...),
GPU idle time in the step and the 15 costliest kernels by name, in the row's ``trace`` (where
the head's time goes: its gathers, GEMMs and waits beside Liger's). Never a timed step.

Then the issues' criteria with their numbers and pass/fail: ``full+chunked`` peak <= 12 GiB at
>= 0.97x ``hf_full``; ``chunked`` alone: peak drop against ``none``; ``chunked`` at least as fast
as ``liger`` and at or below its peak; chunked's gradient error within 1.05x the plain path's.

Usage (on the GPU machine, from the repository root; liger/cce from wheels, if wanted):
    pip install --no-deps .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl
    PYTHONPATH=src python3 benchmarks/head_bench.py --out "$OUT"
Writes ``head_bench.json`` (info + rows + accuracy + criteria) to ``--out``; prints one JSON line
per result and a table last. About 3 minutes on an H100. ``--parts accuracy`` alone also runs on
the CPU (fp32 vs bf16 on a tiny model: ``--model llama-tiny``).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import statistics

import torch

import remat
from remat.api import current_plan
from remat.prove.anchors import FUSED_LOSSES, fused_loss, fused_loss_forward, fused_loss_unavailable
from remat.prove.bench import timed_steps
from remat.head import chunked_loss
from remat.head.chunked_loss import default_chunk_tokens
from remat.presets import build_model, load_config

from _args import bench_parser  # benchmarks/_args.py, beside this script
from _trace import format_breakdown, trace_step  # benchmarks/_trace.py

GiB = 2 ** 30
PEAK_LIMIT_GIB = 12.0
SPEED_VS_HF_FULL = 0.97
ACCURACY_VS_PLAIN = 1.05   # chunked's gradient error at most this times the plain path's


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--chunks", default="1024,4096,8192", help="extra chunk sizes for full+chunked")
    p.add_argument("--only", default="", help="comma-separated subset of strategy names")
    p.add_argument("--parts", default="speed,accuracy", help="speed, accuracy or both (default)")
    p.add_argument("--accuracy-layers", type=int, default=2)
    p.add_argument("--accuracy-seq", type=int, default=4096)
    p.add_argument("--trace", action="store_true",
                   help="one more step per row under torch.profiler: its kernel-time breakdown and top kernels")
    p.add_argument("--accuracy-chunk", type=int, default=None,
                   help="the chunked paths' chunk in the accuracy part (default: remat's default)")
    return p.parse_args(argv)


def strategies(chunks):
    def none(m):
        pass

    def hf_full(m):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def anchor(name):
        def setup(m):
            why = fused_loss_unavailable(name)
            if why:
                raise RuntimeError(why)
            return fused_loss_forward(m, fused_loss(name))
        return setup

    todo = {"none": none, "hf_full": hf_full, "full": lambda m: remat.apply(m, "full"),
            "full+chunked": lambda m: remat.apply(m, "full", head="chunked"),
            "chunked": lambda m: remat.apply(m, "keep", head="chunked")}
    for c in chunks:
        todo[f"full+chunked:{c}"] = lambda m, c=c: remat.apply(m, "full", head="chunked", chunk_tokens=c)
        todo[f"chunked:{c}"] = lambda m, c=c: remat.apply(m, "keep", head="chunked", chunk_tokens=c)
        todo[f"chunked:{c}@fp32sum"] = _summed_by(_fp32_sum, c)
    for name in FUSED_LOSSES:
        todo[name] = anchor(name)
    return todo


def _summed_by(make, chunk):
    """A setup: keep + chunked(chunk) with every head's weight gradient summed by ``make(weight)``
    instead of remat's choice, for an A/B in one process (:func:`_accumulator_restored` gives the
    choice back after the row)."""
    def setup(model):
        chunked_loss._accumulator = lambda weight, *_: make(weight)
        remat.apply(model, "keep", head="chunked", chunk_tokens=chunk)
    return setup


@contextlib.contextmanager
def _accumulator_restored():
    chosen = chunked_loss._accumulator
    try:
        yield
    finally:
        chunked_loss._accumulator = chosen


def _fp32_sum(weight):
    """The weight gradient summed in fp32, as before the target-rows sum."""
    return chunked_loss._Accumulator(weight.shape, weight.device)


class _Bf16Sum:
    """The control for the accuracy part: the weight gradient summed in bf16 chunk by chunk, no
    target rows (what a plain bf16 running sum such as Liger's does)."""

    def __init__(self, weight):
        self.full = torch.zeros_like(weight)

    def columns(self, m):
        return None

    def add(self, g, hc, gathered=False):
        self.full.addmm_(g.t(), hc)

    def finish(self, dtype):
        return [self.full.to(dtype)]


def run(name, setup, args, config):
    gc.collect()
    torch.cuda.empty_cache()
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    forward = setup(model)  # None, or a forward computing the loss another way (fused-loss anchors)
    forward = forward if callable(forward) and not isinstance(forward, torch.nn.Module) else model
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to("cuda")

    def step():
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids).loss  # the outputs die here, before backward
        loss.backward()
        return loss.detach()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, loss = timed_steps(step, args.steps)
    peak = torch.cuda.max_memory_allocated()
    forward_peak = _forward_peak(model, forward, ids)
    trace = trace_step(step, cuda=torch.cuda.is_available(), top=15) if args.trace else None
    med = statistics.median(times)
    row = dict(strategy=name, peak_GiB=peak / GiB, forward_peak_GiB=forward_peak / GiB, static_GiB=static / GiB,
               step_s=med,
               step_s_min=min(times), step_s_max=max(times), tok_s=args.batch * args.seq / med,
               loss=float(loss), model=args.model, batch=args.batch, seq=args.seq)
    if trace is not None:
        row.update(trace=trace)
        print(f"{name}: {format_breakdown(trace)}", flush=True)
    plan = current_plan(model)
    if plan is not None and plan.head == "chunked":
        row.update(chunk_tokens=plan.chunk_tokens or default_chunk_tokens(config.vocab_size))
    del model, forward, ids, loss
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _forward_peak(model, forward, ids):
    """The peak up to the loss, one more step: where it equals the step's peak, the head's forward
    (not backward) sets the peak."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = forward(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return peak


def accuracy(args, config, device):
    """Gradient error of each bf16 head path against an fp32 reference with the same weights."""
    config = type(config).from_dict(config.to_dict())
    config.num_hidden_layers = args.accuracy_layers
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, config.vocab_size, (1, args.accuracy_seq), generator=generator)
    labels[0, ::7] = -100  # some ignored labels, as an SFT batch has
    ids, labels = labels.clamp(min=0).to(device), labels.to(device)
    reference = build_model(config, device=device, dtype=torch.float32)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n: p.grad.double() for n, p in reference.named_parameters()}
    state = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    del reference
    _free(device)
    watched = {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight",
               "down_proj": "model.layers.0.mlp.down_proj.weight"}
    out = dict(model=args.model, layers=config.num_hidden_layers, vocab=config.vocab_size, seq=args.accuracy_seq,
               chunk=args.accuracy_chunk or default_chunk_tokens(config.vocab_size),
               device=str(device), ref_loss=float(ref_loss), paths={})

    def chunked(m):
        remat.apply(m, "keep", head="chunked", chunk_tokens=args.accuracy_chunk)
        return m

    def summed_by(make):
        setup = _summed_by(make, args.accuracy_chunk)
        return lambda m: setup(m) or m

    paths = {"plain": lambda m: m, "chunked": chunked, "chunked@fp32sum": summed_by(_fp32_sum),
             "chunked@bf16sum": summed_by(_Bf16Sum)}
    for name in FUSED_LOSSES:
        paths[name] = lambda m, name=name: fused_loss_forward(m, fused_loss(name))
    for name, setup in paths.items():
        if name in FUSED_LOSSES:
            why = fused_loss_unavailable(name) or (None if device.type == "cuda" else "needs a CUDA GPU")
            if why:
                out["paths"][name] = dict(skipped=why)
                print(json.dumps(dict(accuracy=name, skipped=why[:200])), flush=True)
                continue
        model = build_model(config, device=device, dtype=torch.bfloat16)
        model.load_state_dict(state)
        with _accumulator_restored():
            try:
                loss = setup(model)(input_ids=ids, labels=labels).loss
                loss.backward()
                loss = loss.detach()
                grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
                errors = {short: _rel(grads[full], ref_grads[full]) for short, full in watched.items()
                          if full in grads and full in ref_grads}
                num = sum(float((grads[n] - ref_grads[n]).norm() ** 2) for n in grads if n in ref_grads)
                den = sum(float(ref_grads[n].norm() ** 2) for n in grads if n in ref_grads)
                errors["all"] = (num / den) ** 0.5 if den else float("nan")
                out["paths"][name] = dict(grad_rel_error=errors, loss=float(loss),
                                          loss_rel_error=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
            except Exception as e:  # a kernel that fails here is a result, not a crash
                out["paths"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(dict(accuracy=name, **out["paths"][name])), flush=True)
        del model
        _free(device)
    return out


def _rel(g, ref):
    den = float(ref.norm())
    return float((g - ref).norm()) / den if den else float("nan")


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def criteria(rows, acc=None):
    by = {r["strategy"]: r for r in rows if "error" not in r}
    out = []
    none, hf, fc, ch = by.get("none"), by.get("hf_full"), by.get("full+chunked"), by.get("chunked")
    if fc and hf:
        speed = fc["tok_s"] / hf["tok_s"]
        out.append(dict(criterion=f"full+chunked peak <= {PEAK_LIMIT_GIB} GiB and >= {SPEED_VS_HF_FULL}x hf_full",
                        peak_GiB=fc["peak_GiB"], hf_full_peak_GiB=hf["peak_GiB"], speed_vs_hf_full=speed,
                        passed=fc["peak_GiB"] <= PEAK_LIMIT_GIB and speed >= SPEED_VS_HF_FULL))
    if ch and none:
        out.append(dict(criterion="chunked head alone: peak drop against eager (reported)",
                        peak_GiB=ch["peak_GiB"], none_peak_GiB=none["peak_GiB"],
                        drop_GiB=none["peak_GiB"] - ch["peak_GiB"], speed_vs_none=ch["tok_s"] / none["tok_s"]))
    if none:
        worst = max((abs(r["loss"] - none["loss"]) / abs(none["loss"]) for r in by.values()), default=0.0)
        out.append(dict(criterion="every loss within 1e-2 relative of eager's (bf16)", worst_rel=worst,
                        passed=worst <= 1e-2))
    liger = by.get("liger")
    if ch and liger:
        out.append(dict(criterion="chunked (keep) at least as fast as Liger FLCE and at or below its peak",
                        speed_vs_liger=ch["tok_s"] / liger["tok_s"], peak_GiB=ch["peak_GiB"],
                        liger_peak_GiB=liger["peak_GiB"],
                        passed=ch["tok_s"] >= liger["tok_s"] and ch["peak_GiB"] <= liger["peak_GiB"]))
    paths = (acc or {}).get("paths", {})
    plain, chunked = paths.get("plain", {}), paths.get("chunked", {})
    if "grad_rel_error" in plain and "grad_rel_error" in chunked:
        ratios = {k: chunked["grad_rel_error"][k] / plain["grad_rel_error"][k]
                  for k in plain["grad_rel_error"] if k in chunked["grad_rel_error"] and plain["grad_rel_error"][k]}
        worst_key = max(ratios, key=ratios.get)
        out.append(dict(criterion=f"chunked gradient error vs fp32 within {ACCURACY_VS_PLAIN}x the plain path's",
                        worst_param=worst_key, worst_ratio=ratios[worst_key],
                        chunked_lm_head=chunked["grad_rel_error"].get("lm_head", float("nan")),
                        plain_lm_head=plain["grad_rel_error"].get("lm_head", float("nan")),
                        passed=ratios[worst_key] <= ACCURACY_VS_PLAIN))
    return out


def main(argv=None):
    args = parse_args(argv)
    import transformers
    info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None, torch=torch.__version__,
                transformers=transformers.__version__, remat=remat.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                args=vars(args))
    print(json.dumps(info), flush=True)
    config = load_config(args.model)
    parts = {p for p in args.parts.split(",") if p}
    todo = strategies([int(c) for c in args.chunks.split(",") if c])
    names = [n for n in args.only.split(",") if n] or list(todo)
    rows, acc = [], None
    if "accuracy" in parts:
        acc = accuracy(args, config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    for name in names if "speed" in parts else []:
        try:
            with _accumulator_restored():
                rows.append(run(name, todo[name], args, config))
        except Exception as e:  # an OOM or a refusal is itself a result; keep going
            rows.append(dict(strategy=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    by = {r["strategy"]: r for r in rows if "error" not in r}
    for r in rows:
        if "error" not in r:
            for ref in ("none", "hf_full"):
                if ref in by:
                    r[f"vs_{ref}"] = r["tok_s"] / by[ref]["tok_s"]
            if "none" in by:
                r["loss_rel_vs_none"] = abs(r["loss"] - by["none"]["loss"]) / abs(by["none"]["loss"])
    checks = criteria(rows, acc)
    for c in checks:
        print(json.dumps(c), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "head_bench.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, accuracy=acc, criteria=checks), f, indent=1)
    for name, path in ((acc or {}).get("paths") or {}).items():
        errors = path.get("grad_rel_error")
        print(f"accuracy {name:8s} " + (", ".join(f"{k} {v:.2%}" for k, v in errors.items()) if errors
                                         else path.get("skipped", path.get("error", ""))[:90]))
    print(f"{'strategy':22s} {'peak GiB':>9s} {'tok/s':>8s} {'vs none':>8s} {'vs hf':>7s} {'loss':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']:22s} {r['error'][:70]}")
            continue
        print(f"{r['strategy']:22s} {r['peak_GiB']:9.2f} {r['tok_s']:8.0f} {r.get('vs_none', float('nan')):8.3f} "
              f"{r.get('vs_hf_full', float('nan')):7.3f} {r['loss']:9.5f}")
    for c in checks:
        verdict = "" if "passed" not in c else ("PASS" if c["passed"] else "FAIL")
        print(f"{verdict:4s} {c['criterion']}: " + ", ".join(
            f"{k}={v:.3f}" for k, v in c.items() if isinstance(v, float)))


if __name__ == "__main__":
    main()
