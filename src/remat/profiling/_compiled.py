"""Profiling for compiled models: each block × treatment and the head measured as ``torch.compile`` runs them.

The user's flow is ``plan = remat.plan(model, batch, budget, compile=True); remat.apply(model,
plan); model.compile()``, or each block compiled alone before FSDP2's ``fully_shard`` with the root
eager, as torchtitan trains: ``compile="blocks"`` (:data:`SCOPES`). Compile changes every treatment's
memory (AOTAutograd's partitioner saves other tensors than eager autograd; inductor fuses the
pointwise ops whose outputs eager keeps) and its time, so a compiled plan is profiled compiled:

- a block class × treatment: the treated block's call compiled alone (:func:`compile_block`,
  ``dynamic=False``), measured by the eager blocks' meter and chains (:mod:`remat.profiling._blocks`),
  a first call compiling outside any measurement;
- the head: the stubbed step with the whole model compiled (:func:`compiled_model`), each stub a
  ``torch.compiler.disable`` frame; under ``compile="blocks"`` the head runs eager;
- calibration (:func:`calibrate_compiled`): one real compiled step of the fastest uniform plan that
  fits scales forward and backward seconds, and its peak beyond the prediction is added (never taken
  away) to the kept bytes, a share per block; a second step, uniform ``full``, does the same for the
  region checkpoints (``full``, ``mlp``, ``attention``), and adds its excess to the peak of the
  embeddings' backward of its head mode (:func:`charged_step_end`); ``selective`` keeps its own numbers.

:class:`CountingBackend` wraps inductor, so a block that compiled no graph raises instead of
returning eager numbers as compiled ones. Each compile here is taken back out of dynamo's cache when
its measurement ends (:mod:`remat.treat.dynamo_cache`): the user's own compile later does not meet it
against its recompile limit, and the process's other graphs stay (``torch._dynamo.reset()`` would not).

Limits: offload treatments are left out of compiled plans (:data:`OFFLOAD_UNDER_COMPILE`: dynamo breaks
the graph at the offload engine's ``saved_tensors_hooks``); a block compiled alone cannot fuse with its
neighbours (the calibration absorbs the time part of that); there is no fake-tensor path (a GPU is
needed). Why each calibration is there: docs/design/diagnosis.md.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace

import torch

from remat.planning.costs import Profile
from remat.treat import patches
from remat.treat.dynamo_cache import compiled, own_compiles

BACKEND = "inductor"
SCOPES = ("model", "blocks")
"""What a compiled plan is made for: ``model`` (``compile=True``), ``model.compile()`` or
``torch.compile(model)``; ``blocks``, each block compiled alone, the root eager (FSDP2's usual way)."""
REGION_CHECKPOINTS = ("full", "mlp", "attention")
"""Treatments that checkpoint a region whose input the compiled graph saves; their memory is
calibrated by the ``full`` step (``selective``, op-level, measured within 3 MiB a block)."""
OFFLOAD_UNDER_COMPILE = ("offload treatments are not planned for compiled models: dynamo breaks the graph at the "
                         "offload engine's saved_tensors_hooks (every offloaded block would split the compiled "
                         "graph) and AOTAutograd saves other tensors than the engine's eager model assumes")
NEEDS_GPU = ("compile=True plans need the model on a GPU: compiled memory and time are measured by running each "
             "block and the head compiled (torch.compile), which fake tensors cannot do. Move the model to the GPU "
             "(model.cuda()) and plan there, or plan without compile=True (eager numbers: compile usually lowers "
             "memory, e.g. 'full' 27.6 -> 15.8 GiB on the bench model, so an eager plan is conservative in memory)")


def compile_scope(compile) -> "str | None":
    """``compile`` (False, True, ``"model"``, ``"blocks"``) as a scope of :data:`SCOPES`, None for
    eager; ValueError for anything else."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "model"
    if compile in SCOPES:
        return compile
    raise ValueError(f"compile must be False, True (the whole model compiled, as model.compile()) or 'blocks' "
                     f"(each block compiled alone, the embeddings and head eager: FSDP2's per-block compile), "
                     f"got {compile!r}")


def profile_scope(notes: dict) -> "str | None":
    """The compile scope a profile (or plan) was made for, from its notes (profiles older than
    scopes, marked ``compile`` only, were made for the whole model)."""
    return (notes.get("compile_scope") or "model") if notes.get("compile") else None


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles and hands them to ``backend``."""

    def __init__(self, backend: str = BACKEND):
        self.backend, self.graphs = backend, 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        self.graphs += 1
        return lookup_backend(self.backend)(gm, example_inputs)


@contextlib.contextmanager
def compile_block(block, backend: str):
    """``block``'s call compiled alone (``dynamic=False``) for the ``with`` block, taken out of
    dynamo's cache at its end. Yields ``(call, counter)``; the caller makes the first call (it
    compiles) with real inputs."""
    with own_compiles("remat's compiled profile"):
        counter = CountingBackend(backend)
        yield compiled(backend=counter, dynamic=False).bind(block), counter


def check_compiled(counter: CountingBackend, what: str) -> None:
    """Raise if nothing was compiled: the numbers would be eager ones."""
    if counter.graphs == 0:
        raise RuntimeError(f"remat: {what} ran without compiling any graph under torch.compile (dynamo skipped it "
                           "or hit its cache limit); compiled costs cannot be measured for it")


@contextlib.contextmanager
def compiled_model(model, backend: str):
    """``model`` compiled in place as ``Module.compile()`` does, for the ``with`` block (its graphs
    taken out of dynamo's cache at the end); yields the counter."""
    with own_compiles("remat's compiled profile"):
        counter = CountingBackend(backend)
        with patches.compiled_calls([(model, compiled(backend=counter, dynamic=False).bind(model))]):
            yield counter


@contextlib.contextmanager
def compiled_blocks(named, backend: str):
    """Each block of ``named`` compiled alone in place, as ``block.compile()`` does, for the
    ``with`` block (one compiled call for all: blocks of one class share their graph; taken out of
    dynamo's cache at the end); yields the counter."""
    with own_compiles("remat's compiled profile"):
        counter = CountingBackend(backend)
        call = compiled(backend=counter, dynamic=False)
        with patches.compiled_calls((block, call.bind(block)) for _, block in named):
            yield counter


def calibrate_compiled(model, batch, loss_fn, named, prof: Profile, say, backend: str = BACKEND,
                       scope: str = "model") -> Profile:
    """Scale the profile's seconds to those of a real compiled step (see the module doc).

    The fastest uniform plan (no offload) whose predicted peak fits in 85% of free memory is
    applied and the model compiled; two warm-up steps compile it, three are timed with CUDA
    events at the loss (forward done) and after ``backward``. Forward seconds (embeddings,
    blocks, head forward) are scaled by measured / predicted forward, backward likewise. A
    measured peak above the predicted one adds its excess, an equal share per block, to the
    calibrated treatment's kept bytes; both peaks are noted beside the ratios. Then, unless that
    plan was already ``full``, one more compiled step of uniform ``full`` (with the head option of
    the smallest predicted peak) does the same for the region checkpoints
    (:data:`REGION_CHECKPOINTS`, :func:`charged_region_checkpoints`) and adds its whole excess to the
    embeddings' backward of that head's mode (:func:`charged_step_end`) -- memory only. ``scope``
    ``blocks``: the steps compile each block alone, the rest eager (:func:`compiled_blocks`)."""
    from remat.profiling._calibrate import calibration_plan, uniform_applied, without_optimizer
    bare = without_optimizer(prof)   # the compiled steps run forward and backward, no optimizer
    chosen = calibration_plan(model, prof)
    if chosen is None:
        return replace(prof, notes=dict(prof.notes, calibration="skipped: no uniform plan fits in free memory"))
    sim, treatment, head = chosen
    say(f"calibrating on a compiled step: {treatment}, head {head.mode} "
        f"({'compiling the whole model' if scope == 'model' else 'compiling each block'})")
    steps, peak = compiled_steps(model, batch, loss_fn, named, uniform_applied(model, named, treatment, head), backend,
                                 bare.static_bytes, scope)
    prof = scaled_to_step(prof, sim, treatment, head, steps, peak)
    if treatment == "full" or "full" not in prof.treatments(0):
        return prof
    from remat.planning.simulator import simulate
    # the head whose own peak is smallest, so the blocks' kept bytes set the step's peak (with the
    # plain head's backward peak on top, a full plan's excess does not show)
    head = min(prof.heads, key=lambda h: simulate(bare, "full", head=h.mode, chunk_tokens=h.chunk_tokens).peak_bytes)
    sim = simulate(bare, "full", head=head.mode, chunk_tokens=head.chunk_tokens)
    say(f"calibrating memory on a compiled step: full, head {head.mode}")
    _, peak = compiled_steps(model, batch, loss_fn, named, uniform_applied(model, named, "full", head), backend,
                             bare.static_bytes, scope)
    excess = max(0, peak - int(sim.peak_bytes))
    prof = charged_region_checkpoints(prof, treatment, excess // max(1, len(prof.block_class)))
    prof = charged_step_end(prof, head.mode, excess)
    note = dict(prof.notes["calibration"], full_step={"peak_bytes": peak, "predicted_peak_bytes": int(sim.peak_bytes)})
    return replace(prof, notes=dict(prof.notes, calibration=note))


def charged_step_end(prof: Profile, mode: str, excess: int) -> Profile:
    """``prof`` with the ``full`` step's ``excess`` (bytes over its prediction) also added to the peak
    of the embeddings' backward (``pre_bwd_peak``) of every head of ``mode``, the head that step ran.

    Why: a compiled step's peak can be past the blocks' backward, where no kept byte is alive. The
    whole model compiled fuses the embedding's backward with the first block's and sums a bf16
    embedding's gradient in an fp32 ``[vocab x hidden]`` buffer; the profile's stubbed step, whose
    blocks break the graph, runs the embedding eager and never holds it
    (``benchmarks/results/compiled_head``: on an H100 every chunked-head plan of the bench-like model
    peaked 1.01 GB over its prediction, ``keep`` as much as ``full``). Charged to kept bytes alone,
    that excess is where the peak is not. Charged here as well, a plan whose peak is in the blocks is
    predicted no lower than before, and one whose peak is at the step's end is predicted at it. Every
    chunk option of ``mode`` is charged: the buffer does not depend on the chunk."""
    if excess <= 0:
        return prof
    heads = tuple(replace(h, pre_bwd_peak=h.pre_bwd_peak + excess) if h.mode == mode else h for h in prof.heads)
    note = dict(prof.notes["calibration"], step_end_bytes_added={mode: excess})
    return replace(prof, heads=heads, notes=dict(prof.notes, calibration=note))


def charged_region_checkpoints(prof: Profile, calibrated: str, full_extra: int) -> Profile:
    """``prof`` with the ``full`` step's excess per block (``full_extra``) added to the region
    checkpoints' kept bytes, except ``calibrated`` (the first step's treatment: not twice).

    ``full`` gets ``full_extra``. ``mlp`` and ``attention`` checkpoint part of a block and keep
    the rest as ``keep`` does, so they get the larger of ``full_extra`` and what the first step
    added to ``keep`` (charged full's excess alone, compiled plans with ``mlp`` blocks peaked
    above their prediction, past their budget)."""
    added = prof.notes["calibration"]["kept_bytes_added_per_block"]
    charges = {t: full_extra if t == "full" else max(full_extra, added.get("keep", 0))
               for t in REGION_CHECKPOINTS if t in prof.treatments(0) and t != calibrated}
    charged = prof.with_costs(lambda _, t, c: replace(c, kept=c.kept + charges[t]) if t in charges else c)
    note = dict(prof.notes["calibration"], kept_bytes_added_per_block=dict(added, **charges))
    return replace(charged, notes=dict(prof.notes, calibration=note))


def compiled_steps(model, batch, loss_fn, named, applied, backend, static_bytes: int, scope: str = "model",
                   timed: int = 3) -> tuple:
    """Steps of ``model`` compiled (the whole model, or each block alone for ``scope`` ``blocks``)
    inside ``applied`` (a context manager that treats the model and takes the treatment off after):
    two warm-up steps (they compile), then ``timed`` timed. Returns ((forward s, backward s, wall s)
    per timed step, the peak above what was allocated before the timed steps plus ``static_bytes``)."""
    device = next(model.parameters()).device
    compiled = compiled_model(model, backend) if scope == "model" else compiled_blocks(named, backend)
    with applied, compiled as counter:
        for _ in range(2):
            _timed_step(model, batch, loss_fn)
        check_compiled(counter, "the compiled step")
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        steps = [_timed_step(model, batch, loss_fn) for _ in range(timed)]
        peak = torch.cuda.max_memory_allocated(device) - base
    return steps, int(peak + static_bytes)


def scaled_to_step(prof: Profile, sim, treatment: str, head, steps: list, measured_peak: int) -> Profile:
    """``prof`` scaled to a measured compiled step of the uniform ``treatment`` plan with ``head``
    (``sim``: its prediction for a step without the optimizer; ``steps``: (forward s, backward s, wall s)
    each; ``measured_peak``: the step's peak, static included). See :func:`calibrate_compiled`."""
    blocks = len(prof.block_class)
    costs = [prof.cost(i, treatment) for i in range(blocks)]
    fwd_pred = head.pre_fwd_s + head.head_fwd_s + sum(c.fwd_s for c in costs)
    bwd_pred = head.pre_bwd_s + head.head_bwd_s + sum(c.bwd_s for c in costs)
    fwd = statistics.median(s[0] for s in steps) / max(fwd_pred, 1e-9)
    bwd = statistics.median(s[1] for s in steps) / max(bwd_pred, 1e-9)
    # what the whole compiled graph keeps beyond the blocks compiled alone, charged to the
    # calibrated treatment's kept bytes, per block (never subtracted: see the module doc)
    extra = max(0, measured_peak - int(sim.peak_bytes)) // max(1, blocks)
    scaled = prof.with_costs(lambda _, t, c: replace(c, fwd_s=c.fwd_s * fwd, bwd_s=c.bwd_s * bwd,
                                                     kept=c.kept + (extra if t == treatment else 0)))
    heads = tuple(replace(h, pre_fwd_s=h.pre_fwd_s * fwd, head_fwd_s=h.head_fwd_s * fwd,
                          head_bwd_s=h.head_bwd_s * bwd, pre_bwd_s=h.pre_bwd_s * bwd) for h in prof.heads)
    note = {"plan": f"{treatment}, head {head.mode}, compiled", "forward": round(fwd, 4), "backward": round(bwd, 4),
            "step_s": round(statistics.median(s[2] for s in steps), 5), "predicted_step_s": round(sim.step_s, 5),
            "peak_bytes": measured_peak, "predicted_peak_bytes": int(sim.peak_bytes),
            "kept_bytes_added_per_block": {treatment: extra}}
    return replace(scaled, heads=heads, notes=dict(prof.notes, calibration=note))


def _timed_step(model, batch, loss_fn) -> tuple:
    """(forward s, backward s, wall s) of one training step, CUDA events around each half."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    events[0].record()
    loss = loss_fn(model, batch)
    events[1].record()
    loss.backward()
    del loss
    events[2].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return events[0].elapsed_time(events[1]) / 1e3, events[1].elapsed_time(events[2]) / 1e3, wall
