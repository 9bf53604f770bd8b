"""The GPU profiling paths before and after a change to them (issue 43's profiling request): the same bytes.

One GPU. Each path of ``remat.profile`` that only a GPU takes, on small Llama-shaped models built from
configs (random weights, bf16, SDPA):

- ``cuda``: measured on the GPU and calibrated on a real step (4 layers, hidden 512, batch 2 x 1024);
- ``kernels``: the same with ``kernels=("stock", "liger")`` where liger-kernel imports;
- ``compile``: ``compile=True`` (every block class x treatment compiled; 2 layers, hidden 256, 2 x 256);
- ``compile_blocks``: ``compile="blocks"``;
- ``long``: 65,536 tokens a step (1 x 65,536, 2 layers, hidden 256): the fake-tensor profile at the
  attention rates measured on this GPU (``notes["profiled"]``);
- ``plan``: ``remat.plan`` of the ``cuda`` model at half its ``keep`` peak (``verify`` off).

Bytes on a GPU are the caching allocator's counts, the same from run to run for the same code, while
seconds are not: each record keeps every block cost's and head cost's bytes (seconds left out) and a
hash of them, so two source trees can be compared for the same bytes. ``--src LABEL=PATH``
(repeatable) runs every path once per tree in a fresh process; one path failing records its error and
the others go on.

Usage (repository root, one H100/H200; about 4 minutes for two trees, most of it compiling):
    git archive <commit before> src | tar -x -C /tmp/before
    python3 benchmarks/profile_paths_gpu.py --src before=/tmp/before/src --src after=src --out "$OUT"
Writes ``profile_paths.jsonl`` to ``--out`` and prints a table last: per path and tree, whether it ran,
the seconds it took, and whether its bytes hash equals the first tree's.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback

PATHS = ("cuda", "kernels", "compile", "compile_blocks", "long", "plan")
BYTE_FIELDS = ("fwd_peak", "kept", "out_alive", "out_bytes", "saves_input", "bwd_peak", "bwd_end", "offloadable",
               "offload_bytes", "host_bytes", "grad_bytes")
HEAD_FIELDS = ("mode", "chunk_tokens", "pre_peak", "pre_end", "head_fwd_peak", "head_fwd_end", "head_bwd_peak",
               "head_bwd_end", "pre_bwd_peak", "pre_bwd_end")


def model_of(layers: int, hidden: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                                  max_position_embeddings=131072)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device="cuda", dtype=torch.bfloat16).train()


def ids_of(batch: int, seq: int):
    import torch
    return torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0)).cuda()


def bytes_of(prof) -> dict:
    classes = [{t: [getattr(c, f) for f in BYTE_FIELDS] for t, c in sorted(costs.items())} for costs in prof.classes]
    tiles = [{str(s): {t: [getattr(c, f) for f in BYTE_FIELDS] for t, c in sorted(m.items())} for s, m in sizes.items()}
             for sizes in prof.tiles]
    heads = [[getattr(h, f) for f in HEAD_FIELDS] for h in prof.heads]
    return dict(classes=classes, tiles=tiles, heads=heads, static_bytes=prof.static_bytes, block_class=prof.block_class)


def run_path(path: str) -> dict:
    import torch
    import remat
    start = time.perf_counter()
    torch.cuda.empty_cache()
    if path in ("cuda", "kernels", "plan"):
        model, batch = model_of(4, 512), ids_of(2, 1024)
    elif path == "long":
        model, batch = model_of(2, 256), ids_of(1, 65536)
    else:
        model, batch = model_of(2, 256), ids_of(2, 256)
    record = {}
    if path == "kernels":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return dict(skipped="liger-kernel does not import")
        prof = remat.profile(model, batch, kernels=("stock", "liger"))
    elif path == "compile":
        prof = remat.profile(model, batch, compile=True)
    elif path == "compile_blocks":
        prof = remat.profile(model, batch, compile="blocks")
    elif path == "plan":
        prof = remat.profile(model, batch)
        keep = remat.plan(model, batch, 10 * 2**30, profiled=prof)
        chosen = remat.plan(model, batch, int(keep.notes["predicted_peak_bytes"] * 0.5), profiled=prof)
        record.update(plan=chosen.summary(), predicted_peak_bytes=chosen.notes["predicted_peak_bytes"])
    else:
        prof = remat.profile(model, batch)
    measured = bytes_of(prof)
    notes = {k: (v if isinstance(v, (int, float, bool)) else str(v)[:120]) for k, v in prof.notes.items()
             if k != "profile_seconds"}
    record.update(seconds=round(time.perf_counter() - start, 1), notes=notes,
                  bytes_sha=hashlib.sha256(json.dumps(measured, sort_keys=True).encode()).hexdigest()[:16],
                  bytes=measured)
    return record


def child(path: str) -> None:
    try:
        record = run_path(path)
    except Exception as error:  # one failing path records its error; the others go on
        record = dict(error=f"{type(error).__name__}: {str(error)[:300]}", traceback=traceback.format_exc()[-2000:])
    print("RECORD " + json.dumps(record))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--src", action="append", default=[], help="LABEL=PATH of a remat source tree (repeatable)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    trees = [tuple(s.split("=", 1)) for s in args.src] or [("this", "src")]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(os.path.join(args.out, "profile_paths.jsonl"), "a") as out:
        for path in [p for p in args.paths.split(",") if p]:
            for label, src in trees:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [os.path.abspath(src)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                              if p and os.path.abspath(p) != os.path.abspath("src")]))
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path], env=env,
                                      capture_output=True, text=True, timeout=900)
                line = next((l for l in done.stdout.splitlines() if l.startswith("RECORD ")), None)
                record = json.loads(line[7:]) if line else dict(error=(done.stderr.strip().splitlines() or ["?"])[-1])
                record.update(path=path, tree=label, src=src, date=datetime.datetime.now().isoformat(timespec="seconds"))
                out.write(json.dumps(record) + "\n")
                out.flush()
                rows.append(record)
                print(f"{path:<15} {label:<8} {record.get('error') or record.get('skipped') or record['bytes_sha']}",
                      file=sys.stderr, flush=True)
    first = {}
    print(f"\n{'path':<15} {'tree':<8} {'ran':<5} {'s':>6}  same bytes as the first tree")
    for r in rows:
        sha = r.get("bytes_sha")
        first.setdefault(r["path"], sha)
        same = "-" if sha is None else ("yes" if sha == first[r["path"]] else "NO")
        print(f"{r['path']:<15} {r['tree']:<8} {'yes' if sha else 'no':<5} {r.get('seconds', 0):6.1f}  {same}"
              + (f"  {r.get('error') or r.get('skipped')}" if not sha else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
