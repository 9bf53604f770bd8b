"""Running several command lines at once (torchrun launches of the examples and benchmarks) and
collecting each one's output and exit code: the distributed tests start every launch first, so
that their startups overlap, then wait for them all."""
import subprocess


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
    return results
