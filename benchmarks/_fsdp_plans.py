"""Rank 0's side of ``benchmarks/fsdp_bench.py``: one profile, the budgets, the plans and every row's prediction.

Rank 0 profiles the unsharded model once (on its GPU, on its own random batch; fake tensors
where the model does not fit there or on the CPU), turns the profile into one rank's view of
FSDP2 (:func:`remat.planning.sharding.shard`: 1/world of the parameters, gradients and
optimizer state, two blocks and the root unsharded, the collectives at the bus rate every rank
timed) and solves for each budget, what ``remat.plan(model, batch, budget, fsdp_world=world)``
does with one profile for them all. The result is plain data (:func:`plan_rank0`), which the
bench broadcasts so that every rank applies the same plans.

With ``compile=True`` it also profiles the model as the ``+compile`` rows run it, every block
compiled alone after its checkpointing and before ``fully_shard`` (torchtitan's order) and the
root (embeddings, head, loss) eager: ``remat.profile(..., compile="blocks")``, each block class x
treatment compiled alone, the head eager, calibrated on a step with every block compiled. The
compiled rows are planned from that profile with ``remat.plan``'s compile margin. (Planned from a
``compile=True`` profile -- the whole model compiled, the head too -- the plans peaked 1.2-2.9 GiB
over their prediction on 4 x H200, llama-8b: the eager root's plain head keeps more than the
compiled one; ``h200x4_fsdp_bench_compile.jsonl``.) Their budgets are torch's full checkpointing's
predicted peak (the level at which the issue compares tokens/s) and the three ``full..keep``
fractions of the compiled profile. Compiled profiles need the model on a GPU: ``compile`` on the
CPU or with a fake-tensor profile raises SystemExit.

The default budgets (:func:`default_budgets`), lowest first: one where the solver offloads
(:func:`offload_budget`), then 15%, 50% and 85% of the way from the all-``full`` plan's
predicted peak (chunked head) to the all-``keep`` one, so that the solver picks different
mixes at any world size.
"""
import gc
import sys

import torch

import remat
from remat.presets import build_model
from remat.planning.plans import OFFLOADING_TREATMENTS
from remat.planning.sharding import shard
from remat.units import format_size

FRACTIONS = (0.15, 0.5, 0.85)
OFFLOAD_LADDER = (0.02, 0.04, 0.06, 0.08, 0.10)  # see offload_budget
# the simulator's FSDP2 overheads, where it has them (copy-in/out, launches, contention): beside
# --trace's fsdp_copy and nccl seconds
OVERHEADS = ("comm_copy_s", "comm_launch_s", "comm_contention_s")
EAGER_ANCHORS = (("eager", "keep"), ("torch_ac", "full"), ("hf_full", "full"))
COMPILED_ANCHORS = (("eager+compile", "keep"), ("torch_ac+compile", "full"))


def predicted(sim) -> dict:
    """A simulation's peak and step (compute + exposed communication), as a record's ``predicted_*``."""
    return dict(peak=sim.peak_bytes, step_s=round(sim.step_s, 5), compute_s=round(sim.step_s - sim.exposed_comm_s, 5),
                comm_s=round(sim.comm_s, 5), exposed_comm_s=round(sim.exposed_comm_s, 5),
                **{k: round(getattr(sim, k), 5) for k in OVERHEADS if hasattr(sim, k)})


def plan_rank0(args, config, dtype, world, cuda, bus=None, *, gpu=None, offload=None, compile=False) -> dict:
    """Profile once (twice with ``compile``), then the plan per budget and every row's prediction,
    as plain data: ``plans`` (name, budget, rule, plan dict or error), ``anchors``, ``predicted``
    and ``rules`` by row name, ``single`` (rank 0 alone, unsharded), and how it profiled.

    ``gpu``: the rates of a fake-tensor profile (default this GPU's, or the CPU's);
    ``offload``: whether plans may offload (default: on a GPU only)."""
    from remat.planning.simulator import simulate
    from remat.profiling.profiler import block_param_bytes
    offload = cuda if offload is None else offload
    model, prof, how = _profiled(args, config, dtype, cuda, gpu)
    if compile and how != "cuda":
        raise SystemExit(f"--compile needs rank 0's profile on its GPU (compiled memory and time are measured "
                         f"by running the blocks compiled); this run profiled with {how} tensors")

    def sharded_view(p):
        return shard(p, world, block_param_bytes(model, p), reshard_after_forward=not args.no_reshard, bus_Bps=bus)

    sharded = sharded_view(prof)
    compiled = sharded_view(remat.profile(model, rank_ids(config, args.batch, args.seq, "cuda"), device="cuda",
                                          compile="blocks")) if compile else None
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    # as remat.plan: offload only where there is a GPU to offload from, never under compile
    allowed = args.treatments.split(",") if args.treatments else sharded.treatments(0)
    treatments = [t for t in sharded.treatments(0) if (offload or t not in OFFLOADING_TREATMENTS) and t in allowed]
    given = _given_budgets(args)
    out = dict(plans=[], anchors={}, predicted={}, rules={}, profile=how, calibration=prof.notes.get("calibration"),
               bus_GBps=round(sharded.comm.bus_Bps / 1e9, 1) if sharded.comm else None)
    _solved(out, "remat", sharded, given or default_budgets(sharded, treatments), treatments)
    out["anchors"] = {name: predicted(simulate(sharded, spec, head="plain")) for name, spec in EAGER_ANCHORS}
    # rank 0 alone, unsharded and without FSDP (--single): the same step on one GPU
    out["single"] = {f"single:{name}": predicted(simulate(prof, spec, head="plain"))
                     for name, spec in EAGER_ANCHORS if name != "torch_ac"}
    if compiled is not None:
        plain = [t for t in compiled.treatments(0) if t in treatments]  # no offload under compile
        _solved(out, "remat+compile", compiled, given or compiled_budgets(compiled, sharded), plain)
        out["anchors"].update({name: predicted(simulate(compiled, spec, head="plain"))
                               for name, spec in COMPILED_ANCHORS})
        out["compile_calibration"] = compiled.notes.get("calibration")
    return out


def _profiled(args, config, dtype, cuda, gpu):
    """(the model, its unsharded profile, "cuda" or "fake"): on rank 0's GPU when asked and it fits."""
    from remat.profiling.profiler import profile
    how = args.profile or ("cuda" if cuda else "fake")
    if how == "cuda":
        prof = None
        try:  # the whole model on rank 0's GPU: measured times, as fsdp_validate does
            model = build_model(config, device="cuda", dtype=dtype)
            prof = profile(model, rank_ids(config, args.batch, args.seq, "cuda"), device="cuda")
        except torch.cuda.OutOfMemoryError:
            print("the unsharded model does not fit on one GPU for profiling: fake tensors instead", file=sys.stderr)
        if prof is not None:
            return model, prof, how
        model = None  # out of the except block: its traceback no longer holds the model's tensors
        gc.collect()
        torch.cuda.empty_cache()
    model = build_model(config, device="meta", dtype=dtype)
    prof = profile(model, torch.zeros(args.batch, args.seq, dtype=torch.long), device="fake",
                   gpu=gpu or (gpu_rates() if cuda else "cpu"))
    return model, prof, "fake"


def _given_budgets(args):
    if not args.budgets:
        return None
    from remat.units import parse_size
    return [(parse_size(b), "--budgets") for b in args.budgets.split(",")]


def _solved(out: dict, prefix: str, sharded, budgets, treatments) -> None:
    """Solve ``sharded`` at each budget into ``out`` (rows ``<prefix>@<budget>``), as ``remat.plan``
    solves (a compiled profile within its margin)."""
    from remat.planner import solve_profiled
    from remat.planning.simulator import simulate
    for b, rule in budgets:
        name = f"{prefix}@{format_size(b).replace(' ', '')}"
        try:
            plan = solve_profiled(sharded, b, treatments=treatments)
        except remat.NoPlanFits as e:
            print(f"budget {format_size(b)} ({rule}): {e}", file=sys.stderr)
            out["plans"].append(dict(name=name, budget=b, rule=rule, plan=None, error=f"no plan fits: {str(e)[:300]}"))
            continue
        out["plans"].append(dict(name=name, budget=b, rule=rule, plan=plan.to_dict()))
        out["predicted"][name] = predicted(simulate(sharded, plan))
        out["rules"][name] = rule


def rank_ids(config, batch: int, seq: int, device, rank: int = 0) -> torch.Tensor:
    """Rank ``rank``'s random token ids: each rank its own slice of data in the timed steps, and
    rank 0's for a profile measured on the GPU.

    Not zeros: on an H100 the llama-8b step ran 8% faster on all-zero tokens (identical
    activations toggle fewer bits: less power, higher clocks), and a profile taken on them
    predicted every step that much low (the unsharded step: 0.391 s predicted, 0.430 measured;
    0.421 and 0.424 on random tokens)."""
    generator = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)


def default_budgets(sharded, treatments) -> list:
    """The four default per-GPU budgets, ``[(bytes, rule)]``, lowest first: one where the solver
    offloads (:func:`offload_budget`), then :data:`FRACTIONS` of full..keep (:func:`fraction_budgets`)."""
    from remat.planning.simulator import simulate
    high = simulate(sharded, "keep", head="chunked").peak_bytes
    return [offload_budget(sharded, treatments, high)] + fraction_budgets(sharded)


def fraction_budgets(sharded) -> list:
    """15%, 50% and 85% of the way from the all-``full`` plan's predicted peak (chunked head) to
    the all-``keep`` one."""
    from remat.planning.simulator import simulate
    low = simulate(sharded, "full", head="chunked").peak_bytes
    high = simulate(sharded, "keep", head="chunked").peak_bytes
    return [(int(low + f * (high - low)), f"{f:.0%} of full..keep") for f in FRACTIONS]


def compiled_budgets(compiled, eager) -> list:
    """The compiled rows' budgets: torch's full checkpointing's predicted peak under FSDP2 (eager
    profile, plain head: where the issue compares tokens/s at equal or lower peak), then
    :func:`fraction_budgets` of the compiled profile."""
    from remat.planning.simulator import simulate
    at_full = simulate(eager, "full", head="plain").peak_bytes
    return [(at_full, "torch_ac's predicted peak")] + fraction_budgets(compiled)


def offload_budget(sharded, treatments, high) -> tuple:
    """``(bytes, rule)``: a budget at which the solver's plan offloads, below the other three.

    The smallest budgets come from the solver itself (:class:`remat.NoPlanFits`'s
    ``smallest_peak``), with and without the offload treatments. Where offload lowers the
    smallest budget, halfway between the two: no plan without offload fits there, so the plan
    must offload. Where it does not (the peak is set where offload frees nothing: llama-8b
    1x4096 on 2 ranks peaks in the embeddings' backward, 17.76 GiB predicted for every plan
    that fits), the lowest of 2%, 4% ... 10% of the way from that smallest budget to ``high``
    (the all-``keep`` peak) at which the fastest plan offloads (``full+offload`` blocks making
    room for ``selective`` ones); 2% if none does. Offload not allowed (the CPU): 90% of the
    smallest budget, which no plan fits (the row says so)."""
    def smallest(allowed):
        try:
            return remat.solve(sharded, 1, treatments=allowed).notes["predicted_peak_bytes"]
        except remat.NoPlanFits as e:
            return e.smallest_peak
    plain = [t for t in treatments if t not in OFFLOADING_TREATMENTS]
    without = smallest(plain)
    if len(plain) == len(treatments):
        return int(0.9 * without), "90% of the smallest budget (offload not allowed here)"
    least = smallest(treatments)
    if least < without:
        return (least + without) // 2, "below every plan without offload"
    for f in OFFLOAD_LADDER:
        budget = int(without + f * (high - without))
        try:
            plan = remat.solve(sharded, budget, treatments=treatments)
        except remat.NoPlanFits:
            continue
        if any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values()):
            return budget, f"{f:.0%} of smallest..keep: the lowest of {OFFLOAD_LADDER} whose plan offloads"
    budget = int(without + OFFLOAD_LADDER[0] * (high - without))
    return budget, f"{OFFLOAD_LADDER[0]:.0%} of smallest..keep (no plan offloads up to {OFFLOAD_LADDER[-1]:.0%})"


def gpu_rates() -> str:
    """The rate table of this GPU (h200, h100, a100; h100 for any other)."""
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")
