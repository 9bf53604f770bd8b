"""Where a ``selective`` step's host time goes, on the CPU, for a Mixtral-shaped model (issue 29).

Why: on one H100 the ``mixtral`` row of ``heldout_gpu.py`` (12 layers, hidden 1024, 4 x 2048
tokens) is host-bound, and uniform ``selective`` measured slower than ``mlp``. Host time per op
does not depend on the tensors' sizes, so a model of the same layer structure with tiny tensors,
on the CPU with one thread, shows the host's side alone: what each treatment issues, and for
``selective`` what its dispatch modes cost.

Rows, each the median host seconds of the forward and of the backward over ``--steps`` steps
(``time.process_time``: the CPU seconds of this process, which runs every op on its own thread here,
so that other work on a shared machine does not show; every row measured ``--repeats`` times
round-robin, the median of those):

- ``keep``, ``mlp``, ``full``, ``selective``: the treatments as ``remat.apply`` gives them;
- ``selective:torch-list``: torch's selective checkpoint with the op list alone (torch's own
  policy function: no dropout exception, no in-place writes kept), so ``selective`` minus this is
  what remat's policy adds;
- ``selective:guard``: the in-place guard on every forward instead of a block's first one;
- ``pass-through``: the checkpoint under two Python dispatch modes that only call each op (it
  recomputes every op, matmuls included: a cost probe, not a treatment), so this minus ``full``
  is what per-op Python dispatch costs by itself, and ``selective:torch-list`` minus this is
  torch's selective-checkpoint bookkeeping.

Also counted, for one step of ``selective``: the ops its caching mode sees in the forward, the ops
the recompute runs, and how many outputs it keeps; and timed alone, the policy's calls of that
step, beside torch's own policy for the same op list.

Usage: ``PYTHONPATH=src python benchmarks/selective_host.py --out DIR`` (``--layers``,
``--steps``, ``--repeats``). Writes ``DIR/selective_host.jsonl`` and prints a table.
"""
import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat
from remat.prove.bench import environment
from remat.treat import patches, selective, treatments

ROWS = ("keep", "mlp", "full", "selective", "selective:torch-list", "selective:guard", "pass-through")


def build(layers: int):
    """Mixtral's block structure as ``heldout_gpu.py``'s ``mixtral`` row has it (8 experts, top-2,
    16/8 heads, router logits on, the config's defaults otherwise), with tiny tensors."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                           num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).train()


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# context functions in place of remat's ``selective_context``, which the treatment calls with
# ``guard`` and ``keeps``: torch's own selective checkpoint of the op list, and two bare modes
def _torch_list(guard=True, keeps=None):
    return create_selective_checkpoint_contexts(sorted(selective.saved_ops(), key=str))


def _pass_through(guard=True, keeps=None):
    return _PassThrough(), _PassThrough()


class _NeverSeen(set):
    """A block's guarded call structures that never holds one: the guard runs on every forward."""

    def __contains__(self, item):
        return False


@contextlib.contextmanager
def _variant(row, model):
    """Apply ``row``'s treatment to ``model``, with the context function it names, then undo both."""
    real = treatments.selective_context
    treatments.selective_context = {"selective:torch-list": _torch_list, "pass-through": _pass_through}.get(row, real)
    if row != "keep":
        remat.apply(model, row if row in ("mlp", "full", "selective") else "selective")
    if row == "selective:guard":
        for patch in patches.patches(model, tag="treatment"):
            if patch.state is not None:  # the forward's patch, not the block's marker
                patch.state.guarded = _NeverSeen()
    try:
        yield
    finally:
        treatments.selective_context = real
        remat.remove(model)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    loss = model(input_ids=ids, labels=ids).loss
    middle = time.process_time()
    loss.backward()
    return middle - start, time.process_time() - middle


def measure(model, ids, row, steps, warmup=3):
    with _variant(row, model):
        for _ in range(warmup):
            _step(model, ids)
        forward, backward = zip(*(_step(model, ids) for _ in range(steps)))
    return statistics.median(forward), statistics.median(backward)


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, ids) -> dict:
    """Ops of one ``selective`` step: seen by the caching mode (forward), replayed by the recompute
    mode (backward), and how many of the forward's it keeps. Counted by wrapping the two modes."""
    seen = {"forward": 0, "recompute": 0, "kept": 0}
    real = treatments.selective_context

    def counting(guard=True, keeps=selective.saves):
        forward, recompute = real(guard=guard, keeps=keeps)
        return _Counting(forward, "forward"), _Counting(recompute, "recompute")

    class _Counting:
        def __init__(self, inner, phase):
            self.inner, self.phase, self.counter = inner, phase, _Counter()

        def __enter__(self):
            self.inner.__enter__()
            self.counter.__enter__()  # entered last, so first to see each op the block issues

        def __exit__(self, *exc):
            self.counter.__exit__(*exc)
            seen[self.phase] += sum(self.counter.ops.values())
            if self.phase == "forward":
                seen["kept"] += sum(n for op, n in self.counter.ops.items() if selective.saves(op))
            return self.inner.__exit__(*exc)

    treatments.selective_context = counting
    try:
        remat.apply(model, "selective")
        _step(model, ids)
        for key in seen:
            seen[key] = 0
        _step(model, ids)
    finally:
        treatments.selective_context = real
        remat.remove(model)
    return seen


def policy_cost(model, ids, rounds=20) -> dict:
    """Microseconds a call of remat's policy takes, and of torch's own policy for the same op list,
    replaying the calls of one ``selective`` step (the best of ``rounds``): the policy's share alone,
    which the step rows cannot resolve from their noise."""
    calls, real = [], selective._Policy.__call__

    def recording(policy, ctx, func, *args, **kwargs):
        calls.append((ctx, func, args, kwargs))
        return real(policy, ctx, func, *args, **kwargs)
    remat.apply(model, "selective")
    try:
        _step(model, ids)
        selective._Policy.__call__ = recording
        _step(model, ids)
    finally:
        selective._Policy.__call__ = real
        remat.remove(model)
    listed = sorted(selective.saved_ops(), key=str)
    torch_policy = create_selective_checkpoint_contexts(listed)[0].policy_fn

    def best(make):
        times = []
        for _ in range(rounds):
            policy = make()
            start = time.perf_counter()
            for ctx, func, args, kwargs in calls:
                policy(ctx, func, *args, **kwargs)
            times.append(time.perf_counter() - start)
        return min(times) / len(calls) * 1e6
    return {"calls_per_step": len(calls), "remat_us": best(lambda: selective._Policy(selective.saves)),
            "torch_list_us": best(lambda: torch_policy)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # host time per op, not how a kernel spreads over cores
    model = build(args.layers)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    rows = args.rows.split(",")
    runs = collections.defaultdict(list)
    for _ in range(args.repeats):
        for row in rows:
            runs[row].append(measure(model, ids, row, args.steps))
    counts = count_ops(model, ids)
    policy = policy_cost(model, ids)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "selective_host.jsonl"), "w") as sink:
        sink.write(json.dumps({"environment": environment(torch.device("cpu")), "layers": args.layers,
                               "batch": args.batch, "seq": args.seq, "selective_ops_per_step": counts,
                               "policy": policy}) + "\n")
        print(f"selective, one step of {args.layers} blocks: {counts}; policy call: {policy}")
        print(f"{'row':22s} {'forward ms':>10s} {'backward ms':>11s} {'step ms':>8s}")
        for row in rows:
            forward = statistics.median(f for f, _ in runs[row])
            backward = statistics.median(b for _, b in runs[row])
            sink.write(json.dumps({"row": row, "forward_s": forward, "backward_s": backward,
                                   "step_s": forward + backward, "runs": runs[row]}) + "\n")
            print(f"{row:22s} {forward * 1e3:10.2f} {backward * 1e3:11.2f} {(forward + backward) * 1e3:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
