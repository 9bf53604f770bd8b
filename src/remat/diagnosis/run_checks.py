"""The checks of :func:`remat.diagnosis.doctor` that run the model: one real training
step, remat's profile at a budget, and the applied plan measured on CUDA.

:mod:`remat.diagnosis.checkup` holds the entry (the ordering) and the checks that only read the
setup, :mod:`remat.diagnosis.findings` what a finding is; this module the ones that cost a step
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

from remat.api import batch_check_held, hf_argument_name
from remat.diagnosis.findings import Finding, applied_plan
from remat.planning.plans import Plan
from remat.treat import patches

FASTER = 0.05      # a plan this much faster than the applied one is worth a finding
OFF = 0.10         # measured vs predicted


@contextlib.contextmanager
def eager(model):
    """``model`` with every in-place compile (``Module.compile()``) set aside: its modules run eagerly."""
    compiled = [m for m in model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
    with patches.compiled_calls((m, None) for m in compiled):
        yield


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
    with preserved(model), eager(model), batch_check_held(model):
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
    if getattr(config, "use_cache", False) is True and applied_plan(model) is None:   # with remat: fine (README)
        findings.append(Finding(
            check="use-cache", severity="note", cost=0.01,
            what=f"{type(model).__name__}.config.use_cache is True during training, without remat",
            why="a training forward builds a key/value cache nobody reads (transformers warns and turns it off "
                "under its own checkpointing); with remat applied it is fine: a treated block gets a view of the "
                "model's cache (it reads the caller's layers, writes copies of its own), so a recompute appends "
                "to nothing twice",
            fix="model.config.use_cache = False before training (TRL's SFTTrainer passes use_cache=False itself), "
                "or apply remat"))
    return findings


# -- plans: remat's profile at this batch and budget ---------------------------------------
@contextlib.contextmanager
def hf_checkpointing_off(model):
    """Hugging Face checkpointing off in every module of ``model`` inside the block, as it was after."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in on:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True


def check_plans(model, batch, budget, training_args, loss_fn, gpu, optimizer, compiled: bool, callback=None,
                fsdp_world: int = 1, accelerate_config=None) -> list:
    """The setup's predicted peak against ``budget`` (``does-not-fit``), then whether its recomputation
    is needed (``keep-fits``) or a faster plan fits (``faster-plan``). The setup is, first that applies:
    ``callback`` (the plan a ``RematCallback`` makes for this batch at its budget, or its spec), Hugging
    Face checkpointing (``full`` on every block, the model's own head), the applied remat plan, or the
    model untouched (``keep``, its own head). Its peak is :func:`remat.simulate`'s on the profile that
    ``remat estimate`` makes of the same model and batch, so the two agree to the byte.

    Checkpointing outside remat is read as it is (:func:`remat.diagnosis.findings.checkpointing_of`):
    Hugging Face's per-layer flags (``every_n_layers``: remat's ``every:N``), ``offload=True`` and
    accelerate's FSDP2 checkpoint offload as ``full+offload`` with the host copies on the compute stream
    (``save_on_cpu`` copies synchronously: their time is added, not hidden), Liger's ``use_liger_kernel``
    as the chunked head (its fused loss never builds the logits; its other kernels are not modelled). A
    setup that uses one of these gets a ``setup-vs-plan`` note: its predicted peak and step beside
    remat's plan at the same budget."""
    from remat.planning.plans import segment_of
    from remat.planning.simulator import simulate
    from remat.units import format_size, parse_budget
    budget = parse_budget(budget)
    if compiled:
        return [_not_checked(
            "does-not-fit, keep-fits, faster-plan", "the model runs compiled and remat's profile here is eager",
            "compile changes every treatment's memory and time, so eager numbers would judge the wrong step",
            f"on the GPU, remat.plan(model, batch, budget='{format_size(budget)}', compile=True) (remat plan "
            "--compile) gives the fastest plan for a compiled step; compare its notes['predicted_step_s']")]
    prof = _profile(model, batch, loss_fn, gpu, optimizer, fsdp_world, applied_plan(model))
    setup, source, refused = _setup(model, batch, prof, budget, training_args, callback, accelerate_config)
    if refused is not None:
        return [refused]
    side = _side_by_side(model, batch, prof, budget, training_args, accelerate_config, setup, source, callback)
    segmented = any(segment_of(t) is not None for t in setup.blocks.values())
    if segmented:   # not simulated; its time is full's (every block recomputed once), its peak unknown
        setup = Plan(blocks={n: "full" if segment_of(t) is not None else t for n, t in setup.blocks.items()},
                     head=setup.head, chunk_tokens=setup.chunk_tokens, tile_tokens=setup.tile_tokens)
    now = simulate(prof, setup)
    now_s = now.step_s + (synchronous_copy_s(prof, now) if side is not None and side.offload else 0.0)
    if now.peak_bytes > budget and not segmented:
        return [_does_not_fit(model, batch, prof, budget, source, now)] + side.findings(now, now_s)
    if all(t == "keep" for t in setup.blocks.values()) or side.liger:
        # Liger's fused kernels are not timed here: no faster or needless plan is claimed against them
        return side.findings(now, now_s)
    keep = simulate(prof, Plan(blocks={n: "keep" for n in prof.block_names}, head=setup.head,
                               chunk_tokens=setup.chunk_tokens))
    if keep.peak_bytes <= budget:
        lost = max(0.0, 1 - keep.step_s / now_s) if now_s else 0.0
        return [Finding(
            check="keep-fits", severity="warning", cost=lost,
            what=f"{source} recomputes, but keeping every activation fits {format_size(budget)} at this batch "
                 f"(predicted peak {format_size(keep.peak_bytes)})",
            why=f"the recomputation buys nothing here: about {lost:.0%} of the step time is thrown away "
                f"({now_s * 1e3:.1f} ms against {keep.step_s * 1e3:.1f} ms predicted"
                + (", the segments timed as full: each block recomputed once" if segmented else "") + ")",
            fix=f"turn checkpointing off ({hf_argument_name()}=False / remat.remove(model)), or let remat plan it: "
                f"remat.auto(model, batch, budget='{format_size(budget)}')",
            predicted_peak_bytes=keep.peak_bytes, budget_bytes=budget)] + side.findings(now, now_s)
    if segmented:
        return [_not_checked(
            "does-not-fit, faster-plan", f"{source} is a segments plan, which remat applies as given and does "
                                         "not simulate",
            "there is no predicted peak or step time to compare another plan with (no block cost describes K "
            "blocks recomputed at once)",
            f"to compare, plan per block: remat.plan(model, batch, budget='{format_size(budget)}') gives the "
            "fastest plan that fits with its predicted peak and time")]
    best = side.best if side.best is not None else _best_plan(model, batch, prof, budget)
    if best is None:
        return side.findings(now, now_s)
    best_s = best.notes["predicted_step_s"]
    if now_s and best_s < now_s * (1 - FASTER):
        gain = 1 - best_s / now_s
        return [Finding(
            check="faster-plan", severity="warning", cost=gain,
            what=f"{source} fits {format_size(budget)} (predicted peak {format_size(now.peak_bytes)}), but the "
                 f"plan {best.summary()} fits it too and is predicted {gain:.0%} faster",
            why=f"predicted step {now_s * 1e3:.1f} ms now against {best_s * 1e3:.1f} ms "
                f"(peak {format_size(best.notes['predicted_peak_bytes'])})",
            fix=f"remat.auto(model, batch, budget='{format_size(budget)}') (or RematCallback(budget=...) in a Trainer)",
            predicted_peak_bytes=now.peak_bytes, budget_bytes=budget)] + side.findings(now, now_s)
    return side.findings(now, now_s)


def _profile(model, batch, loss_fn, gpu, optimizer, fsdp_world, applied=None):
    """remat's profile of the model as it would train, Hugging Face checkpointing and any compile set
    aside (the profile measures each treatment itself), sharded for ``fsdp_world`` ranks. With the
    ``applied`` plan's kernels: a plan on Liger's kernels (or its ``liger`` head) is simulated on blocks
    and a head measured with them, as :func:`remat.plan` measured them."""
    from remat.planning.kernels import with_kernels
    from remat.profiling.profiler import block_param_bytes, profile
    kernels = _kernels_of(applied)
    with hf_checkpointing_off(model), eager(model), batch_check_held(model):
        prof = profile(model, batch, loss_fn=loss_fn, gpu=gpu, optimizer=optimizer, kernels=kernels)
    if kernels is not None and prof.kernel_variants:   # each block class on the kernels the plan gives it
        choice = {}
        for name, cls in zip(prof.block_names, prof.block_class):
            choice.setdefault(cls, applied.kernel_of(name))
        prof = with_kernels(prof, choice)
    if fsdp_world != 1:
        from remat.planning.sharding import shard
        prof = shard(prof, fsdp_world, block_param_bytes(model, prof))
    return prof


def _kernels_of(plan):
    """The kernels to profile ``plan`` with: None (the modules as they are) for a stock plan, else each
    kernel its blocks run, ``liger`` where its head is Liger's fused loss (``stock`` first)."""
    if plan is None:
        return None
    names = {plan.kernel_of(name) for name in plan.blocks} | ({"liger"} if plan.head == "liger" else set())
    return None if names <= {"stock"} else tuple(sorted(names, key=lambda k: (k != "stock", k)))


def _setup(model, batch, prof, budget, training_args, callback, accelerate_config=None):
    """``(plan, words, finding)``: the plan that will run and how to name it, or a finding when the
    setup will refuse to run (a callback whose budget nothing fits)."""
    from remat.diagnosis.findings import checkpointing_of, liger_on
    from remat.planning.plans import resolve
    from remat.planning.solver import NoPlanFits
    from remat.units import format_size
    if callback is not None:
        if getattr(callback, "spec", None) is not None:
            plan = resolve(callback.spec, prof.block_names, strict=False)
            head = callback.head or "plain"
            return (Plan(blocks=plan.blocks, head=head, chunk_tokens=plan.chunk_tokens if head == "chunked" else None,
                         tile_tokens=plan.tile_tokens),
                    f"the callback's spec ({plan.summary()})", None)
        wanted = callback.budget if getattr(callback, "budget", None) is not None else budget
        heads = [callback.head] if getattr(callback, "head", None) else None
        try:
            plan = _plan_profiled(model, batch, prof, wanted, heads=heads)
        except NoPlanFits as e:
            return None, None, Finding(
                check="does-not-fit", severity="error", cost=1.0,
                what=f"does not fit: RematCallback(budget='{format_size(wanted)}') finds no plan for this batch "
                     f"({prof.batch} x {prof.seq}); it stops at the first training batch, as remat.plan does",
                why=f"the smallest predicted peak of any plan is {format_size(e.smallest_peak)} ({e.plan.summary()}), "
                    f"static memory alone {format_size(prof.static_bytes)}",
                fix=_floor_fix(e, prof),
                predicted_peak_bytes=e.smallest_peak, budget_bytes=wanted)
        return plan, f"RematCallback's plan at {format_size(wanted)} ({plan.summary()})", None
    applied = applied_plan(model)
    ckpt = checkpointing_of(model, training_args, accelerate_config)
    liger = liger_on(training_args) and _chunked_head(prof) is not None
    head = dict(head="chunked", chunk_tokens=_chunked_head(prof)) if liger else dict(head="plain")
    with_liger = " with Liger's kernels (use_liger_kernel)" if liger else ""
    if ckpt is not None:
        treatment = "full+offload" if ckpt.offload else "full"
        blocks = {name: treatment if ckpt.checkpoints(i, name) else "keep" for i, name in enumerate(prof.block_names)}
        count = sum(t != "keep" for t in blocks.values())
        where = "every block" if count == len(blocks) else f"{count} of {len(blocks)} blocks"
        return (Plan(blocks=blocks, **head),
                f"{ckpt.source} ({treatment} on {where}{', offloaded synchronously' if ckpt.offload else ''})"
                f"{with_liger}", None)
    if applied is not None:
        return applied, f"the applied remat plan ({applied.summary()})", None
    return (Plan(blocks={name: "keep" for name in prof.block_names}, **head),
            f"the model as it is (no checkpointing){with_liger}", None)


def _chunked_head(prof):
    """The chunk of the profile's chunked head (None: the model has none)."""
    for head in prof.heads:
        if head.mode == "chunked":
            return head.chunk_tokens
    return None


def synchronous_copy_s(prof, sim) -> float:
    """Seconds the host copies of ``sim``'s offloaded bytes add when they run on the compute stream
    (``save_on_cpu``: down in forward, up in backward, nothing overlapped), beyond what remat's
    asynchronous engine leaves exposed."""
    rates = prof.rates
    return max(0.0, sim.offload_bytes * (1 / rates.d2h_Bps + 1 / rates.h2d_Bps) - sim.exposed_copy_s)


class _SideBySide:
    """The ``setup-vs-plan`` note of a setup that uses one of the new flags: its prediction and remat's."""

    def __init__(self, budget, source, how, best, offload, liger):
        self.budget, self.source, self.how, self.best, self.offload = budget, source, how, best, offload
        self.liger = liger

    def findings(self, now, now_s) -> list:
        from remat.units import format_size as f
        if self.best is not None:
            n = self.best.notes
            plan = (f"remat's plan at {f(self.budget)}: {self.best.summary()}, peak {f(n['predicted_peak_bytes'])}, "
                    f"step {n['predicted_step_s'] * 1e3:.1f} ms")
        else:
            plan = f"remat finds no plan within {f(self.budget)}"
        return [Finding(
            check="setup-vs-plan", severity="note", cost=0.0,
            what=f"{self.source}: predicted peak {f(now.peak_bytes)}, step {now_s * 1e3:.1f} ms; {plan}",
            why="read as remat models it: " + "; ".join(self.how),
            fix=("to compare on the kernels that run, patch the model with Liger first (liger_kernel.transformers."
                 "apply_liger_kernel_to_<family>(...)), then remat.plan(model, batch, budget) on the GPU: remat "
                 "measures the patched model's own kernels" if self.liger else
                 f"remat.auto(model, batch, budget='{f(self.budget)}'), or RematCallback(budget='{f(self.budget)}') in "
                 f"a Trainer with {hf_argument_name()}=False"),
            predicted_peak_bytes=now.peak_bytes, budget_bytes=self.budget)]


class _Silent:
    """No new flag: no note."""
    best = None
    offload = False
    liger = False

    def findings(self, now, now_s) -> list:
        return []


def _side_by_side(model, batch, prof, budget, training_args, accelerate_config, setup, source, callback):
    from remat.diagnosis.findings import checkpointing_of, liger_on
    if callback is not None:
        return _Silent()
    ckpt = checkpointing_of(model, training_args, accelerate_config)
    liger = liger_on(training_args)
    if not (liger or (ckpt is not None and ckpt.new_flags)):
        return _Silent()
    how = []
    if ckpt is not None and ckpt.every_n_layers != 1:
        how.append(f"every_n_layers={ckpt.every_n_layers} checkpoints blocks 0, {ckpt.every_n_layers}, "
                   f"{2 * ckpt.every_n_layers} ... and keeps the rest, remat's 'every:{ckpt.every_n_layers}'")
    if ckpt is not None and "FSDP2" in ckpt.source:
        how.append("accelerate wraps every FSDP2 unit (each block) in checkpoint_wrapper: full on every block")
    if ckpt is not None and ckpt.offload:
        how.append("the checkpoints' saved inputs go to pinned host memory through save_on_cpu, copied on the "
                   "compute stream: remat's full+offload with its copies added to the step, not hidden")
    if liger:
        how.append("use_liger_kernel: Liger's fused linear cross-entropy never builds the logits, read as remat's "
                   "chunked head; its fused RMSNorm, SwiGLU and RoPE kernels are not modelled (their memory and "
                   "speed are Liger's own: the peak is an upper bound, the step a stock-kernel estimate)")
    best = _best_plan(model, batch, prof, budget)
    return _SideBySide(budget, source, how, best, offload=bool(ckpt is not None and ckpt.offload), liger=liger)


def _plan_profiled(model, batch, prof, budget, heads=None):
    """What remat.plan gives for ``budget`` from ``prof`` (no second profile)."""
    from remat.planner import plan
    return plan(model, batch, budget, profiled=prof, heads=heads)


def _best_plan(model, batch, prof, budget):
    from remat.planning.solver import NoPlanFits
    try:
        return _plan_profiled(model, batch, prof, budget)
    except NoPlanFits:
        return None


def _does_not_fit(model, batch, prof, budget, source, now) -> Finding:
    from remat.planning.solver import NoPlanFits
    from remat.units import format_size as f
    terms = now.peak_terms()
    why = (f"the step would run out of memory: the peak is set in {now.peak_at}, static {f(terms['static'])} "
           f"(parameters, buffers, optimizer state) + {f(terms['carried'])} kept by earlier phases + "
           f"{f(terms['phase'])} of its own")
    try:
        best = _plan_profiled(model, batch, prof, budget)
    except NoPlanFits as e:
        fix = _floor_fix(e, prof)
    else:
        n = best.notes
        fix = (f"the plan {best.summary()} fits: predicted peak {f(n['predicted_peak_bytes'])}, step "
               f"{n['predicted_step_s'] * 1e3:.0f} ms (the setup that does not fit: {now.step_s * 1e3:.0f} ms). "
               f"remat.auto(model, batch, budget='{f(budget)}'), RematCallback(budget='{f(budget)}') in a Trainer, "
               f"or `remat plan ... --budget {f(budget).replace(' ', '')} --out plan.json`")
    return Finding(
        check="does-not-fit", severity="error", cost=1.0,
        what=f"does not fit: predicted {f(now.peak_bytes)} > budget {f(budget)} for {source} at batch "
             f"{prof.batch} x {prof.seq}",
        why=why, fix=fix, predicted_peak_bytes=now.peak_bytes, budget_bytes=budget)


def _floor_fix(error, prof) -> str:
    from remat.units import format_size as f
    fixes = [f"raise the budget to at least {f(error.smallest_peak)}", "shorten the batch or sequence"]
    if prof.optimizer == "adamw":
        fixes.append("count 8-bit optimizer state (adamw8bit)")
    if prof.comm is None:
        fixes.append("shard the model over ranks (remat.plan(..., fsdp_world=N) / --fsdp N)")
    return (f"no plan fits: the floor is {f(error.smallest_peak)} ({error.plan.summary()}). To fit: "
            + ", ".join(fixes))


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


# -- no batch: what every plan keeps --------------------------------------------------------
def check_static(model, budget, optimizer) -> list:
    """Without a batch: parameters, buffers, their gradients and the optimizer state against the
    budget -- what every plan keeps, whatever it recomputes."""
    from remat.planning.costs import optimizer_state_bytes
    from remat.profiling.profiler import trainable_shapes
    from remat.units import format_size as f, parse_budget
    budget = parse_budget(budget)
    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = optimizer_state_bytes(optimizer, trainable_shapes(model))
    floor = weights + grads + state
    if floor <= budget:
        return []
    return [Finding(
        check="does-not-fit", severity="error", cost=1.0,
        what=f"does not fit: weights {f(weights)}, their gradients {f(grads)} and optimizer state {f(state)} "
             f"alone are {f(floor)} > budget {f(budget)}",
        why="every plan keeps these for the whole step, whatever it recomputes; activations come on top",
        fix="a larger budget, sharding over ranks (remat.plan(..., fsdp_world=N) / --fsdp N), fewer trainable "
            "parameters (LoRA) or 8-bit optimizer state; pass a batch to see the whole step's peak",
        predicted_peak_bytes=floor, budget_bytes=budget)]
