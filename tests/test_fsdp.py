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


@pytest.mark.parametrize("spec", ["full", "selective", "attention"])
def test_apply_then_fully_shard_gives_same_gradients(spec):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    worker = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
    result = subprocess.run([sys.executable, worker, spec], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "OK", result.stdout
