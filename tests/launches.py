"""Starting the processes of the multi-process tests, and collecting what they print: the one launcher.

- :func:`launch`: ``world`` rank processes of a worker script (``tests/fsdp_worker.py``,
  ``tests/cp_worker.py``, ``test_offload_safety.py``'s FSDP2 worker), with ``RANK``, ``WORLD_SIZE``
  and ``LOCAL_*`` as torchrun sets them. They meet at a rendezvous file (``torch.distributed``'s
  ``file://`` init) in a temporary directory of the launch's own: the worker joins with
  :func:`workers.init`, which reads its address from :data:`RENDEZVOUS`.
- :func:`torchrun`: the command line of ``torchrun --standalone`` (its rendezvous store binds
  port 0: the operating system picks the port and the store holds it from then on).
- :func:`run_concurrently`: several command lines at once (torchrun launches of the examples and
  benchmarks), so that their startups, mostly importing torch and transformers, overlap.

Why no port number is chosen here: the obvious way (bind a socket to port 0, read its number,
close it, hand the number to the ranks) leaves the port free between the close and rank 0's bind,
and any other process of the machine (another test's launch, another job) may take it then: the
ranks fail to meet or meet the wrong group. A file in a fresh directory belongs to one launch.
"""
import os
import subprocess
import sys
import tempfile

RENDEZVOUS = "REMAT_TEST_RENDEZVOUS"
"""The environment variable that hands a rank the launch's rendezvous (``file://...``)."""

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def launch(script, args, world: int = 2, timeout: int = 600, *, cpu_only: bool = True, cwd=None,
           env=None) -> list:
    """Start ``world`` ranks of ``script`` (``python script *args``) and wait for them.

    Args:
        script, args: the worker and its arguments; it joins with :func:`workers.init`.
        world: the number of ranks.
        timeout: seconds each rank may run; one still running then (or after another failed to
            start) is killed.
        cpu_only: hide the GPUs (``CUDA_VISIBLE_DEVICES=""``) and give each rank one torch thread.
        cwd, env: the ranks' working directory, and variables over this process's environment.

    Returns:
        ``[(returncode, stdout, stderr)]`` of the finished ranks, rank 0 first.
    """
    with tempfile.TemporaryDirectory(prefix="remat-rendezvous-") as directory:
        common = dict(os.environ, **(env or {}), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      **{RENDEZVOUS: "file://" + os.path.join(directory, "store")})
        if cpu_only:
            common.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs = [subprocess.Popen([sys.executable, script, *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=dict(common, RANK=str(rank), LOCAL_RANK=str(rank)))
                 for rank in range(world)]
        results = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=timeout)
                results.append((proc.returncode, out, err))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return results


def torchrun(script, args, nproc: int = 2) -> list:
    """The command line of ``torchrun --standalone --nproc-per-node nproc script *args``."""
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), script, *args]


def run_concurrently(commands: dict, *, cwd, env, timeout: int = 600) -> dict:
    """``{name: (output, returncode)}`` for each ``{name: argv}`` of ``commands``, stdout and stderr
    together; a launch still running when another fails or times out is killed."""
    procs = {k: subprocess.Popen(c, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for k, c in commands.items()}
    results = {}
    try:
        for name, proc in procs.items():
            results[name] = (proc.communicate(timeout=timeout)[0], proc.returncode)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
