"""``remat doctor``: what is wrong with a training setup's memory and recomputation, worst first.

    findings = doctor(model, batch, training_args=args, budget="40GiB")
    for f in findings:
        print(f)            # severity, what, why it matters, the fix

Each check reads the model (its remat plan, Hugging Face checkpointing switches and their keyword
arguments, frozen parameters, dropout, config) and, when given, ``TrainingArguments`` and an
accelerate config; with a batch, one real training step (parameters, gradients, buffers and RNG
put back afterwards: :func:`remat.profiling.snapshot.preserved`); with a budget, remat's profile of
the model at that batch. A good setup gets an empty list.

The checks, by each finding's ``check`` (what each means: docs/design/diagnosis.md): the plan
against the setup (``does-not-fit``, ``plan-mismatch``, ``plan-batch``, ``plan-dtype``, ``plan-gpu``,
``plan-versions``, ``compile-mismatch``); the gradients (``no-grad``, ``reentrant-frozen-inputs``,
``rng-not-preserved``, ``wrong-gradients``); switches that cost memory or time (``use-cache``,
``hf-and-fsdp-checkpointing``, ``head-bypassed``, ``compiled-blocks-cache``, ``fsdp-eager-selective``,
``compiled-attention-mask``); the plan's speed (``keep-fits``, ``faster-plan``, ``setup-vs-plan``,
``prediction-off``, ``plans-not-checked``).

Layout: the checks that only read the setup live here with the entry; those of how the model is
compiled or sharded in :mod:`remat.diagnosis.compile_checks`; those that run a step, a profile or
a measurement in :mod:`remat.diagnosis.run_checks`; what a finding is, and the readings of the
model the checks share, in :mod:`remat.diagnosis.findings`. Errors (wrong results, a crash to come)
come before warnings (memory or time lost), then notes; within each, by ``cost`` (the fraction at stake).

Limits: everything runs on the model as it is (its device, its dtype); a ``meta`` model can be
profiled but not stepped; a compiled model is stepped and profiled eagerly (compiling would take
minutes and measure nothing they need), only ``run_step``'s measurement runs it compiled.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from remat.diagnosis import compile_checks as compiling, run_checks as runs, verification
from remat.diagnosis.findings import (SEVERITIES, Finding, args_checkpointing, compile_scope_of, hf_checkpointing_on,
                                      unwrapped)


def doctor(model: nn.Module, batch=None, training_args=None, run_step: bool = False, budget=None, *,
           accelerate_config=None, loss_fn=None, gpu: Optional[str] = None, optimizer: str = "none",
           compiled: Optional[bool] = None, callback=None, fsdp_world: int = 1, verify: bool = False) -> list:
    """What is wrong with ``model``'s training setup (memory, recomputation, gradients), worst first.

    Args:
        model: the ``nn.Module`` to train (a ``torch.compile`` wrapper is read through).
        batch: a training batch (dict of tensors or a tensor of ids); one real step is run on it,
            the model's state put back. Without it only the setup is read.
        training_args: the Trainer's ``TrainingArguments`` (checkpointing switches, Liger, FSDP).
        run_step: on CUDA, also measure the applied plan's peak and step time against its prediction.
        budget: the memory the setup must fit (bytes or ``"24GiB"``); with a batch, remat profiles the
            model to compare plans (``gpu``, ``optimizer`` as :func:`remat.plan` takes them).
        accelerate_config: an accelerate config dict (FSDP2 activation checkpointing and its offload).
        loss_fn: ``loss_fn(model, batch)``, the step's loss (default: a Hugging Face model's ``.loss``,
            labels = input_ids when absent).
        compiled: whether training runs the model compiled; default: as it is now (a wrapper, or
            ``Module.compile()`` on it or its blocks); True for a model compiled after this call.
        callback: the :class:`~remat.integrations.hf.RematCallback` (or Lightning's) that will train
            the model: the setup judged is the plan it makes at its budget (default ``budget``).
        fsdp_world: the model is sharded over that many FSDP2 ranks (the budget is one rank's).
        verify: with a batch, also :func:`remat.verify` the setup as it is: ``wrong-gradients``.

    Returns:
        A list of :class:`~remat.diagnosis.Finding` (check, severity, what, why, fix), errors first;
        empty when nothing was found.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``callback`` is not a remat callback.

    Example:
        >>> for finding in doctor(model, batch, training_args=args, budget="40GiB"):  # doctest: +SKIP
        ...     print(finding)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor expects a torch.nn.Module as its first argument, got {type(model).__name__}; "
                        "call doctor(model, batch, budget=...)")
    if callback is not None and not hasattr(callback, "plan_if_longer"):
        raise TypeError(f"doctor's callback= takes a remat RematCallback (Hugging Face or Lightning), got "
                        f"{type(callback).__name__}")
    if budget is None and callback is not None and getattr(callback, "budget", None) is not None:
        budget = callback.budget
    scope = compile_scope_of(model) if compiled is None else None   # told, not seen: its scope is unknown
    compiled = bool(scope) if compiled is None else bool(compiled)
    inner = unwrapped(model)   # the step and the profile run the model itself, eagerly
    findings = []
    kwargs = _checkpoint_kwargs(inner, training_args)
    findings += _check_training_args(training_args, accelerate_config)
    findings += _check_reentrant(inner, training_args, kwargs)
    findings += _check_rng(inner, training_args, kwargs)
    findings += _check_fsdp_rng(inner, training_args, accelerate_config)
    findings += _check_head_bypassed(inner)
    findings += compiling.check_compile(inner, compiled, scope)
    findings += compiling.check_fsdp_selective(inner, compiled)
    findings += compiling.check_compiled_blocks_cache(inner, scope)
    findings += compiling.check_compiled_mask(inner, batch, compiled)
    findings += compiling.check_made_for(inner, batch)
    if batch is not None and not _on_meta(inner):
        findings += runs.check_step(inner, batch, loss_fn)
    if batch is not None and budget is not None:
        findings += runs.check_plans(inner, batch, budget, training_args, loss_fn, gpu, optimizer, compiled,
                                     callback=callback, fsdp_world=fsdp_world, accelerate_config=accelerate_config)
    elif budget is not None:
        findings += runs.check_static(inner, budget, optimizer)
    if run_step and batch is not None and _on_cuda(inner):
        findings += runs.check_prediction(model, batch, loss_fn)
    if verify and batch is not None and not _on_meta(inner):
        findings += verification.check_gradients(inner, batch, loss_fn)
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), -f.cost))


# -- what the setup asks for -----------------------------------------------------------------
def _checkpoint_kwargs(model: nn.Module, training_args) -> dict:
    """The ``torch.utils.checkpoint`` keywords in force: the model's (HF checkpointing on), else
    those TrainingArguments will pass."""
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if getattr(m, "gradient_checkpointing", False) is True and fn is not None:
            return dict(getattr(fn, "keywords", {}) or {})
    if args_checkpointing(training_args):
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
    if not (fsdp_ac and args_checkpointing(training_args)):
        return []
    return [Finding(
        check="hf-and-fsdp-checkpointing", severity="error", cost=0.25,
        what="TrainingArguments turn on gradient_checkpointing (activation_checkpointing in transformers 5) and "
             "FSDP's activation_checkpointing as well",
        why="each block would be recomputed twice in backward (transformers 5 refuses the pair when it builds "
            "the accelerator)",
        fix="keep one: fsdp_config={'activation_checkpointing': True} with activation_checkpointing=False "
            "(gradient_checkpointing in transformers 4), or remat (RematCallback / remat.apply before FSDP) with "
            "both off")]


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
    hooked = any(_registered(getattr(m, "_require_grads_hook", None)) for m in model.modules())
    return trainable and fixed and not hooked


def _registered(handle) -> bool:
    """Whether a hook handle's hook is still installed: transformers 4.x's
    ``disable_input_require_grads`` removes the hook but leaves the handle on the model (5.x
    deletes it), so the handle's presence alone does not say the hook runs."""
    hooks = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
    return hooks is not None and getattr(handle, "id", None) in hooks


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
    on_model = hf_checkpointing_on(model)
    if not on_model and not (args_checkpointing(training_args) and not _enable_adds_input_grads(model)):
        return []   # the Trainer's enable call will add the input-grad hook itself
    return [Finding(
        check="reentrant-frozen-inputs", severity="error", cost=1.0,
        what="reentrant checkpointing (use_reentrant=True) on a model whose input embeddings are frozen (LoRA) "
             "and no enable_input_require_grads()",
        why="a reentrant checkpoint only back-propagates into its tensor inputs that require grad; the hidden "
            "states do not, so the adapters inside checkpointed blocks get no gradient and do not train",
        fix="use_reentrant=False in activation_checkpointing_kwargs (gradient_checkpointing_kwargs in "
            "transformers 4), or call model.enable_input_require_grads(), "
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
    if not (hf_checkpointing_on(model) or args_checkpointing(training_args)):
        return []
    return [Finding(
        check="rng-not-preserved", severity="error", cost=1.0,
        what="checkpointing with preserve_rng_state=False on a model with dropout",
        why="the recomputed forward draws other dropout masks than the forward did, so the gradients belong "
            "to no forward that ran",
        fix="drop preserve_rng_state from activation_checkpointing_kwargs (gradient_checkpointing_kwargs in "
            "transformers 4; the default, True, is right), or use "
            "remat, which always preserves it")]


def _check_fsdp_rng(model, training_args, accelerate_config) -> list:
    from remat.diagnosis.findings import fsdp_checkpointing
    found = fsdp_checkpointing(training_args, accelerate_config)
    if found is None or found[0] != 2 or not _has_dropout(model):
        return []
    return [Finding(
        check="rng-not-preserved", severity="error", cost=1.0,
        what="accelerate's FSDP2 activation checkpointing (fsdp_activation_checkpointing, fsdp_version 2) on a "
             "model with dropout",
        why="accelerate wraps each block in checkpoint_wrapper(preserve_rng_state=False): the recomputed forward "
            "draws other dropout masks than the forward did, so the gradients belong to no forward that ran",
        fix="turn FSDP's activation checkpointing off and apply remat before fully_shard (remat.apply(model, "
            "plan), or RematCallback), which checkpoints with the RNG state preserved; or set dropout to 0")]


def _check_head_bypassed(model) -> list:
    from remat.head import remat_head_bypassed
    if not remat_head_bypassed(model):
        return []
    return [Finding(
        check="head-bypassed", severity="warning", cost=0.1,
        what="remat's chunked head is applied under TRL's fused LM head, which computes the loss from the "
             "backbone itself and never calls it",
        why="the plan's head memory and time are not what runs; remat's head is dead code in this model",
        fix="apply remat with head='plain' (TRL's fused head already avoids the full logits), or train with "
            "remat.integrations.hf.RematCallback, which does this")]


def _on_meta(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "meta"


def _on_cuda(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"
