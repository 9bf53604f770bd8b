"""FSDP2 on several GPUs: remat's plans at four per-GPU budgets beside the stock strategies.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_bench.py --out $OUT
    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_bench.py --single --trace --out $OUT
    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_bench.py --device cpu \\
        --model llama-tiny --batch 2 --seq 32 --steps 1 --warmup 1    # checks the script (gloo)
    PYTHONPATH=src python benchmarks/fsdp_bench.py --plan-only --world 4    # budgets and plans, no GPU

Every strategy runs in this one process group, on a fresh model with the same seed and the
same batch per rank, and gets ``fully_shard`` on every decoder layer and then the root:

- ``eager``: no checkpointing;
- ``torch_ac``: ``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper``
  on every decoder layer (the usual FSDP recipe), then ``fully_shard`` on the wrappers;
- ``hf_full``: Hugging Face ``gradient_checkpointing_enable(use_reentrant=False)``;
- ``remat@<budget>``: the plan for one of ``world`` FSDP2 ranks at four per-GPU budgets.
  Rank 0 profiles the unsharded model once (on its GPU; fake tensors on the CPU), turns the
  profile into one rank's view (:func:`remat.planning.sharding.shard`) and solves for each budget
  -- what ``remat.plan(model, batch, budget, fsdp_world=world)`` does, with one profile for
  them all -- and broadcasts the plans as data (``benchmarks/_fsdp_plans.py``).
  ``--budgets 20GiB,28GiB,36GiB`` fixes them; the four defaults (``default_budgets``), lowest first:

  1. an *offload* budget (``offload_budget``), where the solver's plan offloads: halfway
     between the smallest budget any plan fits and the smallest one a plan without offload
     fits, where offload lowers the first (no plan without offload fits there); else, where it
     does not (llama-8b 1x4096 on 2 ranks peaks in the embeddings' backward, whatever the
     blocks do), the lowest of 2%, 4% ... 10% of the way from that smallest budget to the
     all-``keep`` peak at which the fastest plan offloads (``full+offload`` blocks making room
     for faster ``selective`` ones). Offload is planned on GPUs only, so on the CPU this is 90%
     of the smallest budget and the row is recorded as skipped (no plan fits);
  2.-4. 15%, 50% and 85% of the way from the all-``full`` plan's predicted peak (chunked head)
     to the all-``keep`` one, so that the solver picks different mixes at any world size.

  Each remat record says which (``budget_rule``) and whether its plan offloads (``offloads``).
  ``--treatments keep,selective,full`` plans with those treatments only (to measure one mix).
  ``--plan-only`` prints the budgets and plans without a process group or a GPU: a fake-tensor
  profile with ``--gpu``'s rates (default h100), for ``--world`` ranks (default 2), offload
  allowed as on a GPU.

Protocol (as ``remat bench``): a step is ``zero_grad(set_to_none=True)``, forward with
``labels``, ``backward()``; no optimizer. ``--warmup`` steps, then ``--steps`` timed ones (rank
0's time; FSDP2's collectives keep the ranks in step; with ``--gc manual`` Python's garbage
collector runs before them and is off while they run, as torchtitan and torchtnt train, since a
collection on one rank stalls the others at the next collective), then one more step under
:class:`remat.prove.collectives.CollectiveCounter` for the all-gathers, reduce-scatters and
all-reduces per step. Rank 0 appends one JSON line per strategy to ``--out/fsdp_bench.jsonl`` as
each row ends: predicted and measured peak (the largest rank's ``torch.cuda.max_memory_allocated`` and every
rank's), step time (median, min, max), tokens/s per GPU, collectives per step, the loss, the
GPU and versions. Predicted step times include FSDP2's collectives: the bus rate is timed on
the process group before planning (:func:`remat.profiling._calibrate.bus_rate`, every rank; the
``GPUS`` table on the CPU) and each record carries ``predicted_compute_s``,
``predicted_comm_s`` (link busy) and ``predicted_exposed_comm_s`` (not hidden) beside
``predicted_step_s`` = compute + exposed. ``--no-reshard`` runs ``fully_shard(...,
reshard_after_forward=False)`` and plans for it.

``--trace``: where a step's time goes, for the gap between predicted and measured step times
(llama-8b 1x4096 on 2 x H100: every row ~0.11 s over its prediction). After each row's timed and
counted steps, one more step runs under ``torch.profiler`` (CUDA activities) on every rank, and
the record gets rank 0's kernel-time breakdown (``trace``, :mod:`_trace`, ``benchmarks/_trace.py``):
seconds of kernels per category (gemm, attention, nccl, FSDP2's copy-in/copy-out
``fsdp_copy``, elementwise, memcpy, other), the traced step's wall time and GPU span, the
union of the compute kernels' busy time and of the nccl kernels', the nccl time overlapped with
compute vs exposed, the time no kernel runs at all (``gpu_idle_s``), busy time per stream and the
top kernels by time; ``trace_per_rank`` has each rank's wall, span, busy and exposed seconds. The
profiler slows the host side of the step, so the traced step is never one of the timed ones;
compare its ``compute_busy_s`` with ``predicted_compute_s`` and its ``gpu_idle_s`` with the gap.
Every record names the overhead constants it was predicted with (``overheads``);
``benchmarks/fit_overheads.py`` refits them from traced rows.

``--compile``: also the compiled rows, every block ``torch.compile``-d alone after its
checkpointing and before ``fully_shard`` (torchtitan's order; the root -- embeddings, head and
loss -- runs eager): ``eager+compile``, ``torch_ac+compile`` and ``remat+compile@<budget>``,
planned from a compiled profile rank 0 takes on its GPU (``remat.profile(..., compile="blocks")``)
at torch_ac's predicted peak and the three ``full..keep`` fractions (no offload under compile).
Dynamo's caches are reset before each compiled row, so each row compiles its own blocks (the
first timed step comes after ``--warmup`` steps, which compile). GPU only.

``--single``: before the FSDP rows, rank 0 alone runs the unsharded model without FSDP on its
own GPU and its own batch (``single:eager``, then ``single:hf_full``: Hugging Face full
checkpointing), where its predicted peak (the unsharded profile's, no collectives) fits the
GPU; the other ranks wait at a barrier. Each records step time, peak and the same breakdown
(always traced): the compute this GPU does for one rank's batch without FSDP, to set beside
the FSDP rows' step and compute. Its model is freed (and the cache emptied) before the next
row, which starts from the usual settle.

Memory between rows: each row starts after ``gc.collect()``, a device synchronise, a barrier and
``empty_cache()``, and records ``allocated_before_bytes`` (every rank's allocated bytes before it
builds its model: what earlier rows left) and ``step_peaks_bytes`` (rank 0's peak of each timed
step, reset before each). ``peak_bytes`` is the largest rank's peak less what that rank had
allocated before the row, so memory an earlier row left behind is never charged to this one
(``peak_bytes_raw`` keeps the allocator's number). A row alone (``--strategies torch_ac``) is
the check that a row's peak does not depend on the rows before it. ``allocator_per_rank``: each
rank's caching-allocator events in the timed steps (``cudaMalloc``/``cudaFree`` calls and retries,
each a host stall that holds the other ranks at the next collective; ``_rows.ALLOCATOR_EVENTS``).

A strategy whose predicted peak exceeds the GPU is skipped with the reason
(an out-of-memory on one rank would leave the others waiting in a collective); one that raises
on every rank alike is recorded with its error and the next one runs. Rank 0 profiles on its
GPU unless the unsharded model does not fit there (then with fake tensors and this GPU's rates).
"""
import dataclasses
import gc
import os
import statistics
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import distributed_parser  # noqa: E402  benchmarks/_args.py, beside this script
from _fsdp_plans import COMPILED_ANCHORS, EAGER_ANCHORS, OVERHEADS, plan_rank0, rank_ids  # noqa: E402
from _rows import (TRACE_PER_RANK, allocator_events, compiled_row, finished, kept, measured_row,  # noqa: E402
                   prepare, run_then_leave, settle, step_fn, timed)
from _trace import format_breakdown, trace_step  # noqa: E402

from remat.presets import build_model, load_config, materialise  # noqa: E402
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan  # noqa: E402
from remat.planning.sharding import FSDP2_OVERHEADS  # noqa: E402
from remat.prove.bench import environment  # noqa: E402
from remat.prove.collectives import CollectiveCounter  # noqa: E402
from remat.units import format_size  # noqa: E402

def parse_args(argv=None):
    p = distributed_parser(__doc__)
    p.set_defaults(model="llama-8b", batch=1, seq=4096, steps=3, warmup=2)
    p.add_argument("--strategies", default="eager,torch_ac,hf_full,remat",
                   help="which rows to run (remat: every plan; with --compile, remat+compile: the compiled plans only)")
    p.add_argument("--no-reshard", action="store_true",
                   help="fully_shard(reshard_after_forward=False) on every block (and plan for it)")
    p.add_argument("--single", action="store_true",
                   help="first, rank 0 alone runs the unsharded model (eager, hf_full) without FSDP")
    p.add_argument("--compile", action="store_true",
                   help="also the compiled rows: each block torch.compile-d before fully_shard (GPU only)")
    p.add_argument("--treatments", help="plan with these treatments only, comma-separated (default: all)")
    p.add_argument("--plan-only", action="store_true",
                   help="no process group and no run: print the budgets and plans for --world GPUs of --gpu "
                        "(fake-tensor profile, offload allowed) and exit")
    p.add_argument("--world", type=int, default=2, help="with --plan-only: the FSDP world to plan for")
    p.add_argument("--gpu", default="h100", help="with --plan-only: the GPU whose rates to plan with")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plan_only:
        return plan_only(args)
    cuda = args.device == "cuda"
    if cuda:  # before the process group, so that NCCL knows each rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        warnings.filterwarnings("ignore", message="DTensor random operators")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = load_config(args.model)
    wanted = args.strategies.split(",")

    from remat.profiling._calibrate import bus_rate
    bus = bus_rate() if cuda else None  # a collective: every rank, before rank 0 plans alone
    if args.compile and not cuda:
        raise SystemExit("--compile runs on CUDA only: the compiled rows are planned from a profile measured on "
                         "the GPU")
    box = [plan_rank0(args, config, dtype, world, cuda, bus, compile=args.compile) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    planned = box[0]
    rows = [(name, None) for name, _ in EAGER_ANCHORS if name in wanted]
    rows += [(name, None) for name, _ in COMPILED_ANCHORS if args.compile and name.split("+")[0] in wanted]
    # "remat": every plan's row; "remat+compile": the compiled plans' only
    rows += [(p["name"], Plan.from_dict(p["plan"]) if p["plan"] else p) for p in planned["plans"]
             if "remat" in wanted or p["name"].split("@")[0] in wanted]

    ids = rank_ids(config, args.batch, args.seq, device, rank)
    shared = dict(environment(device), model=args.model, batch_per_rank=args.batch, seq=args.seq, world=world,
                  dtype=str(dtype).replace("torch.", ""), profile=planned["profile"], bus_GBps=planned["bus_GBps"],
                  bus_measured=bus is not None, reshard_after_forward=not args.no_reshard,
                  profile_calibration=planned["calibration"], gc=args.gc,  # the measured profile's in-step calibration
                  compile_calibration=planned.get("compile_calibration"),
                  overheads=dataclasses.asdict(FSDP2_OVERHEADS))  # what benchmarks/fit_overheads.py refits
    path = os.path.join(args.out, "fsdp_bench.jsonl")
    records = _single_rows(args, planned, config, dtype, device, ids, shared, path) if args.single else []
    for name, plan in rows:
        if isinstance(plan, dict):  # a budget that no plan fits (offload, say, on the CPU)
            kept(records, dict(shared, strategy=name, kind="remat", budget_bytes=plan["budget"],
                               budget_rule=plan["rule"], skipped=plan["error"]), path, _line)
            continue
        predicted = planned["anchors"].get(name) or planned["predicted"][name]
        record = dict(shared, strategy=name, kind="remat" if plan else "anchor", compiled=compiled_row(name),
                      predicted_peak_bytes=predicted["peak"], predicted_step_s=predicted["step_s"],
                      predicted_compute_s=predicted["compute_s"], predicted_comm_s=predicted["comm_s"],
                      predicted_exposed_comm_s=predicted["exposed_comm_s"],
                      **{f"predicted_{k}": predicted[k] for k in OVERHEADS if k in predicted})
        if plan is not None:
            record.update(plan=plan.summary(), budget_bytes=plan.notes.get("budget_bytes"),
                          budget_rule=planned["rules"][name],
                          offloads=any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values()))
        measured_row(record, predicted["peak"], device,
                     lambda: _measure(name, plan, config, dtype, device, ids, world, args))
        kept(records, record, path, _line)
    return finished(records)




def plan_only(args) -> dict:
    """``--plan-only``: the budgets and plans for ``--world`` GPUs of ``--gpu``, from a fake-tensor
    profile on this machine, offload allowed (as on a GPU); printed, and returned as
    ``plan_rank0``'s data."""
    config = load_config(args.model)
    args.profile = "fake"
    planned = plan_rank0(args, config, torch.bfloat16, args.world, False, gpu=args.gpu, offload=True)
    print(f"{args.model} {args.batch}x{args.seq} per rank, FSDP2 world {args.world}, {args.gpu} rates "
          f"(fake-tensor profile, bf16)")
    for name, p in {**planned["anchors"], **planned["single"]}.items():
        print(f"  {name:22s} predicted peak {format_size(p['peak']):>10s}  step {p['step_s']:.3f} s")
    for p in planned["plans"]:
        what = Plan.from_dict(p["plan"]).summary() if p["plan"] else p["error"]
        pred = planned["predicted"].get(p["name"])
        print(f"  {p['name']:22s} [{p['rule']}]" + (f" predicted peak {format_size(pred['peak'])} step "
                                                     f"{pred['step_s']:.3f} s" if pred else "") + f": {what}")
    return planned


def _measure(name, plan, config, dtype, device, ids, world, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cuda = device.type == "cuda"
    before = settle(cuda)
    if compiled_row(name):  # each compiled row traces its own blocks: no guards or limits spent by earlier rows
        torch._dynamo.reset()
    mesh = init_device_mesh(device.type, (world,))
    model = build_model(config, device="meta", dtype=dtype)
    reshard = not args.no_reshard
    for block in prepare(name, plan, model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)  # FSDP2 never reshards the root after forward
    materialise(model, device, seed=dist.get_rank())

    step = step_fn(model, ids)
    times, step_peaks, loss = timed(step, args, cuda)
    peaks, befores, events = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(peaks, max(step_peaks) if cuda else None)
    dist.all_gather_object(befores, before)
    dist.all_gather_object(events, allocator_events(cuda))
    with CollectiveCounter() as counter:
        step()
    dist.all_reduce(loss)
    median = statistics.median(times)
    result = dict(step_s=median, step_s_min=min(times), step_s_max=max(times),
                  tokens_per_s_per_gpu=ids.numel() / median, loss=float(loss) / world,
                  collectives_per_step={k: v for k, v in counter.counts.as_dict().items() if k != "by_op"})
    if cuda:
        own = [p - b for p, b in zip(peaks, befores)]
        result.update(peak_bytes=max(own), peak_bytes_per_rank=own, peak_bytes_raw=max(peaks),
                      allocated_before_bytes=befores, step_peaks_bytes=step_peaks, allocator_per_rank=events)
    if args.trace:  # after the timed and the counted steps: the profiler slows a step
        summary = trace_step(step, cuda=cuda)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {k: summary[k] for k in TRACE_PER_RANK})
        result.update(trace=summary, trace_per_rank=per_rank)
    del model, step
    gc.collect()  # FSDP's hooks hold the model in reference cycles
    if cuda:
        torch.cuda.empty_cache()
    return result


def _single_rows(args, planned, config, dtype, device, ids, shared, path) -> list:
    """``--single``: rank 0 alone runs the unsharded model, without FSDP and without a process
    group's collectives, on its own batch (``single:eager``, ``single:hf_full``), where its
    predicted peak fits this GPU; the other ranks wait at a barrier. Every rank returns the
    records (only rank 0's carry measurements)."""
    cuda = device.type == "cuda"
    rank = dist.get_rank()
    limit = torch.cuda.get_device_properties(device).total_memory if cuda else None
    records = []
    for name in ("single:eager", "single:hf_full"):
        predicted = planned["single"][name]
        record = dict(shared, strategy=name, kind="single", gpus_used=1, predicted_peak_bytes=predicted["peak"],
                      predicted_step_s=predicted["step_s"], predicted_compute_s=predicted["compute_s"],
                      predicted_comm_s=predicted["comm_s"], predicted_exposed_comm_s=predicted["exposed_comm_s"])
        if limit and predicted["peak"] > 0.97 * limit:
            record["skipped"] = (f"predicted peak {format_size(predicted['peak'])} of the unsharded model > 97% of "
                                 f"this GPU's {format_size(limit)}")
        elif rank == 0:
            try:
                record.update(_measure_single(name.split(":")[1], config, dtype, device, ids, args))
            except Exception as e:  # noqa: BLE001 - recorded; the other ranks are waiting at the barrier
                record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        settle(cuda)  # rank 0 has freed its model (or its error's); the others waited here
        kept(records, record, path, _line)
    return records


def _measure_single(name, config, dtype, device, ids, args) -> dict:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if cuda else 0
    model = build_model(config, device="meta", dtype=dtype)
    prepare(name, None, model)
    materialise(model, device, seed=0)
    step = step_fn(model, ids)
    try:
        times, step_peaks, loss = timed(step, args, cuda)
        median = statistics.median(times)
        result = dict(step_s=median, step_s_min=min(times), step_s_max=max(times),
                      tokens_per_s_per_gpu=ids.numel() / median, loss=float(loss),
                      trace=trace_step(step, cuda=cuda))
        if cuda:
            result.update(peak_bytes=max(step_peaks) - before, peak_bytes_raw=max(step_peaks),
                          allocated_before_bytes=[before], step_peaks_bytes=step_peaks)
        return result
    finally:
        del model, step
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _line(r) -> str:
    if "skipped" in r or "error" in r:
        return f"{r['strategy']:22s} {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r['error']}"
    if r["kind"] == "single":
        peak = format_size(r["peak_bytes"]) if "peak_bytes" in r else "-"
        return (f"{r['strategy']:22s} peak pred {format_size(r['predicted_peak_bytes']):>10s} meas {peak:>10s}"
                f"  step pred {r['predicted_step_s']:.3f} s meas {r['step_s']:.3f} s  (rank 0 alone, no FSDP)  "
                f"{r['tokens_per_s_per_gpu']:,.0f} tok/s  loss {r['loss']:.4f}\n{'':22s} "
                + format_breakdown(r["trace"]))
    c = r["collectives_per_step"]
    peak = format_size(r["peak_bytes"]) if "peak_bytes" in r else "-"
    carried = max(r.get("allocated_before_bytes") or [0])
    error = (r["step_s"] - r["predicted_step_s"]) / r["predicted_step_s"] if r["predicted_step_s"] else 0.0
    return (f"{r['strategy']:22s} peak pred {format_size(r['predicted_peak_bytes']):>10s} meas {peak:>10s}"
            + (f" (+{format_size(carried)} left by earlier rows)" if carried > 2**28 else "") +
            f"  step pred {r['predicted_step_s']:.3f} s (compute {r['predicted_compute_s']:.3f} + comm "
            f"{r['predicted_exposed_comm_s']:.3f} of {r['predicted_comm_s']:.3f}) meas {r['step_s']:.3f} s "
            f"({error:+.1%})  {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU  "
            f"AG {c['all_gather']} RS {c['reduce_scatter']} AR {c['all_reduce']}  loss {r['loss']:.4f}"
            + (f"  [{r['plan']}]" if "plan" in r else "")
            + (f"\n{'':22s} " + format_breakdown(r["trace"]) if "trace" in r else ""))


if __name__ == "__main__":
    run_then_leave(main)
