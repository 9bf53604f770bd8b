"""GPU-only measurements around a profile: pinned copy rates, the collective bus rate and an
in-step calibration.

How: :func:`_copy_rates` times pinned host copies each way and keeps the fastest of a
few. :func:`bus_rate` times a few all-gathers on a live NCCL process group (a collective:
every rank calls it) for FSDP2's time model (:func:`remat.planning.sharding.shard`'s ``bus_Bps``). :func:`_calibrate` runs real training steps with the fastest uniform plan that
fits in the memory this process can still take (:mod:`remat.profiling._room`: under
``remat.plan``'s cap, the budget), or else the fastest plan without offload the solver finds for
that room, CUDA events at every block's forward and backward and around the head
(:func:`_staged_step`), and scales the profile's seconds by the median ratio of in-step to profiled
time (forward, backward, head).

Why: a block runs up to several percent slower inside a whole step than alone, even back to
back (clocks, power under sustained load); without the calibration every step is under-predicted.

What the scaled parts still do not explain of that step's wall time (launch gaps, the loss's
glue, the step's start and end) is :func:`with_residual`'s ``step_overhead_s``, added to every
plan's step (never negative: a step the parts over-explain is noted, not charged): a step's wall
time exceeds the time its GPU kernels are busy, and that difference belongs in the prediction.
(The measurements: docs/history.md.)

Limits: one ratio per phase for all treatments, so recompute-heavy treatments come out a
few percent high; skipped (noted in ``notes["calibration"]``) when no plan without offload fits
the room or a block's output needs no gradient. Needs CUDA; never runs on a fake profile.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from functools import partial
from typing import Optional

import torch

from remat.profiling._capture import _hidden_of
from remat.profiling._room import available_bytes
from remat.planning.costs import MEASURED_TREATMENTS, Profile
from remat.planning.records import block_record
from remat.treat.treatments import apply_treatment, remove_treatment


def _copy_rates(device, nbytes: int = 512 * 2**20, repeats: int = 5) -> tuple:
    """Pinned host copy rates (bytes/s) on ``device``: device to host, host to device.

    The fastest of ``repeats`` copies: interference only slows a copy down, so a median can read
    half the rate every other measurement reads. The GPU buffer is at most a quarter of what the
    allocator can still hand out (planning runs capped at its budget: a 512 MiB probe under a 600 MiB
    card raised a CUDA OOM), never under 8 MiB, where a copy still runs near the bus's rate.
    """
    nbytes = max(8 * 2**20, min(nbytes, available_bytes(device) // 4))
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, gpu), (gpu, host)):
        dst.copy_(src, non_blocking=True)  # warm up
        seconds = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            seconds.append(a.elapsed_time(b) / 1e3)
        rates.append(nbytes / max(min(seconds), 1e-9))
    del gpu, host
    return tuple(rates)


def bus_rate(group=None, nbytes: int = 256 * 2**20, repeats: int = 3) -> Optional[float]:
    """The all-gather bus bandwidth of ``group`` (bytes/s, nccl-tests' busbw: the bytes of the
    gathered tensor times ``(world - 1) / world`` over the seconds), or None when there is nothing to
    measure: torch.distributed not initialised, a world of 1, or no CUDA/NCCL.

    A collective: every rank of ``group`` must call it at the same point (so call it before rank 0
    alone profiles and plans, never inside that). Each rank keeps its fastest of ``repeats``
    all-gathers of ``nbytes`` in all; the slowest rank's is returned on every rank (an
    all-reduce of the seconds), so ranks that plan for themselves still agree. About 10 ms on NVLink.
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return None
    world = dist.get_world_size(group)
    if world < 2 or "nccl" not in str(dist.get_backend(group)).lower():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    shard = torch.empty(max(1, nbytes // world), dtype=torch.uint8, device=device)
    out = torch.empty(shard.numel() * world, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, shard, group=group)  # warm-up: NCCL sets up its channels
    seconds = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dist.all_gather_into_tensor(out, shard, group=group)
        b.record()
        b.synchronize()
        seconds.append(a.elapsed_time(b) / 1e3)
    slowest = torch.tensor([min(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    rate = out.numel() * (world - 1) / world / max(float(slowest), 1e-9)
    del shard, out
    return rate


FREE_SHARE = 0.85
"""The share of the GPU's free memory a real step's plan may take: a calibration step's, and a
compiled plan measured before it is returned (:mod:`remat.profiling._verify`)."""


def step_room(device) -> float:
    """Bytes a real step on ``device`` may peak at: what is allocated now plus :data:`FREE_SHARE` of
    what the allocator can still hand out (the process's memory limit counted, :mod:`remat.profiling._room`)."""
    return torch.cuda.memory_allocated(device) + FREE_SHARE * available_bytes(device)


def without_optimizer(prof: Profile) -> Profile:
    """``prof`` as a step without the optimizer runs it (a calibration or verifying step: forward and
    backward): no optimizer state in static memory, no optimizer phase."""
    return replace(prof, static_bytes=prof.static_bytes - prof.optimizer_bytes, optimizer="none", optimizer_bytes=0,
                   optimizer_temp_bytes=0, optimizer_s=0.0)


def calibration_plan(model, prof: Profile):
    """``(simulation, treatment, head)`` of the uniform plan a calibration step runs: the fastest
    one without offload whose bound (a step without the optimizer) fits in :func:`step_room`;
    None if none fits."""
    from remat.planning.simulator import simulate
    room = step_room(next(model.parameters()).device)
    bare = without_optimizer(prof)
    options = [t for t in MEASURED_TREATMENTS if t in prof.treatments(0)]
    fits = [(simulate(bare, t, head=h.mode, chunk_tokens=h.chunk_tokens), t, h) for t in options for h in prof.heads]
    fits = [f for f in fits if f[0].bound_bytes <= room]
    return min(fits, key=lambda f: f[0].step_s) if fits else None


def fitting_plan(model, prof: Profile):
    """``(simulation, treatments, head)`` of the fastest plan without offload the solver finds within
    :func:`step_room` for a step without the optimizer (one treatment per block), where no uniform
    plan fits; None if no plan does."""
    from remat.planning.plans import OFFLOADING_TREATMENTS
    from remat.planning.simulator import simulate
    from remat.planning.solver import NoPlanFits, solve
    bare = without_optimizer(prof)
    options = [t for t in prof.treatments() if t not in OFFLOADING_TREATMENTS]
    try:
        found = solve(bare, int(step_room(next(model.parameters()).device)), treatments=options)
    except (NoPlanFits, ValueError):
        return None
    treatments = [found.blocks.get(name, "keep") for name in prof.block_names]
    head = next(h for h in prof.heads if h.mode == found.head and (h.chunk_tokens == found.chunk_tokens
                                                                   or h.mode == "plain"))
    sim = simulate(bare, treatments, head=head.mode, chunk_tokens=head.chunk_tokens, tile_tokens=found.tile_tokens)
    return sim, treatments, head


@contextlib.contextmanager
def uniform_applied(model, named, treatment, head):
    """Inside the block, every block of ``named`` treated with ``treatment`` (one name, or a list of one
    per block) and the model's head in ``head``'s mode; afterwards both taken off and the gradients
    cleared."""
    treatments = [treatment] * len(named) if isinstance(treatment, str) else list(treatment)
    for (_, block), name in zip(named, treatments):
        apply_treatment(block, block_record(name))
    if head.mode == "chunked":
        from remat.head import enable_chunked_head
        enable_chunked_head(model, chunk_tokens=head.chunk_tokens)
    try:
        yield
    finally:
        for _, block in named:
            remove_treatment(block)
        if head.mode == "chunked":
            from remat.head import disable_chunked_head
            disable_chunked_head(model)
        model.zero_grad(set_to_none=True)


def _calibrate(model, batch, loss_fn, named, prof, say) -> Profile:
    """Scale the blocks' and the head's seconds to what they take inside a real step.

    A block runs slower inside a whole step than alone, even back to back (likely sustained
    load: clocks, power), a systematic under-prediction of the step. So one real step is run
    with the fastest uniform plan that fits in free memory (keep if it fits), with CUDA events
    at every block's forward and backward and around the head; the ratios in-step / profiled
    (median over blocks: forward, backward; head) scale every treatment's seconds. One ratio
    for all treatments: recompute-heavy ones come out a few percent high. Skipped (noted) when
    no uniform plan fits.
    """
    chosen = calibration_plan(model, prof) or fitting_plan(model, prof)
    if chosen is None:
        return replace(prof, notes=dict(prof.notes, calibration="skipped: no plan without offload fits the memory "
                                                                 "a real step may take here"))
    sim, treatment, head = chosen
    treatments = [treatment] * len(named) if isinstance(treatment, str) else list(treatment)
    label = treatment if isinstance(treatment, str) else ", ".join(
        f"{treatments.count(t)}x {t}" for t in dict.fromkeys(treatments))
    say(f"calibrating on one step: {label}, head {head.mode}")
    with uniform_applied(model, named, treatments, head):
        _staged_step(model, batch, loss_fn, named)  # warm-up
        steps = [_staged_step(model, batch, loss_fn, named) for _ in range(2)]
    costs = [prof.cost(i, t) for i, t in enumerate(treatments)]
    fwd = statistics.median(s["fwd"][i] / costs[i].fwd_s for s in steps for i in range(len(costs)))
    bwd = statistics.median(s["bwd"][i] / costs[i].bwd_s for s in steps for i in range(len(costs)))
    hd = statistics.median(s["head"] for s in steps) / max(head.head_fwd_s + head.head_bwd_s, 1e-9)
    scale = lambda c: replace(c, fwd_s=c.fwd_s * fwd, bwd_s=c.bwd_s * bwd)  # noqa: E731
    heads = tuple(replace(h, head_fwd_s=h.head_fwd_s * hd, head_bwd_s=h.head_bwd_s * hd) for h in prof.heads)
    note = {"plan": f"{label}, head {head.mode}", "forward": round(fwd, 4), "backward": round(bwd, 4),
            "head": round(hd, 4), "step_s": round(statistics.median(s["step"] for s in steps), 5),
            "predicted_step_s": round(sim.step_s, 5)}   # forward and backward, as measured
    scaled = replace(prof.with_costs(lambda _, t, c: scale(c)), heads=heads, notes=dict(prof.notes, calibration=note))
    return with_residual(scaled, treatments, head, statistics.median(s["step"] for s in steps))


def with_residual(prof: Profile, treatment, head, step_s: float) -> Profile:
    """``prof`` with ``step_overhead_s`` set to what the measured step (``step_s``, ``treatment`` with
    ``head``: one treatment, or one per block) took beyond the scaled parts' prediction, when it took more; noted
    as ``residual_s`` (a negative one too, not applied: the parts already over-explain the step)."""
    from remat.planning.simulator import simulate
    # the measured step is forward and backward: the optimizer's step the prediction ends with is not in it
    predicted = simulate(prof, treatment, head=head.mode, chunk_tokens=head.chunk_tokens).step_s - prof.optimizer_s
    residual = step_s - predicted
    note = dict(prof.notes.get("calibration") or {}, residual_s=round(residual, 5))
    return replace(prof, step_overhead_s=prof.step_overhead_s + max(0.0, residual),
                   notes=dict(prof.notes, calibration=note))


def _staged_step(model, batch, loss_fn, named) -> dict:
    """One training step with CUDA events around each block's forward and backward and the head."""
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    n = len(named)
    start, end, grad_at = [None] * n, [None] * n, [None] * (n + 1)  # grad_at[i]: gradient reached block i's output
    handles = []

    def recorded():
        e = event()
        e.record()
        return e

    def pre(i, module, args, kwargs):
        start[i] = recorded()
        x = _hidden_of(args, kwargs)
        if i == 0 and x.requires_grad:
            x.register_hook(lambda g: grad_at.__setitem__(n, recorded()) or None)

    def post(i, module, args, kwargs, out):
        end[i] = recorded()
        y = out if isinstance(out, torch.Tensor) else out[0]
        if y.requires_grad:
            y.register_hook(lambda g: grad_at.__setitem__(i, recorded()) or None)

    for i, (_, block) in enumerate(named):
        handles.append(block.register_forward_pre_hook(partial(pre, i), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(post, i), with_kwargs=True))
    try:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        loss.backward()
        del loss
        if grad_at[n] is None:  # nothing before the blocks needs a gradient (frozen embeddings)
            grad_at[n] = recorded()
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
    finally:
        for handle in handles:
            handle.remove()
    ms = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
    # block i's backward: from the gradient reaching its output to it reaching its input
    # (the output of block i-1, or the first block's input)
    bwd = [ms(grad_at[i], grad_at[i - 1] if i else grad_at[n]) for i in range(n)]
    return {"fwd": [ms(start[i], end[i]) for i in range(n)], "bwd": bwd,
            "head": ms(end[n - 1], grad_at[n - 1]), "step": step}
