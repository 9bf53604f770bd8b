"""One row of a torchrun benchmark (``fsdp_bench.py``, ``ddp_bench.py``): a strategy made, stepped, recorded.

Every row of those benchmarks builds a fresh model, makes it one strategy (:func:`prepare`:
no checkpointing, torch's ``apply_activation_checkpointing``, Hugging Face checkpointing or a
remat plan; each block compiled for a ``+compile`` row), wraps it (FSDP2 or DDP, the caller's
part), and times the protocol's step (:func:`step_fn`: ``zero_grad``, forward with labels,
``backward``) after warm-up steps (:func:`timed`, Python's garbage collector out of the timed
steps with ``--gc manual``). Between rows :func:`settle` frees what the last one left and lines
the ranks up. :func:`measured_row` skips a row whose predicted peak would not fit the GPU (an
out-of-memory on one rank would hang the others in a collective) and records an error every
rank raises alike; :func:`kept` writes each record as its row ends (rank 0), :func:`finished`
leaves the process group, and :func:`run_then_leave` runs a script's ``main`` and leaves without
the interpreter's teardown.
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import remat
from remat.integrations.collector import EVERY, StepCollector
from remat.prove.bench import timed_steps
from remat.units import format_size

# what every rank reports of its own traced step (rank 0's whole breakdown is in the record)
TRACE_PER_RANK = ("wall_s", "gpu_span_s", "compute_busy_s", "nccl_busy_s", "nccl_exposed_s", "gpu_idle_s")


def kept(records: list, record: dict, path: str, line) -> None:
    """``record`` added to ``records``; rank 0 appends it to ``path`` (JSON lines) at once, so a
    run cut short (a time limit, a hang in a later row) keeps the rows it finished, and prints
    ``line(record)``."""
    records.append(record)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(line(record), flush=True)


def finished(records: list) -> list:
    """Every rank leaves the process group; returns ``records``."""
    dist.destroy_process_group()
    return records


def run_then_leave(main) -> None:
    """``main()``, then exit 0 without the interpreter's teardown once it returned (an exception
    exits as usual). At teardown torch 2.13 (CPU) aborted a rank that had finished and written its
    rows ("terminate called without an active exception": a native thread, likely the profiler's,
    still joinable), about one run in ten (CI, ``fsdp_bench.py``; ``tests/fsdp_worker.py`` does the same)."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measured_row(record: dict, predicted_peak: int, device, measure) -> dict:
    """``record`` updated with ``measure()``'s result; skipped with the reason when the predicted
    peak exceeds 97% of the GPU (an out-of-memory on one rank would leave the others waiting in a
    collective); a raise is recorded as the row's error (every rank runs the same code, so every
    rank raises alike and the next row runs)."""
    cuda = device.type == "cuda"
    limit = torch.cuda.get_device_properties(device).total_memory if cuda else None
    if limit and predicted_peak > 0.97 * limit:
        record["skipped"] = f"predicted peak {format_size(predicted_peak)} > 97% of this GPU's {format_size(limit)}"
        return record
    try:
        record.update(measure())
    except Exception as e:  # noqa: BLE001 - a crash is a result
        record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return record


def compiled_row(name: str) -> bool:
    """Whether row ``name`` compiles its blocks (``eager+compile``, ``remat+compile@20GiB``)."""
    return "+compile" in name


def prepare(name, plan, model):
    """Make ``model`` (on meta) the strategy ``name``; returns the modules to shard, in order,
    each compiled for a ``+compile`` row."""
    layers = list(remat.discover(model).block_names)
    blocks = _checkpointed(name.replace("+compile", ""), plan, model, layers)
    if compiled_row(name):
        for block in blocks:
            block.compile()
    return blocks


def _checkpointed(name, plan, model, layers):
    """``model`` with strategy ``name``'s checkpointing (eager: none); returns its layers."""
    if name == "torch_ac":
        from functools import partial

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        layer_types = tuple({type(model.get_submodule(n)) for n in layers})
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layer_types))
        return [model.get_submodule(n) for n in layers]  # the wrappers now sit at the layers' names
    if name == "hf_full":
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif plan is not None:
        remat.apply(model, plan)
    return [model.get_submodule(n) for n in layers]


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
"""Caching-allocator events that synchronise the host with the GPU (``cudaMalloc``/``cudaFree``, a
retry that frees the cache to allocate again): a rank that meets one mid-step stalls, and every
other rank waits for it at the next collective."""


def allocator_events(cuda) -> dict:
    """This rank's :data:`ALLOCATOR_EVENTS` since :func:`timed`'s warm-up ended ({} on the CPU)."""
    if not cuda:
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_EVENTS}


def settle(cuda) -> int:
    """Free what earlier rows left (cycles, cached blocks, collectives in flight); this rank's
    allocated bytes after that (0 on the CPU)."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    return 0


def step_fn(model, ids):
    """The protocol's step on ``model`` (FSDP2-wrapped or not): returns the detached loss."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()
    return step


def timed(step, args, cuda):
    """``--warmup`` steps, then ``--steps`` timed ones: (seconds of each, each one's peak
    allocated bytes (None on the CPU), the last loss). With ``--gc manual`` Python's garbage
    collector runs before them and not during them: a collection on one rank in the middle of
    a step holds every other rank at the next collective. The allocator's event counts start
    at zero after the warm-up: :func:`allocator_events` right after this reads the timed steps'."""
    collector = StepCollector(EVERY if args.gc == "manual" else 0)   # what examples/train_fsdp.py runs
    collector.start()
    try:
        timed_steps(step, args.warmup, cuda=cuda)
        if cuda:
            torch.cuda.reset_accumulated_memory_stats()
        times, step_peaks, loss = [], [], None
        for _ in range(args.steps):  # the peak of each step, so that one odd step shows
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds, loss = timed_steps(step, 1, cuda=cuda)
            times += seconds
            step_peaks.append(torch.cuda.max_memory_allocated() if cuda else None)
    finally:
        collector.stop()
    return times, step_peaks, loss


