"""Planning speed (issue 45): CPU seconds of ``remat.plan`` on tiny models and of ``remat plan`` on presets and configs.

No GPU: every case plans with fake tensors (a model on the CPU or the meta device) at the h100's rates,
as a newcomer's first ``remat.plan`` does. Each case runs in a fresh process, and what is reported is
*CPU* time (user + system, from ``resource.getrusage``), not wall time: the machine these were taken on
is shared, and CPU time is what a loaded machine does not inflate.

Cases:

- ``api:NAME`` (``jamba``, ``llama``, ``vit``, ``bert``, ``t5``): a 4-layer model built from its config
  (hidden 64, dropout on, random weights), then ``remat.plan(model, batch, "1GiB")`` on a batch of 2 x 64
  tokens (ViT: 2 images of 32 x 32). Reported: the CPU seconds of the ``remat.plan`` call alone
  (``plan_s``; the model's import and build are ``import_s`` and ``build_s``), then a second
  ``remat.plan`` of the same model and batch at 60% of the first plan's peak (:data:`AGAIN`) in the same process (``again_s``).
- ``cli:NAME``: the whole ``remat plan ...`` command as a user types it (interpreter, imports, building on
  the meta device, profiling, solving, simulating, printing): ``llama-tiny``, ``llama-1b``, ``qwen-1.5b``,
  ``llama-8b`` (``--batch 4 --seq 4096 --budget 40GiB``), ``gemma2-2b`` (a Gemma-2-2B-shaped config
  file: 26 layers, hidden 2304, head dim 256, sliding and global layers), ``qwen2-vl-2b`` and
  ``llama-70b`` (``--fsdp 8``).

Each record holds what the plan is (``plan.summary()``, the predicted peak and step, a hash of the plan's
JSON, or for a command a hash of everything it printed on stdout), so before and after can be checked
for the same plans as well as timed.

Before and after in one call: ``--src LABEL=PATH`` (repeatable) runs every case once per remat source
tree, with ``PYTHONPATH=PATH``; ``--repeat N`` runs each case N times and keeps the lowest CPU time.

Usage (repository root; a few minutes on two cores):
    git archive main src | tar -x -C /tmp/before   # any copy of another tree's src/
    python benchmarks/planning_speed.py --src before=/tmp/before/src --src after=src --out "$OUT"
Writes ``planning_speed.jsonl`` to ``--out`` (one JSON line per case and tree, the environment in each)
and prints a table last. ``--cases api:llama,cli:llama-8b`` picks cases; ``--profile DIR`` writes a
cProfile of each run there (``python -m pstats``).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

API = ("jamba", "llama", "vit", "bert", "t5")
GEMMA2 = dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
              max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
              final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True)
CLI = {
    "llama-tiny": ["--model", "llama-tiny", "--batch", "2", "--seq", "64", "--budget", "1GiB"],
    "llama-1b": ["--model", "llama-1b", "--batch", "4", "--seq", "4096", "--budget", "24GiB"],
    "qwen-1.5b": ["--model", "qwen-1.5b", "--batch", "4", "--seq", "4096", "--budget", "24GiB"],
    "llama-8b": ["--model", "llama-8b", "--batch", "4", "--seq", "4096", "--budget", "40GiB"],
    "gemma2-2b": ["--model", "{gemma2}", "--batch", "4", "--seq", "4096", "--budget", "40GiB"],
    "qwen2-vl-2b": ["--model", "qwen2-vl-2b", "--batch", "2", "--seq", "2048", "--budget", "24GiB"],
    "llama-70b": ["--model", "llama-70b", "--batch", "1", "--seq", "4096", "--budget", "60GiB", "--fsdp", "8"],
}
AGAIN = 0.6
"""The budget of the second remat.plan of a tiny case, as a share of the first plan's peak: tight
enough that blocks are treated."""
CASES = tuple(f"api:{n}" for n in API) + tuple(f"cli:{n}" for n in CLI)


def cpu_s(who=resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def build(name: str):
    """``(model, batch)`` of a tiny case: 4 layers, hidden 64, dropout on, built from its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BertForMaskedLM, T5ForConditionalGeneration, \
        ViTForImageClassification
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 64))
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    if name == "jamba":
        config = AutoConfig.for_model("jamba", vocab_size=512, num_key_value_heads=2, attn_layer_period=2,
                                      attn_layer_offset=1, num_experts=4, expert_layer_period=2,
                                      expert_layer_offset=1, mamba_dt_rank=8, use_mamba_kernels=False, **sizes)
        return AutoModelForCausalLM.from_config(config).train(), {"input_ids": ids, "labels": ids}
    if name == "llama":
        config = AutoConfig.for_model("llama", vocab_size=512, num_key_value_heads=2, max_position_embeddings=1024,
                                      **sizes)
        return AutoModelForCausalLM.from_config(config).train(), {"input_ids": ids, "labels": ids}
    if name == "bert":
        config = AutoConfig.for_model("bert", vocab_size=512, max_position_embeddings=128, **sizes)
        return BertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}
    if name == "t5":
        config = AutoConfig.for_model("t5", vocab_size=512, d_model=64, d_ff=128, num_layers=4, num_heads=4,
                                      d_kv=16, decoder_start_token_id=0, pad_token_id=0)
        return T5ForConditionalGeneration(config).train(), {"input_ids": ids, "labels": ids}
    if name == "vit":
        config = AutoConfig.for_model("vit", image_size=32, patch_size=4, num_channels=3, num_labels=10, **sizes)
        return ViTForImageClassification(config).train(), {"pixel_values": torch.randn(2, 3, 32, 32),
                                                           "labels": torch.tensor([1, 2])}
    raise ValueError(f"no tiny case {name!r}; the cases are {', '.join(API)}")


def plan_record(plan) -> dict:
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return dict(summary=plan.summary(), predicted_peak_bytes=plan.notes.get("predicted_peak_bytes"),
                predicted_step_s=plan.notes.get("predicted_step_s"), plan_sha=hashlib.sha256(text.encode()).hexdigest()[:16])


def child_api(name: str, profile_path=None) -> dict:
    start = cpu_s()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import warnings
    import remat
    imported = cpu_s()
    model, batch = build(name)
    built = cpu_s()
    profiler = None
    if profile_path:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, "1GiB")
        planned = cpu_s()
        try:
            again = plan_record(remat.plan(model, batch, int(AGAIN * plan.notes["predicted_peak_bytes"])))
        except remat.NoPlanFits as error:
            again = dict(error=str(error)[:200])
    done = cpu_s()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    return dict(import_s=imported - start, build_s=built - imported, plan_s=planned - built, again_s=done - planned,
                again=again, **plan_record(plan))


def run_case(case: str, src: str, profile_path=None) -> dict:
    env = dict(os.environ, PYTHONPATH=src, PYTHONHASHSEED="0")
    kind, name = case.split(":", 1)
    before = cpu_s(resource.RUSAGE_CHILDREN)
    if kind == "api":
        command = [sys.executable, os.path.abspath(__file__), "--child", name] + (
            ["--profile-to", profile_path] if profile_path else [])
    else:
        config = os.path.join(tempfile.gettempdir(), "gemma2-2b-like.json")  # one name: it is in what the command prints
        with open(config, "w") as f:
            json.dump(GEMMA2, f)
        args = [a.replace("{gemma2}", config) for a in CLI[name]]
        script = os.path.join(tempfile.gettempdir(), "remat_plan_cli.py")
        with open(script, "w") as s:
            s.write("import sys\nfrom remat.cli import main\nsys.exit(main(sys.argv[1:]))\n")
        runner = ["-m", "cProfile", "-o", profile_path] if profile_path else []
        command = [sys.executable] + runner + [script, "plan"] + args
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    total = cpu_s(resource.RUSAGE_CHILDREN) - before
    record = dict(case=case, total_cpu_s=round(total, 2), rc=done.returncode)
    if done.returncode != 0:
        record["error"] = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else ["(no stderr)"]
        return record
    if kind == "api":
        record.update(json.loads(done.stdout.strip().splitlines()[-1]))
        for key in ("import_s", "build_s", "plan_s", "again_s"):
            record[key] = round(record[key], 2)
    else:
        lines = done.stdout.splitlines()
        record.update(summary=next((line[11:] for line in lines if line.startswith("plan ")), None),
                      stdout_sha=hashlib.sha256(done.stdout.encode()).hexdigest()[:16])
    return record


def environment() -> dict:
    import torch
    import transformers
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, cpus=os.cpu_count(),
                load=os.getloadavg()[0], machine=platform.machine())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--src", action="append", default=[], help="LABEL=PATH of a remat source tree (repeatable)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeat", type=int, default=1, help="runs per case and tree; the lowest CPU time is kept")
    parser.add_argument("--profile", default=None, help="a folder for one cProfile per case and tree")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child_api(args.child, args.profile_to)))
        return 0
    trees = [tuple(s.split("=", 1)) for s in args.src] or [("this", os.path.join(os.path.dirname(__file__), "..", "src"))]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; the cases are {', '.join(CASES)}")
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    rows = []
    with open(os.path.join(args.out, "planning_speed.jsonl"), "a") as out:
        for case in cases:
            for label, src in trees:
                best = None
                for attempt in range(max(1, args.repeat)):
                    path = None
                    if args.profile:
                        os.makedirs(args.profile, exist_ok=True)
                        path = os.path.join(args.profile, f"{label}_{case.replace(':', '_')}.prof")
                    record = run_case(case, os.path.abspath(src), path)
                    if best is None or record.get("total_cpu_s", 1e9) < best.get("total_cpu_s", 1e9):
                        best = record
                best = dict(best, tree=label, src=src, **env)
                out.write(json.dumps(best) + "\n")
                out.flush()
                rows.append(best)
                print(f"{case:<16} {label:<8} {best.get('total_cpu_s', float('nan')):7.2f} s CPU"
                      + (f"  plan {best['plan_s']:.2f} s, again {best['again_s']:.2f} s" if "plan_s" in best else "")
                      + f"  {best.get('summary') or best.get('error')}", file=sys.stderr, flush=True)
    print(f"\n{'case':<16} {'tree':<8} {'CPU s':>7} {'plan s':>7} {'again s':>8}  plan")
    for r in rows:
        print(f"{r['case']:<16} {r['tree']:<8} {r.get('total_cpu_s', float('nan')):7.2f} "
              f"{r.get('plan_s', float('nan')):7.2f} {r.get('again_s', float('nan')):8.2f}  "
              f"{r.get('summary') or r.get('error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
