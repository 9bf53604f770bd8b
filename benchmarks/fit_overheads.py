"""Refit FSDP2's overheads (:class:`remat.planning.sharding.Overheads`) from traced bench rows.

    python benchmarks/fit_overheads.py benchmarks/results/issue12/h100x4_fsdp_bench_cuda_profile_rs_buffers.jsonl \\
        benchmarks/results/issue12/h100x2_fsdp_bench_cuda_profile.jsonl [--fit-on eager,torch_ac] [--out fit.json]

Input: ``benchmarks/fsdp_bench.py --trace`` records (JSON lines), whose plans were predicted
from a profile *measured* on the GPU (``"profile": "cuda"``: a fake-tensor profile's roofline
error would be fitted as an FSDP2 overhead). Each record carries the simulator's prediction
split into terms and rank 0's kernel-time breakdown of one traced step (:mod:`_trace`).

How, per record (the constants it was predicted with are its ``overheads``; records made before
they were written down used the provisional ones, :data:`PROVISIONAL`):

- the model's terms, recovered from the prediction: the link-busy seconds that overlapped compute
  (``predicted_comm_contention_s / contention``), the bytes FSDP2's copies move
  (``predicted_comm_copy_s x fraction x HBM``), the collectives launched
  (``predicted_comm_launch_s / latency``) and the compute alone (``predicted_compute_s`` less the
  three overhead terms);
- the trace's: the copy kernels' seconds (``fsdp_copy``) and the compute kernels' (the compute
  stream's busy time less those copies);
- ``slowdown_s`` = compute kernels measured - compute alone predicted: what running beside NCCL
  costs the compute (``contention`` = summed slowdown / summed link overlap);
  ``hbm_Bps_fraction`` = summed copy bytes / summed copy seconds / HBM;
- ``host_s``: what the measured step has beyond compute alone, the slowdown and copies at the
  fitted constants and the predicted exposed communication -- FSDP2's hooks, stream waits, idle
  gaps, exposed collectives the link model misses -- charged per collective (``latency_s``).

The fit uses the rows named by ``--fit-on`` (default the stock strategies ``eager`` and
``torch_ac``); every row is then re-predicted with the fitted constants, the held-out ones (remat's
plans, ``hf_full``) being the check. The re-prediction adds the terms again at the new constants;
it does not re-run the simulator, so a phase's exposed communication stays what it was (the
stretch moves it by well under 1%).
"""
from __future__ import annotations

import argparse
import json
import sys

from remat.planning.costs import GPUS
from remat.planning.sharding import Overheads

PROVISIONAL = Overheads(hbm_Bps_fraction=0.8, contention=0.2, latency_s=50e-6)
"""The constants every ``fsdp_bench`` record was predicted with before records named theirs."""


def hbm_Bps(gpu_name: str) -> float:
    """The :data:`remat.planning.costs.GPUS` HBM bandwidth of a GPU named as torch names it."""
    name = gpu_name.lower()
    key = next((g for g in ("h200", "h100", "a100") if g in name), None)
    if key is None:
        raise ValueError(f"no HBM bandwidth in remat.planning.costs.GPUS for GPU {gpu_name!r} (h100, h200, a100)")
    return GPUS[key]["hbm_GBps"] * 1e9


def terms(record: dict) -> dict:
    """The model's and the trace's seconds and bytes of one traced FSDP2 record (see the module doc)."""
    used = Overheads(**record["overheads"]) if "overheads" in record else PROVISIONAL
    hbm = hbm_Bps(record["gpu"])
    contention_s, copy_s, launch_s = (record[f"predicted_comm_{k}_s"] for k in ("contention", "copy", "launch"))
    trace = record["trace"]
    measured_copy_s = trace["kernel_s"]["fsdp_copy"]
    return dict(strategy=record["strategy"], world=record["world"], step_s=record["step_s"],
                predicted_step_s=record["predicted_step_s"], exposed_s=record["predicted_exposed_comm_s"],
                alone_s=record["predicted_compute_s"] - contention_s - copy_s - launch_s,
                overlap_s=contention_s / used.contention if used.contention else 0.0,
                copy_bytes=copy_s * used.hbm_Bps_fraction * hbm, collectives=launch_s / used.latency_s,
                hbm_Bps=hbm, measured_copy_s=measured_copy_s,
                measured_compute_s=trace["compute_busy_s"] - measured_copy_s)


def rows(paths) -> list:
    """:func:`terms` of every traced FSDP2 row measured from a GPU-profiled plan in ``paths``."""
    found = []
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("kind") == "single" or "trace" not in record or "step_s" not in record:
                    continue
                if record.get("profile") != "cuda":
                    raise ValueError(f"{path}: {record['strategy']} was planned from a {record.get('profile')!r} "
                                     "profile; fit only rows predicted from a profile measured on the GPU "
                                     "(fsdp_bench.py --profile cuda)")
                found.append(dict(terms(record), source=path))
    return found


def predict(row: dict, overheads: Overheads) -> float:
    """``row``'s step time with ``overheads`` in place of the constants it was predicted with."""
    return (row["alone_s"] + overheads.contention * row["overlap_s"]
            + row["copy_bytes"] / (overheads.hbm_Bps_fraction * row["hbm_Bps"])
            + overheads.latency_s * row["collectives"] + row["exposed_s"])


def fit(found: list, fit_on=("eager", "torch_ac")) -> Overheads:
    """The :class:`Overheads` that the rows whose strategy is in ``fit_on`` measured, pooled."""
    chosen = [r for r in found if r["strategy"] in fit_on]
    if not chosen:
        raise ValueError(f"no row of strategy {', '.join(fit_on)} to fit on; the rows are: "
                         f"{', '.join(sorted({r['strategy'] for r in found})) or 'none'}")
    hbm = chosen[0]["hbm_Bps"]
    if any(r["hbm_Bps"] != hbm for r in chosen):
        raise ValueError("the rows to fit on come from GPUs with different HBM bandwidths; fit one GPU kind at a time")
    sums = dict(copy_bytes=sum(r["copy_bytes"] for r in chosen), copy_s=sum(r["measured_copy_s"] for r in chosen),
                hbm_Bps=hbm, overlapped_s=sum(r["overlap_s"] for r in chosen),
                slowdown_s=max(0.0, sum(r["measured_compute_s"] - r["alone_s"] for r in chosen)),
                collectives=sum(r["collectives"] for r in chosen))
    without_host = Overheads.fit(**sums, host_s=0.0)  # the copies and contention first, then what is left
    host = sum(r["step_s"] - predict(r, without_host) for r in chosen)
    return Overheads.fit(**sums, host_s=max(0.0, host))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="fsdp_bench.py --trace --profile cuda JSON-lines files")
    p.add_argument("--fit-on", default="eager,torch_ac", help="strategies to fit on (default: eager,torch_ac)")
    p.add_argument("--out", help="write the constants and every row's re-prediction here (JSON)")
    args = p.parse_args(argv)
    found = rows(args.records)
    fit_on = tuple(args.fit_on.split(","))
    fitted = fit(found, fit_on)
    print(f"fitted: hbm_Bps_fraction={fitted.hbm_Bps_fraction:.3f} contention={fitted.contention:.3f} "
          f"latency_s={fitted.latency_s * 1e3:.3f} ms  (on {args.fit_on})")
    report = []
    for r in found:
        new = predict(r, fitted)
        report.append(dict(source=r["source"], strategy=r["strategy"], world=r["world"], step_s=round(r["step_s"], 4),
                           before_s=round(r["predicted_step_s"], 4), after_s=round(new, 4),
                           error_before=round((r["step_s"] - r["predicted_step_s"]) / r["predicted_step_s"], 4),
                           error_after=round((r["step_s"] - new) / new, 4), fitted_on=r["strategy"] in fit_on))
        print(f"world {r['world']} {r['strategy']:18s} measured {r['step_s']:.3f} s  "
              f"predicted {r['predicted_step_s']:.3f}"
              f" ({report[-1]['error_before']:+.1%})  refit {new:.3f} ({report[-1]['error_after']:+.1%})"
              f"{'  [fit]' if report[-1]['fitted_on'] else ''}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(overheads=dict(hbm_Bps_fraction=fitted.hbm_Bps_fraction, contention=fitted.contention,
                                          latency_s=fitted.latency_s), fit_on=args.fit_on, records=args.records,
                           rows=report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
