"""``remat doctor``'s checks of how the model runs against what its plan was made for: compiled or
not, whole or a block at a time, sharded, and (``check_made_for``) the model, batch shape, dtype, GPU
and versions the applied plan names (:attr:`remat.Plan.made_for`).

Each check reads the model as it is (its applied plan's notes, its config, FSDP2's module
classes) and the compile scope :func:`remat.diagnosis.findings.compile_scope_of` saw, and
returns :class:`~remat.diagnosis.findings.Finding` s: ``compile-mismatch`` (a plan made for
another mode or scope than the one that runs), ``compiled-blocks-cache``,
``fsdp-eager-selective``, ``compiled-attention-mask`` and the ``plan-*`` checks; the doctor
module's docstring says what each means. They are read-only and cheap: no step, no profile.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from remat.diagnosis.findings import Finding, applied_plan
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
    from remat.profiling import padded_mask
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


# -- what the applied plan was made for -------------------------------------------------------
def check_made_for(model, batch) -> list:
    """The applied plan against this model and batch: ``plan-mismatch`` (another model's blocks or
    class, applied with ``strict=False``), ``plan-batch``, ``plan-dtype``, ``plan-gpu``, ``plan-versions``."""
    from remat.api import model_mismatch
    from remat.treat.discovery import discover
    plan = applied_plan(model)
    made = plan.made_for if plan is not None else {}
    if not made:
        return []   # a spec or a hand-made plan says nothing of what it was made for
    findings = []
    try:
        problem = model_mismatch(model, plan, discover(model).block_names)
    except (ValueError, TypeError):
        problem = None
    if problem:
        findings.append(Finding(
            check="plan-mismatch", severity="error", cost=0.5,
            what=f"the applied plan was made for another model: {problem}",
            why="its treatments, predicted peak and time are another model's; blocks it does not name keep "
                "everything, so the peak can be far above its budget",
            fix="plan this model: remat.plan(model, batch, budget) (remat plan --model ... --out plan.json)"))
    shape = _batch_shape(batch)
    if shape is not None and "batch" in made and shape != (made["batch"], made.get("seq")):
        more = shape[0] * shape[1] > made["batch"] * made.get("seq", 1)
        findings.append(Finding(
            check="plan-batch", severity="warning", cost=0.3 if more else 0.1,
            what=f"the applied plan was made for a batch of {made['batch']} x {made.get('seq')} tokens, the step "
                 f"runs {shape[0]} x {shape[1]}",
            why=("more tokens than planned for: the peak grows with them and can pass the budget" if more else
                 "fewer tokens than planned for: the plan recomputes more than this shape needs"),
            fix="re-plan at the shape that trains (remat.plan(model, batch, budget)), or let remat.Guard / "
                "RematCallback plan from the batches that run"))
    dtype = _dtype(model)
    if dtype and made.get("dtype") and dtype != made["dtype"]:
        findings.append(Finding(
            check="plan-dtype", severity="warning", cost=0.3,
            what=f"the applied plan was made for {made['dtype']} parameters, the model's are {dtype}",
            why="every saved activation and weight changes size with the dtype: the plan's peak is not this one's",
            fix="plan the model in the dtype it trains in (remat plan --dtype ...)"))
    findings += _gpu_mismatch(model, plan, made)
    findings += _versions_mismatch(made)
    return findings


def _batch_shape(batch):
    from remat.api import batch_shape as shape_of
    if isinstance(batch, torch.Tensor):
        return shape_of((batch,), {})
    if isinstance(batch, dict):
        return shape_of((), batch)
    if isinstance(batch, (tuple, list)):
        return shape_of(tuple(batch), {})
    return None


def _dtype(model) -> Optional[str]:
    param = next(model.parameters(), None)
    return None if param is None else str(param.dtype).replace("torch.", "")


def _gpu_mismatch(model, plan, made) -> list:
    param = next(model.parameters(), None)
    planned = str(made.get("gpu") or "")
    if param is None or not planned or param.device.type == "meta":
        return []
    if param.device.type == "cpu" and planned != "cpu":
        if not _attention_dropout(model):
            return []   # without it the CPU's kernels save what the plan counts (llama-tiny: within 0.02%)
        return [Finding(
            check="plan-gpu", severity="note", cost=0.05,
            what=f"the applied plan was made for a GPU ({planned}) and the model, with attention dropout on, "
                 "runs on the CPU",
            why="its peak counts what CUDA's attention kernels save; with attention dropout the CPU's attention "
                "runs its math kernel, which keeps the [seq x seq] probabilities and their mask: CPU runs of such "
                "plans peaked 1.4-2x their budget. Gradients are the same; the memory numbers are a GPU's",
            fix="judge the plan's memory on the GPU it was made for (the CPU run proves the gradients)")]
    if param.device.type != "cuda":
        return []
    from remat.planning.costs import rates_for
    here = torch.cuda.get_device_name(param.device)
    try:
        same = rates_for(here).name == rates_for(planned).name
    except ValueError:
        same = here.lower() == planned.lower()
    if same:
        return []
    return [Finding(
        check="plan-gpu", severity="note", cost=0.05,
        what=f"the applied plan was timed for {planned}, the model runs on {here}",
        why="the choice between treatments rests on that GPU's rates; the memory side holds on any CUDA GPU",
        fix="plan on this GPU (remat.plan with the model on it measures its rates) for the fastest plan")]


def _attention_dropout(model) -> bool:
    config = getattr(model, "config", None)
    names = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
    return any(float(getattr(config, name, 0) or 0) > 0 for name in names)


def _versions_mismatch(made) -> list:
    from remat.planning.plans import versions
    then, now = made.get("versions") or {}, versions()
    differ = [f"{name} {then[name]} (now {now[name]})" for name in ("torch", "transformers")
              if name in then and name in now and _minor(then[name]) != _minor(now[name])]
    if not differ:
        return []
    return [Finding(
        check="plan-versions", severity="note", cost=0.02,
        what=f"the applied plan was made under {', '.join(differ)}",
        why="kernels and what autograd saves change between versions; the plan's numbers may not hold",
        fix="re-plan under the versions that train (remat plan, or remat.plan in the training process)")]


def _minor(version: str) -> tuple:
    return tuple(version.split("+")[0].split(".")[:2])
