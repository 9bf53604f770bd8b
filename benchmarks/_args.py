"""The arguments every GPU benchmark script here shares: model, shapes, steps, output folder."""
import argparse
import os


def bench_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="preset or config.json path")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p


def distributed_parser(doc: str) -> argparse.ArgumentParser:
    """:func:`bench_parser` plus what the torchrun benchmarks (FSDP2, DDP) share: per-GPU budgets,
    the device, how rank 0 profiles, the kernel-time trace and the garbage collector."""
    p = bench_parser(doc)
    p.add_argument("--budgets", help="per-GPU budgets, comma-separated (default: see the docstring)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--profile", choices=("cuda", "fake"),
                   help="how rank 0 profiles: on its GPU (default on CUDA) or with fake tensors")
    p.add_argument("--trace", action="store_true",
                   help="one more step per row under torch.profiler: rank 0 records its kernel-time breakdown")
    p.add_argument("--gc", choices=("auto", "manual"), default="auto",
                   help="Python's garbage collector during a row's steps: auto (Python's default) or manual "
                        "(collected before them and off while they run, as torchtitan and torchtnt train)")
    return p
