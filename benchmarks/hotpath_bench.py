"""The hot path of a training step (issue 31): the chunked head's host syncs and time, the Guard's overhead.

One GPU, the bench model (``llama-1b`` preset: Llama-3.2-1B's shapes, bf16, SDPA, batch 4 x 4096,
random ids, ``labels=ids``), gradient accumulation 4 (four micro-steps add to the gradients, then
``zero_grad(set_to_none=True)``; no optimizer, so that only what is measured differs). Parts:

- ``head``: the chunked loss alone (``chunked_cross_entropy`` on [16384 x 2048] bf16 hidden states and
  the [128256 x 2048] head, every 5th target ignored), forward and backward: host syncs per call,
  counted by CUDA (``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronising call),
  and the median call time; with the targets on the GPU and (``targets=host``) on the CPU.
- ``step``: the model with ``remat.apply(model, --spec, head="chunked")``: syncs per micro-step (the
  whole step's, transformers' own included: compare rows, not to zero) and the median micro-step
  time over rounds of 4 micro-steps.
- ``guard``: the same model, a plain loop against the same loop through ``remat.Guard`` (the plan
  applied, so the Guard does not re-plan: only its per-step work is timed), rounds interleaved;
  micro-step time of each, and the overhead. ``guard_trainer``: ``Trainer.training_step`` as
  ``guard_trainer`` patches it against the class's own, rounds interleaved (the callback given the
  model and budget ``on_train_begin`` would give it); where the Trainer cannot be driven so (another
  transformers), ``remat.guard.redo_out_of_memory`` around the same step: what guard_trainer runs.

Before and after in one call: ``--src LABEL=PATH`` (repeatable) runs the parts once per remat source
tree, each in a fresh process with ``PYTHONPATH=PATH`` (main's tree and this branch's), records
labelled; imports fall back across layouts (``remat.head`` or ``remat.treat.head``). Without
``--src``, the remat this process imports, labelled ``--label``.

Usage (repository root, one H100; about 2.5 minutes for two trees):
    git worktree add /tmp/main main   # or any copy of main's src/
    python3 benchmarks/hotpath_bench.py --src before=/tmp/main/src --src after=src --out "$OUT/hotpath.jsonl"
Writes JSON lines (one per result, the environment in each) to ``--out`` and prints a table last.
``--device cpu --model llama-tiny --batch 2 --seq 64`` runs the plumbing on a CPU (no syncs there).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

ACCUMULATE = 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "hotpath.jsonl"))
    parser.add_argument("--src", action="append", default=[], help="LABEL=PATH of a remat source tree (repeatable)")
    parser.add_argument("--label", default="this")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--spec", default="keep", help="the blocks' treatment in the step and guard parts")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of 4 micro-steps per variant")
    parser.add_argument("--calls", type=int, default=6, help="timed calls of the loss op alone")
    parser.add_argument("--parts", default="head,step,guard,guard_trainer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one tree of --src's
    return parser.parse_args(argv)


# ---- what differs between remat layouts ------------------------------------------------------
def _chunked_cross_entropy():
    try:
        from remat.head import chunked_cross_entropy
    except ImportError:
        from remat.treat.head import chunked_cross_entropy
    return chunked_cross_entropy


def _presets():
    try:
        from remat.presets import build_model, load_config
    except ImportError:
        from remat.prove.presets import build_model, load_config
    return build_model, load_config


# ---- measuring ---------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def counted_syncs(device):
    """CUDA's synchronising calls inside the block: the yielded list holds one line per call once it ends."""
    import torch
    caught = []
    if device.type != "cuda":
        yield caught
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
    caught.extend(str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message))


def _median(values):
    return statistics.median(values) if values else None


def head_part(args, device, env, emit):
    import torch
    chunked_cross_entropy = _chunked_cross_entropy()
    build_model, load_config = _presets()
    config = load_config(args.model)
    tokens, hidden, vocab = args.batch * args.seq, config.hidden_size, config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device=device, dtype=torch.bfloat16)
    w.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::5] = -100
    for where in ("device", "host"):
        given = targets.to(device) if where == "device" else targets

        def call():
            chunked_cross_entropy(h, w, None, given).backward()
            h.grad = w.grad = None
        for _ in range(2):
            call()                                # compiles the fused kernel, warms the allocator
        _sync(device)
        with counted_syncs(device) as syncs:
            call()
        _sync(device)
        times = []
        for _ in range(args.calls):
            _sync(device)
            start = time.perf_counter()
            call()
            _sync(device)
            times.append(time.perf_counter() - start)
        emit(dict(env, part="head", targets=where, tokens=tokens, vocab=vocab,
                  syncs_per_call=len(syncs), syncs=syncs, call_s=_median(times), call_s_min=min(times),
                  call_s_max=max(times)))
    del h, w
    gc.collect()


def _model(args, device):
    import torch
    import remat
    build_model, load_config = _presets()
    model = build_model(load_config(args.model), device=str(device), dtype=torch.bfloat16).train()
    remat.apply(model, args.spec, head="chunked")
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    return model, {"input_ids": ids, "labels": ids}


def _micro_step(model, batch):
    loss = model(**batch).loss / ACCUMULATE
    loss.backward()
    return loss.detach()


def _round(device, run_micro_steps, model):
    """Seconds of one accumulation round (4 micro-steps, then the gradients dropped), per micro-step."""
    _sync(device)
    start = time.perf_counter()
    run_micro_steps()
    _sync(device)
    seconds = (time.perf_counter() - start) / ACCUMULATE
    model.zero_grad(set_to_none=True)
    return seconds


def step_part(args, device, env, emit, model, batch):
    def micro_steps():
        for _ in range(ACCUMULATE):
            _micro_step(model, batch)
    _round(device, micro_steps, model)        # warm
    _sync(device)
    with counted_syncs(device) as syncs:
        micro_steps()
    _sync(device)
    model.zero_grad(set_to_none=True)
    times = [_round(device, micro_steps, model) for _ in range(args.rounds)]
    emit(dict(env, part="step", spec=args.spec, head="chunked", accumulate=ACCUMULATE,
              syncs_per_micro_step=len(syncs) / ACCUMULATE, micro_step_s=_median(times),
              micro_step_s_min=min(times), micro_step_s_max=max(times),
              tokens_per_s=args.batch * args.seq / _median(times)))


def _interleaved(device, model, variants: dict, rounds: int) -> dict:
    """Rounds of each variant, taken in turn: ``{name: [seconds per micro-step, ...]}``."""
    for run in variants.values():
        _round(device, run, model)              # warm each path once
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(_round(device, run, model))
    return times


def _overhead_record(env, part, times, plain, guarded, **extra):
    p, q = _median(times[plain]), _median(times[guarded])
    return dict(env, part=part, accumulate=ACCUMULATE, plain_s=p, guarded_s=q, overhead=(q - p) / p,
                plain_all=times[plain], guarded_all=times[guarded], **extra)


def guard_part(args, device, env, emit, model, batch):
    import remat
    import torch
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 64 * 2**30
    guard = remat.Guard(model, budget=int(0.95 * total), heads=["chunked"])
    guard.planned_tokens = batch["input_ids"].numel()   # the plan is applied: the Guard must not re-plan

    def plain():
        for _ in range(ACCUMULATE):
            _micro_step(model, batch)

    def guarded():
        for _ in range(ACCUMULATE):
            guard(lambda b: _micro_step(model, b), batch)
    times = _interleaved(device, model, {"plain": plain, "guard": guarded}, args.rounds)
    emit(_overhead_record(env, "guard", times, "plain", "guard", spec=args.spec, replans=guard.replans))


def guard_trainer_part(args, device, env, emit, model, batch):
    import torch
    budget = int(0.95 * (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                         else 64 * 2**30))
    try:
        trainer, step_plain, step_guarded = _trainer_steps(args, model, budget)
        via = "Trainer.training_step"
    except Exception as error:  # noqa: BLE001 -- another transformers: the loop guard_trainer runs, alone
        emit(dict(env, part="guard_trainer", note=f"Trainer not driven ({type(error).__name__}: {str(error)[:200]}); "
                                                   "timing redo_out_of_memory, the loop guard_trainer runs"))
        from remat.guard import redo_out_of_memory
        via = "remat.guard.redo_out_of_memory"

        def step_plain(b):
            return _micro_step(model, b)

        def step_guarded(b):
            return redo_out_of_memory(model, lambda: _micro_step(model, b), lambda: budget, budget=budget,
                                      max_retries=3, who="hotpath_bench")

    def plain():
        for _ in range(ACCUMULATE):
            step_plain(batch)

    def guarded():
        for _ in range(ACCUMULATE):
            step_guarded(batch)
    times = _interleaved(device, model, {"plain": plain, "guard_trainer": guarded}, args.rounds)
    emit(_overhead_record(env, "guard_trainer", times, "plain", "guard_trainer", spec=args.spec, via=via))


def _trainer_steps(args, model, budget):
    """``(trainer, the class's training_step, guard_trainer's)`` on ``model``, without ``train()``: the
    callback is handed what ``on_train_begin`` hands it (the model, the budget)."""
    import tempfile
    from transformers import Trainer, TrainingArguments
    from remat.integrations.hf import RematCallback, guard_trainer
    callback = RematCallback(budget=budget, say=lambda message: None)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                              gradient_accumulation_steps=ACCUMULATE, report_to=[], bf16=False,
                              use_cpu=args.device == "cpu")
    trainer = Trainer(model=model, args=targs, callbacks=[callback])
    guard_trainer(trainer, callback)
    callback._model, callback._budget_bytes = model, budget      # as on_train_begin sets them
    if getattr(trainer, "current_gradient_accumulation_steps", None) is None:
        trainer.current_gradient_accumulation_steps = ACCUMULATE
    cls = type(trainer)

    def step_plain(b):
        return cls.training_step(trainer, model, dict(b))

    def step_guarded(b):
        return trainer.training_step(model, dict(b))
    step_plain(_first_batch(model, args))      # the Trainer's own first-call work, outside the timing
    model.zero_grad(set_to_none=True)
    return trainer, step_plain, step_guarded


def _first_batch(model, args):
    import torch
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=next(model.parameters()).device)
    return {"input_ids": ids, "labels": ids}


def environment(label, device) -> dict:
    import torch
    import remat
    env = {"label": label, "torch": torch.__version__, "remat": getattr(remat, "__version__", "?"),
           "remat_path": os.path.dirname(remat.__file__), "device": str(device),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def worker(args) -> None:
    import torch
    device = torch.device(args.device)
    env = dict(environment(args.label, device), model=args.model, batch=args.batch, seq=args.seq)
    parts = args.parts.split(",")

    def emit(record):
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")
    if "head" in parts:
        _run(emit, env, "head", lambda: head_part(args, device, env, emit))
    if {"step", "guard", "guard_trainer"} & set(parts):
        model, batch = _model(args, device)
        for name, part in (("step", step_part), ("guard", guard_part), ("guard_trainer", guard_trainer_part)):
            if name in parts:
                _run(emit, env, name, lambda: part(args, device, env, emit, model, batch))
                model.zero_grad(set_to_none=True)


def _run(emit, env, name, fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 -- one part failing must not lose the others
        emit(dict(env, part=name, status="error", reason=f"{type(error).__name__}: {str(error)[:400]}"))


def table(path) -> str:
    rows = [json.loads(line) for line in open(path)]
    lines = ["| tree | part | what | syncs | time (s) | overhead |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") == "error" or "note" in r:
            lines.append(f"| {r['label']} | {r['part']} | {r.get('reason', r.get('note', ''))[:60]} | | | |")
        elif r["part"] == "head":
            lines.append(f"| {r['label']} | head op | targets on {r['targets']} | {r['syncs_per_call']} | "
                         f"{r['call_s']:.4f} | |")
        elif r["part"] == "step":
            lines.append(f"| {r['label']} | step | {r['spec']} + chunked, per micro-step | "
                         f"{r['syncs_per_micro_step']:g} | {r['micro_step_s']:.4f} | |")
        else:
            lines.append(f"| {r['label']} | {r['part']} | plain {r['plain_s']:.4f} s/micro-step | | "
                         f"{r['guarded_s']:.4f} | {100 * r['overhead']:+.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.child:
        worker(args)
        return 0
    if not args.src:
        worker(args)
    else:
        for item in args.src:
            label, _, path = item.partition("=")
            command = [sys.executable, os.path.abspath(__file__), "--child", "--label", label, "--out", args.out,
                       "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--spec", args.spec,
                       "--rounds", str(args.rounds), "--calls", str(args.calls), "--parts", args.parts,
                       "--device", args.device]
            paths = [os.path.abspath(path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            print(f"== {label}: remat from {path}", flush=True)
            subprocess.run(command, env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)), check=False)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
