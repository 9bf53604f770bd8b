"""``remat env``: what this machine offers remat: versions, GPU, host and pinned memory."""
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def collect() -> dict:
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
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_GiB=round(props.total_memory / 2**30, 2),
                    compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    info.update(_host_memory())
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info["memlock_limit"] = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.2f} GiB"
    info["cpu_count"] = os.cpu_count()
    return info


def _host_memory() -> dict:
    # /proc/meminfo: MemAvailable bounds how much pinned host memory offload can take.
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return {"host_memory_GiB": round(values.get("MemTotal", 0) / 2**30, 2),
            "host_available_GiB": round(values.get("MemAvailable", 0) / 2**30, 2)}


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0
