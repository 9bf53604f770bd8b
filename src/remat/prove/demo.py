"""What a CPU can prove about remat, in well under a minute: ``remat bench`` on a machine without a GPU.

A CPU cannot time a GPU's training step, and on a shared machine its own step times measure the load
more than the code. So without a GPU the bench shows only what a CPU measures exactly:

1. **Gradients** (:func:`exactness`): every treatment on the built-in ``llama-tiny`` (fp32, attention
   dropout 0.1, so checkpointing must replay the same dropout masks) against an untouched copy with
   the same weights, batch and RNG: the loss and every parameter gradient compared with ``torch.equal``.
   The chunked head and the tiled treatments sum in another order, so they are compared within a
   relative 1e-5 and the largest difference is printed. Offload needs CUDA: listed, not claimed.
2. **Memory** (same table): the peak of one training step measured tensor by tensor
   (:class:`remat.prove.memtrack.PeakTracker`) beside :func:`remat.simulate`'s prediction from a
   profile at the CPU's rates, with attention dropout off (with it on, the CPU's math attention keeps
   the ``[seq x seq]`` probabilities CUDA's kernels do not, and remat counts what CUDA's save). A
   treatment that silently did nothing would peak as ``keep`` does.
3. **The frontier on a real GPU, predicted** (:func:`frontier`): the planner's prediction for the
   ``llama-1b`` preset (the bench model of docs/design/diagnosis.md: 16 layers, hidden 2048, vocab
   128256, bf16, batch 4 x 4096) on an H100, from its config on the ``meta`` device: the stock
   strategies (no checkpointing, Hugging Face checkpointing, every second layer, op-level selective)
   and remat's plan at 10, 16, 25, 32 and 45 GiB, as a table and a plot. Every number there
   is a prediction; the README's "Measured" section has the same model measured on an H100.

CPU step times are not shown: ``remat bench --device cpu`` measures them (median and spread of
``--steps``), labelled as what they are. The records go to ``bench.jsonl`` (``"predicted": true`` on
the frontier's rows), the tables to ``bench.md`` and the plot to ``bench.png``, as ``remat bench``
writes them.
"""
from __future__ import annotations

import copy
import datetime
import os
import time
from typing import Callable, Optional

import torch

SPECS = ("full", "selective", "attention", "mlp", "every:2", "segments:2", "tiled", "full+tiled", "attn-saved")
"""Treatments proved on the CPU, each with the plain head; then ``full`` with the chunked head."""
TILE_TOKENS = 64
"""Tokens per chunk of the tiled treatments here: 256 tokens in 4 chunks, so tiling really splits."""
FRONTIER_MODEL, FRONTIER_GPU, FRONTIER_BATCH, FRONTIER_SEQ = "llama-1b", "h100", 4, 4096
FRONTIER_BUDGETS_GIB = (10, 16, 25, 32, 45)
STOCK = (("eager (no checkpointing)", "keep"), ("HF gradient checkpointing", "full"),
         ("every 2nd layer", "every:2"), ("op-level selective (SAC)", "selective"))
CHUNKED_RTOL = 1e-5
"""The chunked head and the tiled treatments sum in another order (the loss over chunks of tokens;
a tiled block's weight gradients chunk by chunk, in fp32): compared within this, not bitwise."""
TILED = ("tiled", "full+tiled", "full+offload+tiled")


def run(out_dir: str, say: Callable[[str], None] = lambda message: None) -> dict:
    """The three parts; writes ``bench.jsonl``, ``bench.md`` and ``bench.png`` into ``out_dir``.
    Returns ``{"records", "table", "plot", "why_no_plot", "seconds"}``."""
    from remat.prove import report
    start = time.perf_counter()
    say("proving each treatment's gradients and peak on llama-tiny (CPU, fp32)")
    proved = exactness()
    say(f"predicting the frontier of {FRONTIER_MODEL} {FRONTIER_BATCH} x {FRONTIER_SEQ} on an {FRONTIER_GPU.upper()}")
    predicted = frontier()
    records = proved + predicted
    os.makedirs(out_dir, exist_ok=True)
    import json
    with open(os.path.join(out_dir, "bench.jsonl"), "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    table = markdown(proved, predicted)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(table)
    plot = os.path.join(out_dir, "bench.png")
    title = (f"{FRONTIER_MODEL}, batch {FRONTIER_BATCH} x {FRONTIER_SEQ}, bf16, on an {FRONTIER_GPU.upper()}: "
             "PREDICTED by remat's planner (nothing measured)")
    why_not = report.plot(predicted, plot, title=title, predicted=True)
    return dict(records=records, table=table, plot=None if why_not else plot, why_no_plot=why_not,
                seconds=time.perf_counter() - start)


# -- 1 and 2: gradients and peaks of llama-tiny on the CPU -------------------------------------
def _tiny(dropout: float):
    from remat.presets import build_model, load_config
    config = load_config("llama-tiny")
    config.attention_dropout = dropout
    return build_model(config, dtype=torch.float32).train()


def _batch(vocab: int) -> dict:
    ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _step(model, batch, seed: int = 0):
    """One training step from a fixed RNG state: (loss, {name: grad})."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _variants():
    for spec in SPECS:
        yield spec, "plain"
    yield "full", "chunked"


def exactness() -> list:
    """Records of parts 1 and 2: per treatment, whether the loss and every gradient equal the untouched
    model's (dropout on), and the measured CPU peak beside the predicted one (dropout off)."""
    import remat
    from remat.planning.simulator import simulate
    from remat.prove.memtrack import PeakTracker
    from remat.units import format_size
    noisy = _tiny(dropout=0.1)
    batch = _batch(noisy.config.vocab_size)
    want_loss, want_grads = _step(noisy, batch)
    quiet = _tiny(dropout=0.0)
    prof = remat.profile(quiet, batch, gpu="cpu")
    records = []
    for spec, head in (("keep", "plain"), *_variants()):
        record = dict(strategy=f"remat:{spec}" + (f", head {head}" if head != "plain" else ""), kind="remat",
                      spec=spec, head=head, device="cpu", model="llama-tiny", batch=2, seq=128, dtype="float32",
                      status="ok", **_versions())
        if spec != "keep":
            treated = remat.apply(copy.deepcopy(noisy), spec, head=head, tile_tokens=TILE_TOKENS)
            loss, grads = _step(treated, batch)
            record.update(_compare(loss, grads, want_loss, want_grads, head, spec))
        model = remat.apply(copy.deepcopy(quiet), spec, head=head, tile_tokens=TILE_TOKENS)
        model.zero_grad(set_to_none=True)
        with PeakTracker(baseline=list(model.parameters()) + list(model.buffers())) as tracker:
            model(**batch).loss.backward()
        record["peak_bytes"] = int(tracker.peak)
        plan = remat.current_plan(model)
        if all(t in prof.treatments(0) for t in set(plan.blocks.values())) or spec.startswith("segments"):
            try:
                sim = simulate(prof, plan)
            except ValueError as e:   # a segments plan is applied as given, not simulated
                record["predicted_why_not"] = str(e).split(";")[0]
            else:
                record.update(predicted_peak_bytes=int(sim.peak_bytes), peak_at=sim.peak_at)
        else:
            record["predicted_why_not"] = ("tiled treatments are profiled where a block sees 16k tokens or more; "
                                           "here it sees 256")
        record["peak"] = format_size(record["peak_bytes"])
        records.append(record)
    records.append(dict(strategy="remat:offload", kind="remat", spec="offload", head="plain", device="cpu",
                        model="llama-tiny", status="skipped",
                        reason="needs CUDA: on a CPU an offloaded block keeps its tensors in place (no host copies), "
                               "so nothing is proved here", **_versions()))
    return records


def _compare(loss, grads, want_loss, want_grads, head, spec) -> dict:
    same_names = grads.keys() == want_grads.keys()
    if head == "plain" and spec not in TILED:
        equal = same_names and torch.equal(loss, want_loss) and all(
            torch.equal(grads[n], want_grads[n]) for n in grads)
        return dict(grads_equal=bool(equal), grads_compared=len(want_grads),
                    grads_how="bitwise (torch.equal)")
    worst = max((float(((grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max().clamp_min(1e-30))))
                for n in grads) if same_names else float("inf")
    loss_rel = float((loss - want_loss).abs() / want_loss.abs())
    return dict(grads_equal=bool(same_names and worst <= CHUNKED_RTOL and loss_rel <= CHUNKED_RTOL),
                grads_compared=len(want_grads), grads_how=f"within {CHUNKED_RTOL:g} relative",
                max_rel_diff=max(worst, loss_rel))


# -- 3: the planner's frontier for a real model on a named GPU ------------------------------------
def frontier() -> list:
    """Records of part 3: predicted peak and speed of the stock strategies and remat's plans for
    ``llama-1b`` at 4 x 4096 on an H100, from its config on the meta device."""
    import remat
    from remat.presets import build_model, load_config
    from remat.planning.plans import resolve
    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits
    model = build_model(load_config(FRONTIER_MODEL), device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(FRONTIER_BATCH, FRONTIER_SEQ, dtype=torch.long)
    prof = remat.profile(model, ids, gpu=FRONTIER_GPU)
    base = dict(model=FRONTIER_MODEL, batch=FRONTIER_BATCH, seq=FRONTIER_SEQ, dtype="bfloat16",
                gpu=f"{FRONTIER_GPU.upper()} (predicted)", predicted=True, status="ok", **_versions())
    records = []
    for name, spec in STOCK:
        sim = simulate(prof, resolve(spec, prof.block_names), head="plain")
        records.append(dict(base, strategy="eager" if spec == "keep" else name, kind="anchor", spec=spec,
                            peak_bytes=int(sim.peak_bytes), tokens_per_s=sim.tokens_per_s, step_s=sim.step_s))
    for gib in FRONTIER_BUDGETS_GIB:
        budget = int(gib * 2**30)
        try:
            plan = remat.plan(model, ids, budget, profiled=prof)
        except NoPlanFits as e:
            records.append(dict(base, strategy=f"remat@{gib}GiB", kind="remat", budget_bytes=budget,
                                status="skipped", reason=str(e)[:200]))
            continue
        n = plan.notes
        records.append(dict(base, strategy=f"remat@{gib}GiB", kind="remat", budget_bytes=budget, plan=plan.summary(),
                            peak_bytes=int(n["predicted_peak_bytes"]), tokens_per_s=n["predicted_tokens_per_s"],
                            step_s=n["predicted_step_s"]))
    eager = records[0]["tokens_per_s"]
    for record in records:
        if record["status"] == "ok":
            record["vs_eager"] = record["tokens_per_s"] / eager
    return records


def _versions() -> dict:
    import transformers

    from remat import __version__
    return dict(torch=torch.__version__, transformers=transformers.__version__, remat=__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# -- the report ---------------------------------------------------------------------------------
def markdown(proved: list, predicted: list) -> str:
    from remat.units import format_size as f
    first = proved[0]
    lines = ["## What this CPU proves", "",
             f"llama-tiny (4 blocks, hidden 64), batch 2 x 128, fp32, torch {first['torch']}, transformers "
             f"{first['transformers']}, remat {first['remat']}. Gradients: attention dropout 0.1, against an untouched "
             "copy (same weights, batch, RNG). Peaks: dropout off, measured tensor by tensor on this CPU, beside "
             "remat's prediction.", "",
             "| treatment | loss and gradients vs untouched | CPU peak, measured | predicted | measured / predicted |",
             "|---|---|---|---|---|"]
    for r in proved:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r['reason']} | | | |")
            continue
        if "grads_equal" not in r:
            grads = "(the reference)"
        elif r["grads_equal"]:
            grads = (f"equal: loss and {r['grads_compared']} of {r['grads_compared']} gradients, {r['grads_how']}"
                     + (f" (largest {r['max_rel_diff']:.1e})" if "max_rel_diff" in r else ""))
        else:
            grads = f"DIFFERENT ({r['grads_how']}" + (f", largest {r['max_rel_diff']:.1e})" if "max_rel_diff" in r
                                                       else ")")
        if "predicted_peak_bytes" in r:
            predicted_text, ratio = f(r["predicted_peak_bytes"]), f"{r['peak_bytes'] / r['predicted_peak_bytes']:.4f}"
        else:
            predicted_text, ratio = f"not predicted: {r.get('predicted_why_not', '')}", ""
        lines.append(f"| {r['strategy']} | {grads} | {f(r['peak_bytes'])} | {predicted_text} | {ratio} |")
    lines += ["", "CPU step times are not shown: on a shared CPU they measure the load, not remat "
              "(`remat bench --device cpu` times them, median and spread). On a GPU, `remat bench` measures "
              "peak and speed beside every stock strategy.", "",
              f"## Predicted: {FRONTIER_MODEL}, batch {FRONTIER_BATCH} x {FRONTIER_SEQ}, bf16, one "
              f"{FRONTIER_GPU.upper()}", "",
              "remat's planner, from the config on the meta device at the H100's rates: every number below is a "
              "prediction, nothing here ran on a GPU (the README's Measured section has this model measured).", "",
              "| strategy | budget | predicted peak | predicted tokens/s | vs eager | plan |", "|---|---|---|---|---|---|"]
    for r in predicted:
        budget = f(r["budget_bytes"]) if r.get("budget_bytes") else ""
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {budget} | {r['status']} | | | {r.get('reason', '')[:80]} |")
            continue
        lines.append(f"| {r['strategy']} | {budget} | {f(r['peak_bytes'])} | {r['tokens_per_s']:,.0f} | "
                     f"{r['vs_eager']:.3f}x | {r.get('plan', '')} |")
    return "\n".join(lines) + "\n"


def is_requested(args, defaults: Optional[dict] = None) -> bool:
    """Whether ``remat bench`` with these arguments means this demo: no CUDA, and no option that
    asks for the measuring bench (a model, shapes, budgets, strategies, a device, compile)."""
    chosen = ("model", "batch", "seq", "budgets", "only", "compile", "compile_backend", "device")
    if any(getattr(args, name, None) for name in chosen) or getattr(args, "anchors", ""):
        return False
    defaults = defaults or {}
    if any(getattr(args, name) != value for name, value in defaults.items()):
        return False
    return not torch.cuda.is_available()
