"""Where one training step's GPU time goes: a kernel-time breakdown from a ``torch.profiler`` trace.

    from _trace import trace_step, format_breakdown
    summary = trace_step(step, cuda=True)   # one step under torch.profiler (CUDA activities)
    print(format_breakdown(summary))

Used by ``benchmarks/fsdp_bench.py --trace`` / ``--single`` and ``benchmarks/ddp_bench.py
--trace``, always on a step *after* the timed ones: the profiler slows the host side of a step
(kernel launches are recorded), so a traced step is never a timed one.

How: :func:`trace_step` runs ``step()`` once under ``torch.profiler.profile(activities=[CUDA])``
and reads the raw kineto events (no ``FunctionEvent`` tree, so an 8B model's step of ~10^4
kernels is read in milliseconds); :func:`events_from_kineto` keeps the GPU activities (kernels,
memcpys, memsets) as plain tuples ``(name, start_us, dur_us, stream)``. Everything after that
is a pure function of such a list, so it is unit-tested on the CPU with synthetic events
(``tests/test_distributed_scripts.py``):

- :func:`categorise`: a kernel's category from its name, first match wins, in this order:
  ``nccl`` (``nccl``), ``memcpy`` (``Memcpy``/``Memset`` activities: copy engines, not SMs),
  ``attention`` (flash / fmha / sdpa / attention: checked before gemm, since the
  memory-efficient kernels are named ``fmha_cutlass...``), ``fsdp_copy`` (FSDP2's copy-in and
  copy-out around its collectives: ``split_with_sizes_copy_out_contiguous_no_cast_kernel``
  after an all-gather, ``chunk_cat_cuda_kernel`` before a reduce-scatter, and the
  ``_foreach_copy_`` into the all-gather buffer, a ``multi_tensor_apply_kernel`` with a
  ``CopyFunctor``), ``gemm`` (gemm / cutlass / sm90_xmma / nvjet / cublas / splitKreduce),
  ``elementwise`` (the remaining copy, cat, elementwise, reduce and foreach kernels: norms,
  rotary, activations, casts, DDP's bucket copies), ``other``;
- :func:`breakdown`: seconds and kernel counts per category (sums of durations: kernels on two
  streams at once both count), and, on the timeline, the union of the busy time of the compute
  kernels (every kernel that is not nccl, on any stream; memcpys excluded) and of the nccl
  kernels, their intersection (``nccl_overlapped_s``: collectives running while some compute
  kernel runs) and the rest (``nccl_exposed_s``: collectives alone on the GPU), the span from
  the first GPU activity's start to the last one's end, and the time in that span when no
  kernel runs at all (``gpu_idle_s``: launch gaps, host stalls, waits on the CPU) or no
  compute kernel runs (``compute_idle_s`` = exposed nccl + memcpy alone + GPU idle);
- :func:`top_kernels`: the kernels that took the most time, by name.

Limits: the timeline says when kernels run, not what they cost each other: an overlapped nccl
kernel still takes SMs and memory bandwidth from the compute kernel beside it, and that shows
up as longer compute kernels, not as ``nccl_exposed_s``; names are matched as
torch 2.5-2.13 and NCCL 2.2x spell them (an unknown copy kernel falls into ``elementwise``, an
unknown matmul into ``other``: ``top_kernels`` shows which); the trace is of one step on one
rank (the callers gather a few numbers from every rank).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence, Tuple

Event = Tuple[str, float, float, int]  # (name, start_us, dur_us, stream)

CATEGORIES = ("gemm", "attention", "nccl", "fsdp_copy", "elementwise", "memcpy", "other")

# first match wins (lower-case substrings of the kernel's name)
_RULES = (
    ("nccl", ("nccl",)),
    ("memcpy", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("fsdp_copy", ("split_with_sizes_copy", "chunk_cat", "copyfunctor")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "sm80_xmma", "xmma", "nvjet", "cublas", "splitkreduce")),
    ("elementwise", ("copy", "elementwise", "catarray", "reduce_kernel", "multi_tensor_apply", "foreach",
                     "vectorized", "unrolled", "index", "scatter", "gather", "softmax", "norm", "fill")),
)


def categorise(name: str) -> str:
    """The category (one of :data:`CATEGORIES`) of a GPU activity named ``name``."""
    low = name.lower()
    for category, needles in _RULES:
        if any(n in low for n in needles):
            return category
    return "other"


def merge(intervals: Iterable[Tuple[float, float]]) -> list:
    """``[(start, end)]`` sorted and merged into disjoint intervals (empty ones dropped)."""
    out: list = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def intersection_length(a: Iterable[Tuple[float, float]], b: Iterable[Tuple[float, float]]) -> float:
    """Length of (union of ``a``) intersected with (union of ``b``)."""
    a, b = merge(a), merge(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(events: Sequence[Event], wall_s: float | None = None) -> dict:
    """Seconds per category and the timeline's unions (see the module doc) of ``events``,
    a list of ``(name, start_us, dur_us, stream)``. ``wall_s``: the step's host time, recorded
    beside them. Every time in the result is in seconds."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    counts = dict.fromkeys(CATEGORIES, 0)
    compute, nccl, copies, streams = [], [], [], {}
    for name, start, dur, stream in events:
        category = categorise(name)
        seconds[category] += dur
        counts[category] += 1
        span = (start, start + dur)
        (nccl if category == "nccl" else copies if category == "memcpy" else compute).append(span)
        streams.setdefault(stream, []).append(span)
    busy_all = union_length(compute + nccl + copies)
    first = min((s for _, s, _, _ in events), default=0.0)
    last = max((s + d for _, s, d, _ in events), default=0.0)
    span_us = last - first
    compute_busy, nccl_busy = union_length(compute), union_length(nccl)
    overlapped = intersection_length(compute, nccl)
    us = 1e-6
    return {
        "wall_s": None if wall_s is None else round(wall_s, 6),
        "gpu_span_s": round(span_us * us, 6),
        "kernel_s": {k: round(v * us, 6) for k, v in seconds.items()},
        "kernel_counts": counts,
        "compute_busy_s": round(compute_busy * us, 6),
        "nccl_busy_s": round(nccl_busy * us, 6),
        "nccl_overlapped_s": round(overlapped * us, 6),
        "nccl_exposed_s": round((nccl_busy - overlapped) * us, 6),
        "gpu_busy_s": round(busy_all * us, 6),
        "gpu_idle_s": round((span_us - busy_all) * us, 6),
        "compute_idle_s": round((span_us - compute_busy) * us, 6),
        "stream_busy_s": {str(s): round(union_length(v) * us, 6) for s, v in sorted(streams.items())},
    }


def top_kernels(events: Sequence[Event], n: int = 12, width: int = 110) -> list:
    """The ``n`` kernel names (cut to ``width`` characters) with the most total time:
    ``[name, category, seconds, count]``, most first."""
    totals: dict = {}
    for name, _, dur, _ in events:
        t = totals.setdefault(name, [0.0, 0])
        t[0] += dur
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name[:width], categorise(name), round(s * 1e-6, 6), c] for name, (s, c) in ranked]


_GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def events_from_kineto(raw) -> list:
    """``(name, start_us, dur_us, stream)`` of the GPU activities among raw kineto events
    (``profiler.profiler.kineto_results.events()``: objects with ``name()``, ``start_ns()``,
    ``duration_ns()``, ``device_type()``, ``device_resource_id()`` (the CUDA stream) and
    ``activity_type()``), sorted by start."""
    out = []
    for e in raw:
        if "CUDA" not in str(e.device_type()):
            continue
        kind = str(e.activity_type()).lower() if hasattr(e, "activity_type") else "kernel"  # some kinetos: "Kernel"
        if kind not in _GPU_ACTIVITIES:
            continue
        out.append((e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3, int(e.device_resource_id())))
    return sorted(out, key=lambda ev: ev[1])


def trace_step(step: Callable, *, cuda: bool = True, top: int = 12) -> dict:
    """Run ``step()`` once under ``torch.profiler`` (CUDA activities) and return its
    :func:`breakdown` with ``top_kernels``. The step's wall time is host time between two
    device synchronisations, as :func:`remat.prove.bench.timed_steps` times a step (plus the
    profiler's own overhead). On the CPU nothing is traced: the wall time only, with
    ``"note"`` saying so."""
    import torch
    if not cuda:
        start = time.perf_counter()
        step()
        return dict(breakdown([], time.perf_counter() - start), top_kernels=[],
                    note="no GPU: CPU step, no kernels traced")
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = events_from_kineto(prof.profiler.kineto_results.events())
    return dict(breakdown(events, wall), top_kernels=top_kernels(events, top))


def format_breakdown(s: dict) -> str:
    """One line of a :func:`breakdown` for a table."""
    k = s["kernel_s"]
    wall = f"wall {s['wall_s']:.3f} s, " if s.get("wall_s") is not None else ""
    if not any(s["kernel_counts"].values()):
        return f"trace: {wall}no GPU activity" + (f" ({s['note']})" if s.get("note") else "")
    return (f"trace: {wall}GPU span {s['gpu_span_s']:.3f} s, compute busy {s['compute_busy_s']:.3f}, "
            f"nccl busy {s['nccl_busy_s']:.3f} ({s['nccl_overlapped_s']:.3f} overlapped, "
            f"{s['nccl_exposed_s']:.3f} exposed), GPU idle {s['gpu_idle_s']:.3f} | "
            + " ".join(f"{c} {k[c]:.3f}" for c in CATEGORIES if k[c])
            + (f" | {s['note']}" if s.get("note") else ""))
