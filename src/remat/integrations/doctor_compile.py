"""``remat doctor``'s checks of how the model runs: compiled or not, whole or a block at a time, sharded.

Each check reads the model as it is (its applied plan's notes, its config, FSDP2's module
classes) and the compile scope :func:`remat.integrations.doctor.compile_scope_of` saw, and
returns :class:`~remat.integrations.doctor.Finding` s: ``compile-mismatch`` (a plan made for
another mode or scope than the one that runs), ``compiled-blocks-cache``,
``fsdp-eager-selective`` and ``compiled-attention-mask``; the doctor module's docstring says
what each means. They are read-only and cheap: no step, no profile.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from remat.integrations.doctor import Finding, applied_plan
from remat.treat.treatments import treatment_of


def check_compile(model, compiled: bool, scope: Optional[str] = None) -> list:
    plan = applied_plan(model)
    if plan is None or "predicted_peak_bytes" not in plan.notes:
        return []   # no plan, or one given by hand (a spec): no prediction to hold or break
    planned = bool(plan.notes.get("compile"))
    if planned == compiled:
        return _check_compile_scope(plan, scope) if planned and scope else []
    why = ("compile changes every treatment's memory and time (the bench model's full keeps 27.6 GiB eager, "
           "15.8 GiB compiled), so the plan's predicted peak {:.2f} GiB and step time do not hold for this step"
           .format(plan.notes["predicted_peak_bytes"] / 2**30))
    if planned:
        return [Finding(
            check="compile-mismatch", severity="warning", cost=0.4,
            what=f"the applied plan ({plan.summary()}) was made for a compiled model (remat.plan(..., compile=True)) "
                 "but the model runs uncompiled",
            why=why + "; uncompiled, its peak can be far above the budget it was chosen for",
            fix="compile the model after remat.apply (model.compile() or torch.compile(model); tell doctor with "
                "compiled=True / remat doctor --compile when it is compiled later), or re-plan for eager "
                "execution: remat.plan(model, batch, budget) without compile=True")]
    return [Finding(
        check="compile-mismatch", severity="warning", cost=0.1,
        what=f"the applied plan ({plan.summary()}) was made for eager execution but the model runs compiled",
        why=why + "; compiled blocks usually keep less, so the plan recomputes more than the budget needs",
        fix="on the GPU, re-plan for compile: remat.plan(model, batch, budget, compile=True) (remat plan "
            "--compile), apply it, then compile")]


def check_compiled_blocks_cache(model, scope: Optional[str]) -> list:
    """Per-block compile with the KV cache on: every block a new graph (see the module doc)."""
    if scope != "blocks" or getattr(getattr(model, "config", None), "use_cache", False) is not True:
        return []
    return [Finding(
        check="compiled-blocks-cache", severity="warning", cost=0.3,
        what=f"{type(model).__name__}'s blocks are compiled each alone while config.use_cache is True",
        why="a training forward builds a key/value cache, and each block's call meets it in another state: every "
            "block compiles its own graph (a tiny Llama: 4 graphs for 4 blocks, 1 without the cache), and past "
            "torch._dynamo.config.recompile_limit (8) the rest run eager, above a compiled plan's peak and time",
        fix="model.config.use_cache = False before training")]


def check_fsdp_selective(model, compiled: bool) -> list:
    """Blocks treated ``selective`` in a model FSDP2 shards, running eager: the GPU waits for its host."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = fsdp is not None and any(isinstance(m, getattr(fsdp, "FSDPModule", ())) for m in model.modules())
    selective = sum(treatment_of(m) == "selective" for m in model.modules())
    if compiled or not sharded or not selective:
        return []
    from remat.planning.sharding import EAGER_SELECTIVE_UNDER_FSDP2
    return [Finding(
        check="fsdp-eager-selective", severity="warning", cost=0.15,
        what=f"{selective} block(s) are treated 'selective' in a model FSDP2 shards, running eager",
        why=EAGER_SELECTIVE_UNDER_FSDP2,
        fix="re-plan with remat.plan(..., fsdp_world=N) (remat plan --fsdp N), which leaves eager selective out; "
            "or use 'mlp' or 'full' for those blocks; or compile each block (block.compile()) before fully_shard")]


def _check_compile_scope(plan, scope: str) -> list:
    """A compiled plan made for the whole model compiled run with only its blocks compiled, or the reverse."""
    planned = plan.notes.get("compile_scope") or "model"   # plans from before scopes: the whole model
    if planned == scope:
        return []
    if planned == "model":
        return [Finding(
            check="compile-mismatch", severity="warning", cost=0.4,
            what=f"the applied plan ({plan.summary()}) was made for the whole model compiled (remat.plan(..., "
                 "compile=True)) but only modules inside it are compiled (per-block compile)",
            why="the embeddings, head and loss then run eager and keep more than the compiled graph the plan counted: "
                "on llama-8b under FSDP2 (4 x H200) such plans peaked 1.2-2.9 GiB above their prediction, over "
                "their budgets",
            fix="re-plan for per-block compile: remat.plan(model, batch, budget, compile='blocks') (remat plan "
                "--compile blocks), or compile the whole model (model.compile())")]
    return [Finding(
        check="compile-mismatch", severity="note", cost=0.1,
        what=f"the applied plan ({plan.summary()}) was made for each block compiled alone (compile='blocks') but "
             "the whole model is compiled",
        why="a compiled head keeps less than the eager one the plan counted: the plan holds its budget but may "
            "recompute more than it needs",
        fix="re-plan for the whole model compiled: remat.plan(model, batch, budget, compile=True)")]


def check_compiled_mask(model, batch, compiled: bool) -> list:
    from remat.profiling._fake import padded_mask
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    config = getattr(model, "config", None)
    if (not compiled or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.device.type == "meta"
            or padded_mask(batch) or getattr(config, "_attn_implementation", None) != "sdpa"):
        return []
    return [Finding(
        check="compiled-attention-mask", severity="warning", cost=0.25,
        what=f"the model runs compiled with SDPA and the batch has an attention_mask of all ones {tuple(mask.shape)}",
        why="under torch.compile transformers cannot read the mask's values, so it builds the full [batch, 1, seq, "
            "seq] mask and SDPA runs a masked kernel over every query-key pair instead of its causal one (on the "
            "bench model, llama-1b 4 x 4096 on an H100, attention took 128 ms of a 333 ms compiled step, 40 ms "
            "eager)",
        fix="leave attention_mask out of batches without padding (with the Trainer: data_collator="
            "remat.integrations.hf.without_full_attention_masks(collator)); with remat applied the compiled "
            "model then runs SDPA's causal kernel (remat.treat.mask_skip)")]
