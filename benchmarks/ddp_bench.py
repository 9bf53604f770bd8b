"""DDP on several GPUs: remat's plans for one of ``world`` DDP ranks beside eager and HF checkpointing.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/ddp_bench.py --out $OUT
    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/ddp_bench.py --device cpu \\
        --model llama-tiny --batch 2 --seq 32 --steps 1 --warmup 1 --out /tmp/x   # checks the script (gloo)

Every strategy runs in this one process group (NCCL on GPUs, gloo with ``--device cpu``), on a
fresh model with the same weights on every rank (built on ``meta``, then filled with seed 0)
and each rank its own batch (default llama-1b, bf16, 2 x 4096 tokens per rank), wrapped in
``torch.nn.parallel.DistributedDataParallel`` with its default arguments
(``device_ids=[local rank]`` on GPUs; 25 MiB buckets, ``gradient_as_bucket_view=False``):

- ``eager``: no checkpointing;
- ``hf_full``: Hugging Face ``gradient_checkpointing_enable(use_reentrant=False)``;
- ``remat@<budget>``: ``remat.plan(model, ids, budget, ddp_world=world, profiled=...)`` at two
  per-GPU budgets, applied with ``remat.apply`` before the model is wrapped in DDP. Rank 0
  profiles the model once (on its GPU; fake tensors on the CPU, or where the model does not
  fit) and plans every budget from that profile (``profiled=``), then broadcasts
  ``plan.to_dict()``: a measured profile differs from rank to rank, so only a broadcast makes
  every rank run the same plan. By default the budgets sit at 25% and 75% of the way from the
  smallest budget any plan fits (the solver's :class:`remat.NoPlanFits` ``smallest_peak``) to
  the peak of the fastest plan with no budget to speak of (1 TiB); ``--budgets 20GiB,30GiB``
  fixes them. The anchors' predictions are ``remat.plan``'s too, for the same world, with one
  treatment allowed (``keep`` for eager, ``full`` for hf_full) and the plain head.

Protocol (as ``benchmarks/fsdp_bench.py``, through ``benchmarks/_rows.py``): a step is
``zero_grad(set_to_none=True)``, forward with ``labels``, ``backward()`` (DDP's all-reduces
end inside it); no optimizer. ``--warmup`` steps (DDP rebuilds its buckets after the first),
then ``--steps`` timed ones (rank 0's time; the all-reduces keep the ranks in step), then one
step under :class:`remat.prove.collectives.CollectiveCounter` (all-reduces per step), and with
``--trace`` one more under ``torch.profiler`` (the kernel-time breakdown of
``benchmarks/_trace.py``: gemm, attention, nccl, copies; nccl overlapped with compute vs
exposed). Each row starts after ``gc.collect()``, a synchronise, a barrier and
``empty_cache()``; ``peak_bytes`` is the largest rank's ``max_memory_allocated`` over the timed
steps less what that rank had allocated before the row (every rank's in
``peak_bytes_per_rank``). A row whose predicted peak exceeds 97% of the GPU is skipped; one that
raises on every rank alike is recorded with its error.

Gradient check (after the rows; ``--no-grad-check`` skips it): does a remat plan under DDP give
the gradients of the whole batch? On a smaller model in fp32 (``--grad-model``, default the
bench preset cut to ``--grad-layers`` 2 decoder layers; ``--grad-batch`` x ``--grad-seq``
tokens per rank, default the bench's batch and at most 1024 tokens), every rank runs one DDP
step with a remat plan for it (``remat.plan(..., ddp_world=world)`` at the middle of its
smallest..fastest range, so that it mixes treatments), and rank 0 then runs the same weights
alone, without remat or DDP, on every rank's inputs concatenated (gathered with
``all_gather``). DDP averages the ranks' gradients and each rank's loss is the mean over its
own ``batch x (seq - 1)`` labels, so with equal batches the average is exactly the gradient of
the concatenated batch's mean loss. Per parameter, the difference is ``max|g_ddp - g_ref| /
max|g_ref|`` (relative to the parameter's largest gradient entry: an elementwise ratio would be
noise where a gradient entry is near zero); the check passes when every parameter is within
``rtol`` = 1e-4. Why 1e-4 in fp32: the two runs add the same terms in a different order (a
batch of B vs W*B rows in every matmul and reduction, the all-reduce's sum then its division by
W), which moves a fp32 result by ~1e-6 of its scale; a wrong gradient (a recompute that sees
other weights or RNG, a block's gradient dropped or counted twice, a missing average) is off by
far more than 1e-4. TF32 is switched off for the check (it would round matmul inputs to 10
bits). The record (``"strategy": "grad_check"``) carries the plan, both losses, the largest
difference and every parameter's.

Rank 0 appends one JSON line per row to ``--out/ddp_bench.jsonl`` as each row ends, and prints it.

Limits: DDP's own arguments are not varied (buckets, ``static_graph``,
``gradient_as_bucket_view``); the predictions are whatever ``remat.plan(..., ddp_world=)``
models of DDP's buckets and all-reduces (see :mod:`remat.planning`); offload treatments are only
planned on a GPU; the grad check runs a different, smaller model than the timed rows (fp32, so
that the comparison is tight), with its own plan.
"""
import gc
import inspect
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import distributed_parser  # noqa: E402  benchmarks/_args.py, beside this script
from _trace import format_breakdown, trace_step  # noqa: E402
from _fsdp_plans import gpu_rates, rank_ids  # noqa: E402
from _rows import (TRACE_PER_RANK, finished, kept, measured_row, prepare, run_then_leave, settle,  # noqa: E402
                   step_fn, timed)

import remat  # noqa: E402
from remat.presets import build_model, load_config, materialise  # noqa: E402
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan  # noqa: E402
from remat.prove.bench import environment  # noqa: E402
from remat.prove.collectives import CollectiveCounter  # noqa: E402
from remat.units import format_size  # noqa: E402

FRACTIONS = (0.25, 0.75)
UNBOUNDED = 2 ** 40  # 1 TiB: a budget no plan reaches, for the fastest plan and the anchors
GRAD_RTOL = 1e-4
# what remat.plan(..., ddp_world=) notes of DDP's all-reduces, where it notes them: lifted into the record
PREDICTED_COMM = ("allreduce_buckets", "comm_s", "exposed_comm_s", "comm_overhead_s", "comm_copy_s", "comm_launch_s",
                  "comm_contention_s")


def parse_args(argv=None):
    p = distributed_parser(__doc__)
    p.set_defaults(model="llama-1b", batch=2, seq=4096, steps=3, warmup=2)
    p.add_argument("--strategies", default="eager,hf_full,remat", help="which rows to run")
    p.add_argument("--grad-model", help="preset or config for the gradient check (default: --model cut to "
                                        "--grad-layers layers)")
    p.add_argument("--grad-layers", type=int, default=2)
    p.add_argument("--grad-batch", type=int, help="per rank (default --batch)")
    p.add_argument("--grad-seq", type=int, help="default min(--seq, 1024)")
    p.add_argument("--no-grad-check", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if "ddp_world" not in inspect.signature(remat.plan).parameters:
        raise SystemExit("remat.plan has no ddp_world argument in this checkout: DDP planning is not in "
                         f"{os.path.dirname(remat.__file__)} yet; this benchmark needs it")
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:  # before the process group, so that NCCL knows each rank's GPU
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = load_config(args.model)
    grad_config = _grad_config(args)
    wanted = args.strategies.split(",")

    box = [_plan_rank0(args, config, grad_config, dtype, world, cuda) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    planned = box[0]
    rows = [(name, None) for name in ("eager", "hf_full") if name in wanted]
    if "remat" in wanted:
        rows += [(p["name"], Plan.from_dict(p["plan"]) if p["plan"] else p) for p in planned["plans"]]

    ids = rank_ids(config, args.batch, args.seq, device, rank)
    shared = dict(environment(device), model=args.model, batch_per_rank=args.batch, seq=args.seq, world=world,
                  dtype=str(dtype).replace("torch.", ""), profile=planned["profile"], parallel="ddp", gc=args.gc)
    records, path = [], os.path.join(args.out, "ddp_bench.jsonl")
    for name, plan in rows:
        if isinstance(plan, dict):  # a budget no plan fits
            record = dict(shared, strategy=name, kind="remat", budget_bytes=plan["budget"], skipped=plan["error"])
        else:
            notes = planned["anchors"][name] if plan is None else dict(plan.notes)
            record = dict(shared, strategy=name, kind="remat" if plan else "anchor",
                          predicted_peak_bytes=notes["predicted_peak_bytes"],
                          predicted_step_s=notes["predicted_step_s"], prediction_notes=notes,
                          **{f"predicted_{k}": notes[k] for k in PREDICTED_COMM if k in notes})
            if plan is not None:
                record.update(plan=plan.summary(), budget_bytes=notes.get("budget_bytes"),
                              offloads=any(t in OFFLOADING_TREATMENTS for t in plan.blocks.values()))
            measured_row(record, notes["predicted_peak_bytes"], device,
                         lambda: _measure(name, plan, config, dtype, device, ids, world, args))
        kept(records, record, path, _line)
    if not args.no_grad_check:
        record = dict(shared, strategy="grad_check", kind="grad_check")
        try:
            record.update(_grad_check(args, planned, grad_config, device, world))
        except Exception as e:  # noqa: BLE001
            record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        kept(records, record, path, _line)
    return finished(records)


def _grad_config(args):
    """The gradient check's config: ``--grad-model``, or ``--model`` with ``--grad-layers`` layers."""
    config = load_config(args.grad_model or args.model)
    if args.grad_model:
        return config
    d = config.to_dict()
    d["num_hidden_layers"] = min(args.grad_layers, d["num_hidden_layers"])
    if isinstance(d.get("layer_types"), list):  # per-layer attention kinds (Qwen2, Gemma ...): as many as layers
        d["layer_types"] = d["layer_types"][:d["num_hidden_layers"]]
    return type(config).from_dict(d)


def _plan_for(model, ids, budget, world, prof, **kwargs):
    """Every planning call here: ``remat.plan`` for one of ``world`` DDP ranks, from ``prof``."""
    return remat.plan(model, ids, budget, ddp_world=world, profiled=prof, **kwargs)


def _smallest(model, ids, world, prof) -> int:
    """The smallest budget any plan fits (the solver's own answer)."""
    try:
        return _plan_for(model, ids, 1, world, prof).notes["predicted_peak_bytes"]
    except remat.NoPlanFits as e:
        return e.smallest_peak


def _profiled(config, dtype, batch, seq, how, cuda):
    """(model, ids, profile, how): on rank 0's GPU when ``how`` is cuda and it fits, else fake tensors."""
    if how == "cuda":
        try:
            model = build_model(config, device="cuda", dtype=dtype)
            ids = rank_ids(config, batch, seq, "cuda")  # not zeros: they run faster (_fsdp_plans.rank_ids)
            return model, ids, remat.profile(model, ids), how
        except torch.cuda.OutOfMemoryError:
            print("the model does not fit on one GPU for profiling: fake tensors instead", file=sys.stderr)
        gc.collect()
        torch.cuda.empty_cache()
    model = build_model(config, device="meta", dtype=dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, ids, remat.profile(model, ids, gpu=gpu_rates() if cuda else "cpu"), "fake"


def _plan_rank0(args, config, grad_config, dtype, world, cuda) -> dict:
    """Profile once, then every plan and the anchors' predictions, as plain data; and the
    gradient check's plan (its model, fp32, fake tensors)."""
    model, ids, prof, how = _profiled(config, dtype, args.batch, args.seq,
                                      args.profile or ("cuda" if cuda else "fake"), cuda)
    anchors = {name: dict(_plan_for(model, ids, UNBOUNDED, world, prof, treatments=[t], heads=["plain"]).notes)
               for name, t in (("eager", "keep"), ("hf_full", "full"))}
    if args.budgets:
        from remat.units import parse_size
        budgets = [parse_size(b) for b in args.budgets.split(",")]
    else:
        low = _smallest(model, ids, world, prof)
        high = _plan_for(model, ids, UNBOUNDED, world, prof).notes["predicted_peak_bytes"]
        budgets = [int(low + f * (high - low)) for f in FRACTIONS]
    plans = []
    for b in budgets:
        name = f"remat@{format_size(b).replace(' ', '')}"
        try:
            plans.append(dict(name=name, budget=b, plan=_plan_for(model, ids, b, world, prof).to_dict()))
        except remat.NoPlanFits as e:
            print(f"budget {format_size(b)}: {e}", file=sys.stderr)
            plans.append(dict(name=name, budget=b, plan=None, error=f"no plan fits: {str(e)[:300]}"))
    del model, ids, prof
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    grad_plan = None
    if not args.no_grad_check:
        g_batch, g_seq = _grad_shape(args)
        model, ids, prof, _ = _profiled(grad_config, torch.float32, g_batch, g_seq, "fake", cuda)
        low = _smallest(model, ids, world, prof)
        high = _plan_for(model, ids, UNBOUNDED, world, prof).notes["predicted_peak_bytes"]
        grad_plan = _plan_for(model, ids, (low + high) // 2, world, prof).to_dict()
    return dict(plans=plans, anchors=anchors, profile=how, grad_plan=grad_plan)


def _grad_shape(args):
    return args.grad_batch or args.batch, args.grad_seq or min(args.seq, 1024)


def _ddp(model, device):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _measure(name, plan, config, dtype, device, ids, world, args) -> dict:
    cuda = device.type == "cuda"
    before = settle(cuda)
    model = build_model(config, device="meta", dtype=dtype)
    prepare(name, plan, model)  # hf_full: HF checkpointing; a plan: remat.apply; eager: nothing
    materialise(model, device, seed=0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    ddp = _ddp(model, device)
    step = step_fn(ddp, ids)
    times, step_peaks, loss = timed(step, args, cuda)
    peaks, befores = [None] * world, [None] * world
    dist.all_gather_object(peaks, max(step_peaks) if cuda else None)
    dist.all_gather_object(befores, before)
    with CollectiveCounter() as counter:
        step()
    dist.all_reduce(loss)
    median = statistics.median(times)
    counts = counter.counts.as_dict()
    result = dict(step_s=median, step_s_min=min(times), step_s_max=max(times),
                  tokens_per_s_per_gpu=ids.numel() / median, loss=float(loss) / world,
                  all_reduces_per_step=counts["all_reduce"],
                  collectives_per_step={k: v for k, v in counts.items() if k != "by_op"})
    if cuda:
        own = [p - b for p, b in zip(peaks, befores)]
        result.update(peak_bytes=max(own), peak_bytes_per_rank=own, peak_bytes_raw=max(peaks),
                      allocated_before_bytes=befores, step_peaks_bytes=step_peaks)
    if args.trace:  # after the timed and the counted steps: the profiler slows a step
        summary = trace_step(step, cuda=cuda)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {k: summary[k] for k in TRACE_PER_RANK})
        result.update(trace=summary, trace_per_rank=per_rank)
    del ddp, model, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _grad_check(args, planned, config, device, world) -> dict:
    """One DDP step with the grad plan vs rank 0 alone on the concatenated batch (module doc)."""
    cuda = device.type == "cuda"
    rank = dist.get_rank()
    plan = Plan.from_dict(planned["grad_plan"])
    batch, seq = _grad_shape(args)
    generator = torch.Generator().manual_seed(4321 + rank)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
    settle(cuda)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = build_model(config, device="meta", dtype=torch.float32)
        remat.apply(model, plan)
        materialise(model, device, seed=0)
        ddp = _ddp(model, device)
        loss = step_fn(ddp, ids)()
        dist.all_reduce(loss)
        gathered = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered, ids)
        result = None
        if rank == 0:
            result = _compare(model, config, torch.cat(gathered), device)
            result.update(plan=plan.summary(), ddp_loss=float(loss) / world, grad_model=args.grad_model or
                          f"{args.model} cut to {config.num_hidden_layers} layers", grad_batch_per_rank=batch,
                          grad_seq=seq, dtype="float32")
        del ddp, model
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        settle(cuda)  # the other ranks wait here while rank 0 runs the reference
    return result or {}


def _compare(model, config, whole, device) -> dict:
    """Rank 0: the same weights alone (no remat, no DDP) on ``whole``; every parameter's
    ``max|g - g_ref| / max|g_ref|``."""
    ref = build_model(config, device="meta", dtype=torch.float32)
    materialise(ref, device, seed=0)
    named = list(model.named_parameters())
    with torch.no_grad():  # the DDP model's weights exactly, whatever the initialisation did
        for (name, p), (ref_name, q) in zip(named, ref.named_parameters(), strict=True):
            assert name == ref_name and p.shape == q.shape, (name, ref_name)
            q.copy_(p)
    ref_loss = step_fn(ref, whole)()
    diffs = {}
    for (name, p), (_, q) in zip(named, ref.named_parameters()):
        scale = float(q.grad.abs().max())
        diffs[name] = float((p.grad - q.grad).abs().max()) / max(scale, 1e-30)
    worst = max(diffs, key=diffs.get)
    del ref
    return dict(ref_loss=float(ref_loss), rtol=GRAD_RTOL, max_rel_diff=diffs[worst], worst_param=worst,
                passed=all(d <= GRAD_RTOL for d in diffs.values()), rel_diff_per_param=diffs)


def _line(r) -> str:
    if "skipped" in r or "error" in r:
        return f"{r['strategy']:22s} {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r['error']}"
    if r["kind"] == "grad_check":
        return (f"{'grad_check':22s} {'PASS' if r['passed'] else 'FAIL'}: max |g_ddp - g_ref| / max |g_ref| "
                f"{r['max_rel_diff']:.2e} ({r['worst_param']}; rtol {r['rtol']:g}, fp32, {r['grad_model']}, "
                f"[{r['plan']}]); loss ddp {r['ddp_loss']:.6f} ref {r['ref_loss']:.6f}")
    peak = format_size(r["peak_bytes"]) if "peak_bytes" in r else "-"
    error = (r["step_s"] - r["predicted_step_s"]) / r["predicted_step_s"] if r["predicted_step_s"] else 0.0
    return (f"{r['strategy']:22s} peak pred {format_size(r['predicted_peak_bytes']):>10s} meas {peak:>10s}"
            f"  step pred {r['predicted_step_s']:.3f} s meas {r['step_s']:.3f} s ({error:+.1%})  "
            f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU  AR {r['all_reduces_per_step']}"
            + (f" (pred {r['predicted_allreduce_buckets']}; comm {r['predicted_exposed_comm_s']:.3f} s exposed of "
               f"{r['predicted_comm_s']:.3f} s)" if "predicted_allreduce_buckets" in r
               and "predicted_comm_s" in r and "predicted_exposed_comm_s" in r else "")
            + f"  loss {r['loss']:.4f}"
            + (f"  [{r['plan']}]" if "plan" in r else "")
            + (f"\n{'':22s} " + format_breakdown(r["trace"]) if "trace" in r else ""))


if __name__ == "__main__":
    run_then_leave(main)
