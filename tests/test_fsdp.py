"""remat.apply before FSDP2 fully_shard: same gradients (gloo, one CPU process)."""
import os
import socket
import subprocess
import sys

import pytest


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_fsdp2_supported() -> bool:
    import torch  # torch 2.6's FSDP2 calls Stream.record_event, which its CPU stream lacks
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 7)


@pytest.mark.skipif(not _cpu_fsdp2_supported(), reason="FSDP2 on the CPU needs torch >= 2.7")
@pytest.mark.parametrize("spec", ["full", "selective", "attention"])
def test_apply_then_fully_shard_gives_same_gradients(spec):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    worker = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
    result = subprocess.run([sys.executable, worker, spec], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "OK", result.stdout
