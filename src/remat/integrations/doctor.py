"""``remat doctor``: what is wrong with a training setup's memory and recomputation, worst first.

    findings = doctor(model, batch, training_args=args, budget="40GiB")
    for f in findings:
        print(f)            # severity, what, why it matters, the fix

Each check reads the model (its remat plan, Hugging Face checkpointing switches and their
keyword arguments, frozen parameters, dropout, config) and, when given, ``TrainingArguments``
and an accelerate config; with a batch, one real training step (forward and backward, the
model's parameters, gradients, buffers and RNG put back afterwards: see
:func:`remat.profiling.snapshot.preserved`); with a budget, remat's profile of the model at
that batch. A good setup gets an empty list. The checks, cheapest to state first:

- ``no-grad``: a parameter with ``requires_grad`` gets no gradient in the step (an adapter cut
  off by reentrant checkpointing, a module the forward never reaches).
- ``use-cache``: ``config.use_cache`` is on while training: transformers warns and turns it off
  under its checkpointing; remat drops the cache in treated blocks, untreated ones build it.
- ``hf-and-fsdp-checkpointing``: ``gradient_checkpointing`` / ``activation_checkpointing`` and
  FSDP's ``activation_checkpointing`` both on: every block recomputed twice (transformers 5
  refuses the pair when it builds the accelerator).
- ``reentrant-frozen-inputs``: reentrant checkpointing (``use_reentrant=True``) on a model whose
  input embeddings are frozen (LoRA) without ``enable_input_require_grads``: the checkpointed
  blocks' inputs do not require grad, so the adapters inside get no gradient.
- ``rng-not-preserved``: ``preserve_rng_state=False`` with dropout: the recomputed forward draws
  other dropout masks than the forward did, and the gradients are wrong.
- ``head-bypassed``: remat's chunked head sits under TRL's fused LM head, which never calls it.
- ``keep-fits``: checkpointing is on but keeping every activation fits the budget: the
  recomputation (20-30% of a step) buys nothing.
- ``faster-plan``: another plan fits the same budget with a predicted step time at least 5%
  shorter than the applied one (Hugging Face checkpointing counts as ``full`` on every block).
- ``prediction-off``: (``run_step=True`` on CUDA, a remat plan applied) the measured peak or
  step time is more than 10% from the plan's prediction.

Ordering: errors (wrong results or a crash to come) before warnings (memory or time lost)
before notes; within a severity, by ``cost``: the fraction of the step's time or memory at
stake, as far as remat can estimate it.

Limits: the step, the profile and the measurement run on the model as it is (its device, its
dtype); a model on the ``meta`` device can be profiled but not stepped.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

SEVERITIES = ("error", "warning", "note")
_FASTER = 0.05      # a plan this much faster than the applied one is worth a finding
_OFF = 0.10         # measured vs predicted


@dataclass(frozen=True)
class Finding:
    """One problem ``doctor`` found."""

    check: str
    """Which check found it (``no-grad``, ``keep-fits`` ...: see the module docstring)."""
    severity: str
    """``error`` (wrong results or a crash to come), ``warning`` (memory or time lost) or ``note``."""
    cost: float
    """The fraction of the step's time or memory at stake (0..1; 1.0 for wrong results)."""
    what: str
    """What was found, with the names involved."""
    why: str
    """Why it matters."""
    fix: str
    """What to change."""

    def __str__(self):
        return f"[{self.severity}] {self.what}\n    why: {self.why}\n    fix: {self.fix}"


def doctor(model: nn.Module, batch=None, training_args=None, run_step: bool = False, budget=None, *,
           accelerate_config=None, loss_fn=None, gpu: Optional[str] = None, optimizer: str = "none") -> list:
    """Findings for ``model`` (and ``training_args``, an accelerate config dict), worst first.

    ``batch``: a training batch (dict of tensors or a tensor of ids); one real step is run on it
    (model state put back). ``budget``: the memory budget the setup must fit (bytes or
    ``"24GiB"``); with a batch, remat profiles the model to compare plans (``gpu``, ``optimizer``
    as :func:`remat.plan`). ``run_step``: on CUDA, also measure the applied plan's peak and step
    time against its prediction. ``loss_fn(model, batch)``: the step's loss (default: a Hugging
    Face model's ``.loss``, labels = input_ids when absent). Empty list: nothing found.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor expects a torch.nn.Module, got {type(model).__name__}")
    findings = []
    kwargs = _checkpoint_kwargs(model, training_args)
    findings += _check_training_args(training_args, accelerate_config)
    findings += _check_reentrant(model, training_args, kwargs)
    findings += _check_rng(model, training_args, kwargs)
    findings += _check_head_bypassed(model)
    if batch is not None and not _on_meta(model):
        findings += _check_step(model, batch, loss_fn)
    if batch is not None and budget is not None:
        findings += _check_plans(model, batch, budget, training_args, loss_fn, gpu, optimizer)
    if run_step and batch is not None and _on_cuda(model):
        findings += _check_prediction(model, batch, loss_fn)
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), -f.cost))


# -- what the setup asks for -----------------------------------------------------------------
def _hf_checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _args_checkpointing(training_args) -> bool:
    return bool(training_args is not None and (getattr(training_args, "activation_checkpointing", False)
                                               or getattr(training_args, "gradient_checkpointing", False)))


def _checkpoint_kwargs(model: nn.Module, training_args) -> dict:
    """The ``torch.utils.checkpoint`` keywords in force: the model's (HF checkpointing on), else
    those TrainingArguments will pass."""
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if getattr(m, "gradient_checkpointing", False) is True and fn is not None:
            return dict(getattr(fn, "keywords", {}) or {})
    if _args_checkpointing(training_args):
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            value = getattr(training_args, name, None)
            if isinstance(value, dict):
                return dict(value)
    return {}


def _check_training_args(training_args, accelerate_config) -> list:
    fsdp_ac = False
    if training_args is not None:
        config = getattr(training_args, "fsdp_config", None) or {}
        fsdp_ac = bool(getattr(training_args, "fsdp", None)) and _truthy(config.get("activation_checkpointing"))
    if isinstance(accelerate_config, dict):
        fsdp = accelerate_config.get("fsdp_config") or {}
        fsdp_ac = fsdp_ac or _truthy(fsdp.get("fsdp_activation_checkpointing", fsdp.get("activation_checkpointing")))
    if not (fsdp_ac and _args_checkpointing(training_args)):
        return []
    return [Finding(
        check="hf-and-fsdp-checkpointing", severity="error", cost=0.25,
        what="TrainingArguments turn on gradient_checkpointing (activation_checkpointing in transformers 5) and "
             "FSDP's activation_checkpointing as well",
        why="each block would be recomputed twice in backward (transformers 5 refuses the pair when it builds "
            "the accelerator)",
        fix="keep one: fsdp_config={'activation_checkpointing': True} with gradient_checkpointing=False, or "
            "remat (RematCallback / remat.apply before FSDP) with both off")]


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _frozen_inputs(model: nn.Module) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        embeddings = None
    if embeddings is None or getattr(embeddings, "weight", None) is None:
        return False
    trainable = any(p.requires_grad for p in model.parameters())
    fixed = not embeddings.weight.requires_grad
    hooked = getattr(model, "_require_grads_hook", None) is not None or any(
        getattr(m, "_require_grads_hook", None) is not None for m in model.modules())
    return trainable and fixed and not hooked


def _enable_adds_input_grads(model: nn.Module) -> bool:
    """Whether this transformers' checkpointing switch calls ``enable_input_require_grads`` for a
    text model (transformers 5 does; 4.x did only for its own PEFT integration)."""
    import inspect
    for m in model.modules():
        for name in ("_activation_checkpointing_enable", "gradient_checkpointing_enable"):
            method = getattr(type(m), name, None)
            if method is None:
                continue
            try:
                source = inspect.getsource(method)
            except (OSError, TypeError):
                continue
            if "needs_embedding_grads" in source and "enable_input_require_grads()" in source:
                return True
    return False


def _check_reentrant(model, training_args, kwargs) -> list:
    if kwargs.get("use_reentrant") is not True or not _frozen_inputs(model):
        return []
    on_model = _hf_checkpointing_on(model)
    if not on_model and not (_args_checkpointing(training_args) and not _enable_adds_input_grads(model)):
        return []   # the Trainer's enable call will add the input-grad hook itself
    return [Finding(
        check="reentrant-frozen-inputs", severity="error", cost=1.0,
        what="reentrant checkpointing (use_reentrant=True) on a model whose input embeddings are frozen (LoRA) "
             "and no enable_input_require_grads()",
        why="a reentrant checkpoint only back-propagates into its tensor inputs that require grad; the hidden "
            "states do not, so the adapters inside checkpointed blocks get no gradient and do not train",
        fix="use_reentrant=False in gradient_checkpointing_kwargs, or call model.enable_input_require_grads(), "
            "or use remat (non-reentrant, frozen inputs handled)")]


def _has_dropout(model: nn.Module) -> bool:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
    config = getattr(model, "config", None)
    return any(float(getattr(config, name, 0) or 0) > 0
               for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"))


def _check_rng(model, training_args, kwargs) -> list:
    if kwargs.get("preserve_rng_state", True) is not False or not _has_dropout(model):
        return []
    if not (_hf_checkpointing_on(model) or _args_checkpointing(training_args)):
        return []
    return [Finding(
        check="rng-not-preserved", severity="error", cost=1.0,
        what="checkpointing with preserve_rng_state=False on a model with dropout",
        why="the recomputed forward draws other dropout masks than the forward did, so the gradients belong "
            "to no forward that ran",
        fix="drop preserve_rng_state from gradient_checkpointing_kwargs (the default, True, is right), or use "
            "remat, which always preserves it")]


def _check_head_bypassed(model) -> list:
    try:
        from remat.integrations.hf import remat_head_bypassed
    except ImportError:
        return []
    if not remat_head_bypassed(model):
        return []
    return [Finding(
        check="head-bypassed", severity="warning", cost=0.1,
        what="remat's chunked head is applied under TRL's fused LM head, which computes the loss from the "
             "backbone itself and never calls it",
        why="the plan's head memory and time are not what runs; remat's head is dead code in this model",
        fix="apply remat with head='plain' (TRL's fused head already avoids the full logits), or train with "
            "remat.integrations.hf.RematCallback, which does this")]


# -- one real step ---------------------------------------------------------------------------
def _loss(model, batch, loss_fn):
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


def _check_step(model, batch, loss_fn) -> list:
    from remat.profiling.snapshot import preserved
    findings = []
    with preserved(model):
        model.train()
        out_loss = _loss(model, batch, loss_fn)
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


def _check_plans(model, batch, budget, training_args, loss_fn, gpu, optimizer) -> list:
    from remat.api import current_plan
    from remat.planning.plans import Plan
    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits, solve
    from remat.profiling.profiler import profile
    from remat.units import format_size, parse_budget
    budget = parse_budget(budget)
    applied = current_plan(model)
    hf = _hf_checkpointing_on(model) or _args_checkpointing(training_args)
    if applied is None and not hf:
        return []
    with _hf_checkpointing_off(model):
        prof = profile(model, batch, loss_fn=loss_fn, gpu=gpu, optimizer=optimizer)
    if applied is None or hf:
        applied = Plan(blocks={name: "full" for name in prof.block_names}, head="plain")
        source = "Hugging Face checkpointing (full on every block)"
    else:
        source = f"the applied remat plan ({applied.summary()})"
    if all(t == "keep" for t in applied.blocks.values()):
        return []
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
                f"({now.step_s * 1e3:.1f} ms against {keep.step_s * 1e3:.1f} ms predicted)",
            fix="turn checkpointing off (gradient_checkpointing=False / remat.remove(model)), or let remat plan it: "
                f"remat.auto(model, batch, budget='{format_size(budget)}')")]
    try:
        best = solve(prof, budget)
    except NoPlanFits:
        return []
    best_s = best.notes["predicted_step_s"]
    if now.step_s and best_s < now.step_s * (1 - _FASTER):
        gain = 1 - best_s / now.step_s
        return [Finding(
            check="faster-plan", severity="warning", cost=gain,
            what=f"{source} fits {format_size(budget)}, but the plan {best.summary()} fits it too and is "
                 f"predicted {gain:.0%} faster",
            why=f"predicted step {now.step_s * 1e3:.1f} ms now against {best_s * 1e3:.1f} ms "
                f"(peak {format_size(best.notes['predicted_peak_bytes'])})",
            fix=f"remat.auto(model, batch, budget='{format_size(budget)}') (or RematCallback(budget=...) in a Trainer)")]
    return []


# -- the applied plan, measured (CUDA) -----------------------------------------------------
def _check_prediction(model, batch, loss_fn) -> list:
    from remat.api import current_plan
    from remat.profiling.snapshot import preserved
    from remat.units import format_size
    plan = current_plan(model)
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
            _loss(model, batch, loss_fn).backward()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        for p in model.parameters():
            p.grad = None
        peak = torch.cuda.max_memory_allocated(device)
    step = sorted(times[1:])[len(times[1:]) // 2]
    findings = []
    predicted_peak, predicted_s = plan.notes["predicted_peak_bytes"], plan.notes.get("predicted_step_s")
    off_peak = abs(peak - predicted_peak) / predicted_peak
    if off_peak > _OFF:
        findings.append(Finding(
            check="prediction-off", severity="warning", cost=off_peak,
            what=f"measured peak {format_size(peak)} against the plan's predicted {format_size(predicted_peak)} "
                 f"({off_peak:.0%} off)",
            why="the plan was chosen for a peak that is not the one that runs: the budget may not hold",
            fix="re-plan at the batch that runs (remat.plan with this batch, on this GPU), and report it if it "
                "stays off"))
    if predicted_s:
        off_time = abs(step - predicted_s) / predicted_s
        if off_time > _OFF:
            findings.append(Finding(
                check="prediction-off", severity="note", cost=off_time,
                what=f"measured step {step * 1e3:.1f} ms against the plan's predicted {predicted_s * 1e3:.1f} ms "
                     f"({off_time:.0%} off)",
                why="the plan's choice between treatments rests on the predicted times",
                fix="plan on the GPU that trains (its rates are measured there), at the batch that runs"))
    return findings


def _on_meta(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "meta"


def _on_cuda(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"
