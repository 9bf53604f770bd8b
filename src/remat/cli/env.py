"""``remat env``: what this machine offers remat: versions, GPU, host and pinned memory.

Sizes are collected as byte counts (``*_bytes`` keys, so ``--json`` gives numbers a
script can compare) and printed with :func:`remat.units.format_size`, so an 8 MiB
memlock limit reads ``8.00 MiB``, not ``0.01 GiB``. Below the values, lines say what they mean
for remat (:func:`meaning`): how much pinned host memory offload may take (its pool's limit,
60% of available host memory: :mod:`remat.offload.pinned`), whether offload runs at all (it
needs CUDA), and what the memlock limit bounds. That limit is ``mlock``'s: CUDA's pinned
buffers, which offload uses, are pinned by the driver and are not counted against it; what a
small one breaks is RDMA (NCCL over InfiniBand registers memory under it).
"""
from __future__ import annotations

import json
import os
import platform

HELP = "versions, GPU and host memory limits (pinned memory is what offload can use)"
EXAMPLES = """examples:
  remat env
  remat env --json
"""


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (sizes in bytes)")


def collect() -> dict:
    """Versions and limits; sizes in bytes under ``*_bytes`` keys (memlock: None if unlimited)."""
    import resource

    import torch

    from remat import __version__
    info = {"remat": __version__, "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                    compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    info.update(_host_memory())
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info["memlock_limit_bytes"] = None if soft == resource.RLIM_INFINITY else soft
    info["cpu_count"] = os.cpu_count()
    return info


def _host_memory() -> dict:
    # MemAvailable bounds how much pinned host memory offload can take
    from remat.offload import HOST_FRACTION, host_memory
    memory = host_memory()
    return {"host_memory_bytes": memory["total"] or 0, "host_available_bytes": memory["available"],
            "offload_pinned_limit_bytes": int(memory["available"] * HOST_FRACTION)}


def meaning(info: dict) -> list:
    """What the values mean for remat, one line each (offload, pinned memory, memlock)."""
    from remat.units import format_size
    lines = []
    limit = info.get("offload_pinned_limit_bytes")
    if info.get("cuda_available"):
        lines.append(f"offload: pins at most {format_size(limit)} of host memory (60% of what is available now); "
                     "a plan that offloads more stops with an error naming the bytes")
    else:
        lines.append("offload: needs CUDA; on this machine offloaded blocks keep their tensors in place (no host "
                     "copies, no memory saved). Plans made here for a GPU (--gpu h100) offload on that GPU")
    memlock = info.get("memlock_limit_bytes")
    if memlock is None:
        lines.append("memlock: unlimited")
    else:
        lines.append(f"memlock: {format_size(memlock)} is mlock()'s limit; CUDA's pinned buffers, which offload uses, "
                     "are pinned by the driver and not counted against it. Raise it (ulimit -l unlimited) for NCCL "
                     "over InfiniBand, which registers memory under it")
    return lines


def text_lines(info: dict) -> list:
    """``key  value`` lines, sizes in the unit that fits them."""
    from remat.units import format_size
    shown = {}
    for key, value in info.items():
        if key.endswith("_bytes"):
            key = key[:-len("_bytes")]
            value = "unlimited" if value is None else format_size(value)
        shown[key] = value
    width = max(map(len, shown))
    return [f"{key:<{width}}  {value}" for key, value in shown.items()]


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info))
        return 0
    for line in text_lines(info):
        print(line)
    print()
    for line in meaning(info):
        print(line)
    return 0
