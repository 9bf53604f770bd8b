"""The checks of :func:`remat.integrations.doctor.doctor` that run the model: one real training
step, remat's profile at a budget, and the applied plan measured on CUDA.

:mod:`remat.integrations.doctor` holds the report (:class:`~remat.integrations.doctor.Finding`,
the ordering) and the checks that only read the setup; this module the ones that cost a step
or a profile, each a function of the model and batch that returns findings. They share how a
step's loss is taken (:func:`step_loss`) and run the model eagerly even when it was compiled
(:func:`eager`): a training step or a fake-tensor profile under ``torch.compile`` would
compile on the spot (minutes, a C++ compiler on the CPU) and measure nothing the checks need.
Only the measurement against the prediction runs the model as it will train, compiled or not.

Limits: a plan of ``"segment:<i>"`` blocks (``"segments:K"``) has no simulated peak or time
(:func:`remat.simulate` refuses it), so only ``keep-fits`` is checked for it, timed as ``full``
(each block recomputed once, as a segment does); a compiled run is not compared with eager
profiles at all (``plans-not-checked`` says so and how to plan for compile).
"""
from __future__ import annotations

import contextlib
import time

import torch

from remat.integrations.doctor import Finding, applied_plan, hf_checkpointing_on

FASTER = 0.05      # a plan this much faster than the applied one is worth a finding
OFF = 0.10         # measured vs predicted


@contextlib.contextmanager
def eager(model):
    """``model`` with every in-place compile (``Module.compile()``) set aside: its modules run eagerly."""
    compiled = [m for m in model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
    held = [m._compiled_call_impl for m in compiled]
    for m in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in zip(compiled, held):
            m._compiled_call_impl = impl


def step_loss(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, batch)
    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch).loss
    if isinstance(batch, dict):
        inputs = dict(batch)
        if "labels" not in inputs and "input_ids" in inputs:
            inputs["labels"] = inputs["input_ids"]
        return model(**inputs).loss
    raise TypeError(f"doctor runs a step on a dict of tensors or a tensor of ids; a {type(batch).__name__} batch "
                    "needs loss_fn=lambda model, batch: ...")


def check_step(model, batch, loss_fn) -> list:
    from remat.profiling.snapshot import preserved
    findings = []
    with preserved(model), eager(model):
        model.train()
        out_loss = step_loss(model, batch, loss_fn)
        if out_loss.requires_grad:   # else nothing trainable reaches the loss: every parameter is missing
            out_loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        total = sum(1 for p in model.parameters() if p.requires_grad)
    if missing:
        findings.append(Finding(
            check="no-grad", severity="error", cost=len(missing) / max(total, 1),
            what=f"{len(missing)} of {total} trainable parameters got no gradient in a training step: "
                 f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
            why="they will never change; if they are adapters, the fine-tune trains nothing",
            fix="freeze what should not train (requires_grad_(False)); for adapters inside checkpointed blocks use "
                "non-reentrant checkpointing (use_reentrant=False) or enable_input_require_grads()"))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        findings.append(Finding(
            check="use-cache", severity="note", cost=0.01,
            what=f"{type(model).__name__}.config.use_cache is True during training",
            why="a training forward builds a key/value cache nobody reads: transformers warns and turns it off "
                "under its checkpointing, remat drops it in treated blocks, untreated blocks still build it",
            fix="model.config.use_cache = False before training (TRL's SFTTrainer passes use_cache=False itself)"))
    return findings


# -- plans: remat's profile at this batch and budget ---------------------------------------
@contextlib.contextmanager
def _hf_checkpointing_off(model):
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in on:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True


def check_plans(model, batch, budget, training_args, loss_fn, gpu, optimizer, compiled: bool) -> list:
    from remat.integrations.doctor import args_checkpointing
    from remat.planning.plans import Plan, segment_of
    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits, solve
    from remat.profiling.profiler import profile
    from remat.units import format_size, parse_budget
    budget = parse_budget(budget)
    applied = applied_plan(model)
    hf = hf_checkpointing_on(model) or args_checkpointing(training_args)
    if applied is None and not hf:
        return []
    if compiled:
        return [_not_checked(
            "keep-fits, faster-plan", "the model runs compiled and remat's profile here is eager",
            "compile changes every treatment's memory and time, so eager numbers would judge the wrong step",
            f"on the GPU, remat.plan(model, batch, budget='{format_size(budget)}', compile=True) (remat plan "
            "--compile) gives the fastest plan for a compiled step; compare its notes['predicted_step_s']")]
    with _hf_checkpointing_off(model), eager(model):
        prof = profile(model, batch, loss_fn=loss_fn, gpu=gpu, optimizer=optimizer)
    if applied is None or hf:
        applied = Plan(blocks={name: "full" for name in prof.block_names}, head="plain")
        source = "Hugging Face checkpointing (full on every block)"
    else:
        source = f"the applied remat plan ({applied.summary()})"
    if all(t == "keep" for t in applied.blocks.values()):
        return []
    segmented = any(segment_of(t) is not None for t in applied.blocks.values())
    if segmented:   # not simulated; its time is full's (every block recomputed once), its peak unknown
        applied = Plan(blocks={n: "full" if segment_of(t) is not None else t for n, t in applied.blocks.items()},
                       head=applied.head, chunk_tokens=applied.chunk_tokens)
    now = simulate(prof, applied)
    keep = simulate(prof, Plan(blocks={n: "keep" for n in prof.block_names}, head=applied.head,
                               chunk_tokens=applied.chunk_tokens))
    if keep.peak_bytes <= budget:
        lost = max(0.0, 1 - keep.step_s / now.step_s) if now.step_s else 0.0
        return [Finding(
            check="keep-fits", severity="warning", cost=lost,
            what=f"{source} recomputes, but keeping every activation fits {format_size(budget)} at this batch "
                 f"(predicted peak {format_size(keep.peak_bytes)})",
            why=f"the recomputation buys nothing here: about {lost:.0%} of the step time is thrown away "
                f"({now.step_s * 1e3:.1f} ms against {keep.step_s * 1e3:.1f} ms predicted"
                + (", the segments timed as full: each block recomputed once" if segmented else "") + ")",
            fix="turn checkpointing off (gradient_checkpointing=False / remat.remove(model)), or let remat plan it: "
                f"remat.auto(model, batch, budget='{format_size(budget)}')")]
    if segmented:
        return [_not_checked(
            "faster-plan", f"{source} is a segments plan, which remat applies as given and does not simulate",
            "there is no predicted peak or step time to compare another plan with (no block cost describes K "
            "blocks recomputed at once)",
            f"to compare, plan per block: remat.plan(model, batch, budget='{format_size(budget)}') gives the "
            "fastest plan that fits with its predicted peak and time")]
    try:
        best = solve(prof, budget)
    except NoPlanFits:
        return []
    best_s = best.notes["predicted_step_s"]
    if now.step_s and best_s < now.step_s * (1 - FASTER):
        gain = 1 - best_s / now.step_s
        return [Finding(
            check="faster-plan", severity="warning", cost=gain,
            what=f"{source} fits {format_size(budget)}, but the plan {best.summary()} fits it too and is "
                 f"predicted {gain:.0%} faster",
            why=f"predicted step {now.step_s * 1e3:.1f} ms now against {best_s * 1e3:.1f} ms "
                f"(peak {format_size(best.notes['predicted_peak_bytes'])})",
            fix=f"remat.auto(model, batch, budget='{format_size(budget)}') (or RematCallback(budget=...) in a Trainer)")]
    return []


def _not_checked(checks, what, why, fix) -> Finding:
    return Finding(check="plans-not-checked", severity="note", cost=0.0,
                   what=f"not checked against the budget ({checks}): {what}", why=why, fix=fix)


# -- the applied plan, measured (CUDA) -----------------------------------------------------
def check_prediction(model, batch, loss_fn) -> list:
    """The applied plan's peak and step time measured against its prediction, the model run as it
    will train (compiled or not)."""
    from remat.profiling.snapshot import preserved
    from remat.units import format_size
    plan = applied_plan(model)
    if plan is None or "predicted_peak_bytes" not in plan.notes:
        return []
    device = next(model.parameters()).device
    times = []
    with preserved(model):
        model.train()
        for _ in range(3):   # the first one warms up
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            step_loss(model, batch, loss_fn).backward()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        for p in model.parameters():
            p.grad = None
        peak = torch.cuda.max_memory_allocated(device)
    step = sorted(times[1:])[len(times[1:]) // 2]
    findings = []
    predicted_peak, predicted_s = plan.notes["predicted_peak_bytes"], plan.notes.get("predicted_step_s")
    off_peak = abs(peak - predicted_peak) / predicted_peak
    if off_peak > OFF:
        findings.append(Finding(
            check="prediction-off", severity="warning", cost=off_peak,
            what=f"measured peak {format_size(peak)} against the plan's predicted {format_size(predicted_peak)} "
                 f"({off_peak:.0%} off)",
            why="the plan was chosen for a peak that is not the one that runs: the budget may not hold",
            fix="re-plan at the batch that runs (remat.plan with this batch, on this GPU), and report it if it "
                "stays off"))
    if predicted_s:
        off_time = abs(step - predicted_s) / predicted_s
        if off_time > OFF:
            findings.append(Finding(
                check="prediction-off", severity="note", cost=off_time,
                what=f"measured step {step * 1e3:.1f} ms against the plan's predicted {predicted_s * 1e3:.1f} ms "
                     f"({off_time:.0%} off)",
                why="the plan's choice between treatments rests on the predicted times",
                fix="plan on the GPU that trains (its rates are measured there), at the batch that runs"))
    return findings
