"""One rank of test_context_parallel.py's process groups (gloo, CPU, 2 or 4 ranks): every remat
treatment and the chunked head under context parallelism (remat.parallel), the sequence cut head-tail
(balanced, the default) and into contiguous pieces, alone and with FSDP2 over the same ranks.

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (the test starts one process per rank;
torchrun works too). Every rank holds the whole batch; each keeps its share of the sequence
(``shard_sequence``: labels shifted before the cut), and runs forward and backward inside
``context_parallel`` (the all-gather path on gloo). The reference is one process over the whole
sequence on an untouched copy of the same model, in this process. Rank 0 prints ``OK`` or the
problems of every rank; ``--record PATH`` writes per case the loss error, the worst gradient error,
the SDPA calls and the collectives of the step.

Checks, per case:
- the ranks' losses summed (each is its share of the whole sequence's) and the ranks' gradients
  summed (:func:`remat.parallel.reduce_gradients`; FSDP2 with a divide factor of 1 sums them in its
  reduce-scatter) equal the whole-sequence run's within ``REL`` relative (per tensor: the largest
  difference over the largest reference element): fp32, the same sums in another order;
- the mechanism: SDPA calls and all-gathers per step are one per layer for a treatment that keeps
  attention's inputs and two for one that recomputes attention (``full``, ``attention``,
  ``full+offload``, ``full+tiled``, and ``selective`` and ``attn-saved``, whose recompute re-runs the
  exchange and takes the attention kernel's output from its cache), so a treatment that silently did nothing,
  or a recompute that ran without the exchange, shows;
- misuse raises: a backward outside the ``with``, a mask the model builds, a model whose forward
  calls no SDPA, a batch cut with another layout than the attention's;
- torch's own ring attention (``_templated_ring_attention`` forward and backward, the code
  ``context_parallel`` runs on NCCL, here with the CPU flash kernel on gloo) on shares cut by
  ``remat.parallel.sequence`` with torch's load-balancing flag set as remat sets it: equal to one
  process's attention and gradients within ``REL``; with the flag the other way round, far from it
  (so the check can fail).
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist

import remat
from remat.presets import build_model
from remat.parallel import context_parallel, reduce_gradients, shard_sequence
from remat.parallel.sequence import positions
from remat.prove.collectives import CollectiveCounter
from workers import Worker, finish, start

TREATMENTS = ("keep", "full", "selective", "attention", "mlp", "offload", "full+offload", "tiled", "full+tiled",
              "attn-saved")
RECOMPUTE_ATTENTION = ("full", "selective", "attention", "full+offload", "full+tiled", "attn-saved")
HEADS = (("keep", "chunked"), ("full", "chunked"), ("full+tiled", "chunked"))
REL = 1e-6
LAYERS = 2
SEQ = 32
REPEATS = 5  # runs of torch's ring per ring-memory case, the least kept (see ring_memory)
TILE = 4  # tokens per tile: the tiled treatments cut each rank's 16 (8 on 4 ranks) tokens into chunks


def tiny_config():
    from transformers import LlamaConfig
    # config defaults otherwise (use_cache on, sdpa): models as users build them
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       attn_implementation="sdpa")


class Run(Worker):
    def __init__(self, rank, world):
        super().__init__(rank, world)
        self.records = {}
        self.base = build_model(tiny_config(), seed=0)
        ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
        labels = ids.clone()
        labels[0, :3] = -100  # a prompt whose tokens are not trained on: the shares still add up
        self.batch = dict(input_ids=ids, labels=labels)
        reference = copy.deepcopy(self.base)
        loss = reference(**self.batch).loss
        loss.backward()
        self.reference = {n: p.grad for n, p in reference.named_parameters()}
        self.reference_loss = loss.detach()

    def step(self, model, case, sharded=False, balance=True, **extra):
        """One CP step, counted; the loss (summed over ranks) and this rank's gradients (summed
        over ranks: by FSDP2's reduce-scatter when ``sharded``). ``extra``: more model arguments."""
        local = shard_sequence(self.batch, model=model, balance=balance)
        with CollectiveCounter() as counter:
            with context_parallel(model, balance=balance) as attention:
                loss = model(**local, **extra).loss
                (loss * self.world if sharded else loss).backward()
        if not sharded:
            reduce_gradients(model)
        loss = loss.detach()
        dist.all_reduce(loss)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = g.to_local() if hasattr(g, "to_local") else g
        self.records[case] = dict(calls=attention.calls, collectives=counter.counts.as_dict())
        return loss, grads

    def compare(self, case, loss, grads, sharded=False):
        loss_error = abs(loss.item() - self.reference_loss.item()) / abs(self.reference_loss.item())
        worst, where = 0.0, None
        for name, g in grads.items():
            want = self.reference[name]
            if sharded:
                want = want.chunk(self.world, dim=0)[self.rank]
            if g is None:
                self.fail(case, f"{name}: no gradient")
                continue
            error = ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if error > worst:
                worst, where = error, name
        self.records[case].update(loss_rel_error=loss_error, grad_rel_error=worst, worst_param=where)
        if loss_error > REL:
            self.fail(case, f"loss {loss.item()} vs {self.reference_loss.item()} (relative {loss_error:.2e} > {REL})")
        if worst > REL:
            self.fail(case, f"{where}: gradient relative error {worst:.2e} > {REL}")

    def mechanism(self, case, spec):
        per_step = LAYERS * (2 if spec in RECOMPUTE_ATTENTION else 1)
        record = self.records[case]
        if record["calls"] != per_step:
            self.fail(case, f"{record['calls']} SDPA calls a step, expected {per_step}")
        gathers = record["collectives"]["all_gather"]
        if gathers != per_step:
            self.fail(case, f"{gathers} all-gathers a step, expected {per_step} (one per attention run)")


def treatments(run, balance=True):
    """Every treatment and the chunked head, the sequence cut head-tail (``balance``) or contiguous;
    with the balanced cut also the untouched model with ``use_cache=False`` (no cache: transformers
    looks for packed sequences in the positions, which jump; the share's mask of ones stops it)."""
    prefix = "cp/" if balance else "cp-contiguous/"
    cases = [(t, None, {}) for t in TREATMENTS] + [(t, h, {}) for t, h in HEADS]
    if balance:
        cases.append(("keep", None, {"use_cache": False}))
    for spec, head, extra in cases:
        case = prefix + spec + (f"+{head}" if head else "") + ("+no-cache" if extra else "")
        model = copy.deepcopy(run.base)
        remat.apply(model, spec, head=head, tile_tokens=TILE)
        try:
            loss, grads = run.step(model, case, balance=balance, **extra)
        except Exception as e:  # noqa: BLE001 - a crash in one case is a finding, not the end
            run.fail(case, f"{type(e).__name__}: {e}")
            continue
        run.compare(case, loss, grads)
        run.mechanism(case, spec)


def _torch_ring(run, case):
    """``(options, ring forward, ring backward, CPU flash kernel, its backward)``: torch's ring attention
    and what it runs on the CPU; None, with the case recorded as skipped, where this torch lacks them."""
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options, _templated_ring_attention
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward)
    except ImportError as e:
        run.records[case] = dict(skipped=f"torch {torch.__version__}: {e}")
        return None
    return (_cp_options, _templated_ring_attention, _templated_ring_attention_backward,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def ring_layout(run):
    """torch's ring attention (the code its ``context_parallel`` dispatches SDPA to on NCCL) run
    directly on gloo with the CPU flash kernels, on q/k/v cut by remat's layouts, torch's
    load-balancing flag set as :func:`remat.parallel.context_parallel` sets it: forward and backward
    equal one process's within ``REL``; the flag the other way round must be far off."""
    ring = _torch_ring(run, "ring-layout")
    if ring is None:
        return
    _cp_options, _templated_ring_attention, _templated_ring_attention_backward, forward, backward = ring
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(2, 4, SEQ, 8, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*leaves, is_causal=True)
    reference.backward(grad)
    wanted = [reference.detach()] + [t.grad for t in leaves]
    before = _cp_options.enable_load_balance
    record = {}
    try:
        for balance, flag in ((True, True), (False, False), (False, True)):
            idx = positions(run.rank, run.world, SEQ, balance=balance)
            lq, lk, lv, lg = (t[:, :, idx].contiguous() for t in (q, k, v, grad))
            _cp_options.enable_load_balance = flag
            out, lse, *_ = _templated_ring_attention(dist.group.WORLD, 2, forward, query=lq, key=lk, value=lv,
                                                     is_causal=True)
            dq, dk, dv, *_ = _templated_ring_attention_backward(dist.group.WORLD, 2, backward, lg, "grad_out", lq, lk,
                                                                lv, out, lse, is_causal=True, dropout_p=0.0)
            error = max(((a - b[:, :, idx]).abs().max() / b.abs().max()).item()
                        for a, b in zip((out, dq, dk, dv), wanted))
            record[f"layout balance={balance}, torch flag {flag}"] = error
            if balance == flag and error > REL:
                run.fail("ring-layout", f"balance={balance}: torch's ring differs from one process by {error:.2e}")
            if balance != flag and error < 1e-2:
                run.fail("ring-layout", f"torch's ring gave one process's result with the wrong flag ({error:.2e}): "
                                        "the check cannot tell the layouts apart")
    finally:
        _cp_options.enable_load_balance = before
    run.records["ring-layout"] = record


def ring_memory(run):
    """What torch's ring attention holds beyond one attention call over the rank's share, measured
    on its own code (forward and backward, gloo, the CPU flash kernels, bf16, q/k/v laid out as
    transformers hands them to SDPA: transposed views), for both layouts and two head layouts (MHA
    and 4:1 GQA, so that the query and the key/value terms are told apart), beside what
    :func:`remat.planning.context.ring_buffer_bytes` charges. Forward: the most tensor bytes alive
    at any op, less one call's; backward: the most alive right after a kernel call (its outputs
    included: on a GPU the kernel's own work comes on top, as in one call), less one call's. The
    tensors are counted by :class:`remat.prove.memtrack.PeakTracker`; a kernel's scratch memory is
    not a tensor it returns, and the same in both. The ring runs ``REPEATS`` times and the least is
    kept: gloo's worker thread can still hold a sent buffer for a moment after the wait has
    returned (seen once on a loaded 2-core CI machine, 10 query-sized buffers on one rank), which
    only ever adds bytes, so the least run is what torch's code itself holds. Rank 0's record holds
    every rank's."""
    ring = _torch_ring(run, "ring-memory")
    if ring is None:
        return
    _cp_options, _templated_ring_attention, _templated_ring_attention_backward, forward, backward = ring
    from remat.planning.context import ring_buffer_bytes
    from remat.prove.memtrack import PeakTracker

    class AtKernel(PeakTracker):
        """The peak, and the most bytes alive right after a call of ``kernel``."""

        def __init__(self, kernel, baseline):
            super().__init__(baseline=baseline)
            self.kernel, self.entry, self.at_kernel = kernel, self.current, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is self.kernel:
                self.at_kernel = max(self.at_kernel, self.current)
            return out

    def measured(kernel, inputs, call):
        with AtKernel(kernel, inputs) as tracker:
            result = call()
        return result, tracker.peak - tracker.entry, tracker.at_kernel - tracker.entry

    batch, seq, dim, element = 1, 64, 64, 2
    g = torch.Generator().manual_seed(run.rank)

    def hf_layout(heads):
        return torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.bfloat16).transpose(1, 2)

    before = _cp_options.enable_load_balance
    mine = {}
    try:
        for heads, kv_heads in ((8, 8), (8, 2)):
            q, k, v, grad = hf_layout(heads), hf_layout(kv_heads), hf_layout(kv_heads), hf_layout(heads)
            for balance in (True, False):
                _cp_options.enable_load_balance = balance
                (one, one_lse, *_), one_fwd, _ = measured(forward, [q, k, v], lambda: forward(q, k, v, 0.0, True))
                _, _, one_bwd = measured(backward, [q, k, v, one, one_lse, grad],
                                         lambda: backward(grad, q, k, v, one, one_lse, 0.0, True))
                runs = []
                for _ in range(REPEATS):   # the least of a few runs: gloo's thread may hold a sent buffer late
                    (out, lse, *_), fwd, _ = measured(forward, [q, k, v], lambda: _templated_ring_attention(
                        dist.group.WORLD, 2, forward, query=q, key=k, value=v, is_causal=True))
                    _, _, bwd = measured(backward, [q, k, v, out, lse, grad], lambda: _templated_ring_attention_backward(
                        dist.group.WORLD, 2, backward, grad, "grad_out", q, k, v, out, lse, is_causal=True,
                        dropout_p=0.0))
                    runs.append((fwd, bwd))
                ring_fwd, ring_bwd = (min(phase) for phase in zip(*runs))
                q_bytes, kv_bytes = q.numel() * element, 2 * k.numel() * element
                charged = ring_buffer_bytes(q_bytes, kv_bytes, run.world, element)
                mine[f"heads {heads}/{kv_heads} balance={balance}"] = dict(
                    q_bytes=q_bytes, kv_bytes=kv_bytes, lse_bytes=lse.numel() * 4,
                    forward=ring_fwd - one_fwd, backward=ring_bwd - one_bwd,
                    charged_forward=charged[0], charged_backward=charged[1])
    finally:
        _cp_options.enable_load_balance = before
    everyone = [None] * run.world
    dist.all_gather_object(everyone, mine)
    run.records["ring-memory"] = {f"rank {r}": cases for r, cases in enumerate(everyone)}


def fsdp2(run):
    """FSDP2 over the CP ranks (torchtitan's layout: the model sharded over every rank that splits
    the sequence). FSDP2 averages gradients over its ranks, and each rank's loss is its share of the
    sequence's, so the backward runs on ``world x`` the share (a divide factor of 1 would say the
    same, but gloo has no pre-multiplied sum)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (run.world,))
    for spec, head in (("keep", None), ("full", "chunked"), ("full+offload+tiled", "chunked")):
        case = f"cp+fsdp2/{spec}" + (f"+{head}" if head else "")
        model = copy.deepcopy(run.base)
        remat.apply(model, spec, head=head, tile_tokens=TILE)
        for unit in list(model.model.layers) + [model]:
            fully_shard(unit, mesh=mesh)
        try:
            loss, grads = run.step(model, case, sharded=True)
        except Exception as e:  # noqa: BLE001
            run.fail(case, f"{type(e).__name__}: {e}")
            continue
        run.compare(case, loss, grads, sharded=True)


def misuse(run):
    """What must raise, and what it says."""
    def expect(case, error, words, body):
        try:
            body()
        except error as e:
            if words not in str(e):
                run.fail(case, f"{type(e).__name__} without {words!r}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            run.fail(case, f"raised {type(e).__name__}, expected {error.__name__}: {e}")
            return
        run.fail(case, f"did not raise {error.__name__}")

    model = copy.deepcopy(run.base)
    remat.apply(model, "full")
    local = shard_sequence(run.batch, model=model)

    def backward_outside():
        with context_parallel(model):
            loss = model(**local).loss
        loss.backward()
    expect("misuse/backward-outside", RuntimeError, "call loss.backward() inside it", backward_outside)

    def model_mask():  # a padding mask handed to the model past shard_sequence: the model builds a 4-D mask
        mask = torch.ones_like(local["input_ids"])
        mask[0, 0] = 0
        with context_parallel(model):
            model(**dict(local, attention_mask=mask)).loss.backward()
    expect("misuse/model-mask", ValueError, "cannot split a mask", model_mask)

    def no_sdpa():  # no config to check beforehand: refused once its forward called no SDPA
        net = torch.nn.Linear(4, 4)
        with context_parallel(net):
            net(torch.randn(2, 4)).sum().backward()
    expect("misuse/no-sdpa", RuntimeError, "no attention of Linear", no_sdpa)

    def other_layout():  # contiguous pieces under a balanced attention: positions tell, before any SDPA
        contiguous = shard_sequence(run.batch, model=model, balance=False)
        with context_parallel(model):
            model(**contiguous).loss.backward()
    expect("misuse/other-layout", ValueError, "pass the same balance", other_layout)

    def untagged_positions():  # positions made elsewhere are compared by value
        other = dict(shard_sequence(run.batch, model=model, balance=False))
        other["position_ids"] = other["position_ids"].clone()
        with context_parallel(model):
            model(**other).loss.backward()
    expect("misuse/untagged-positions", ValueError, "other position_ids", untagged_positions)
    import torch.nn.functional as F
    if not getattr(F.scaled_dot_product_attention, "__module__", "").startswith("torch"):
        run.fail("misuse", "scaled_dot_product_attention was not restored after the errors")


def readme_snippet() -> str:
    """The Python block of the README's context-parallelism section that calls ``shard_sequence``, as
    written (the section's other block, the Hugging Face Trainer's, needs GPUs)."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        section = f.read().split("\n## Longer than one GPU holds: context parallelism\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "shard_sequence(" in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def readme(run):
    """The README's snippet runs as written on this group (plan, apply, shard, step, reduce) and
    gives the whole-sequence run's loss and gradients."""
    case = "readme"
    namespace = dict(model=copy.deepcopy(run.base), batch=run.batch)
    try:
        exec(compile(readme_snippet(), "README-context-parallelism", "exec"), namespace)
    except Exception as e:  # noqa: BLE001
        run.fail(case, f"{type(e).__name__}: {e}")
        return
    loss = namespace["loss"].detach()
    dist.all_reduce(loss)
    run.records[case] = dict(plan=namespace["plan"].summary())
    run.compare(case, loss, {n: p.grad for n, p in namespace["model"].named_parameters()})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--record", help="write every case's errors, SDPA calls and collectives (rank 0's) here as JSON")
    p.add_argument("--only", default="treatments,contiguous,ring,ring-memory,fsdp2,misuse,readme")
    args = p.parse_args()
    rank, world = start()
    run = Run(rank, world)
    parts = args.only.split(",")
    if "treatments" in parts:
        treatments(run)
    if "contiguous" in parts:
        treatments(run, balance=False)
    if "ring" in parts:
        ring_layout(run)
    if "ring-memory" in parts:
        ring_memory(run)
    if "fsdp2" in parts:
        fsdp2(run)
    if "misuse" in parts:
        misuse(run)
    if "readme" in parts:
        readme(run)
    finish(run.problems, args.record, dict(dtype="float32",
                                          model=f"llama hidden 32, {LAYERS} layers, 4/2 heads, vocab 128",
                                          batch=list(run.batch["input_ids"].shape), rel_tolerance=REL,
                                          cases=run.records))


if __name__ == "__main__":
    main()
