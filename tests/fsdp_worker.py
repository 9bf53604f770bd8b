"""One rank of test_fsdp.py's process group (gloo, CPU): every treatment and the chunked head
under FSDP2 (``fully_shard`` per block then the root, after ``remat.apply``), with and without
a ``MixedPrecisionPolicy``, ``reshard_after_forward`` True and False, under DDP, and the
collectives each issues per step; FSDP1 with Hugging Face checkpointing for the collective count.

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (test_fsdp.py starts one process
per rank; torchrun works too). Each rank trains on its slice of one batch; the reference is
the whole batch on an untouched, unsharded copy in this process. Rank 0 prints ``OK`` or the
problems of every rank; ``--record PATH`` also writes the collective counts there as JSON.

Checks, per wrapper (FSDP2 variant or DDP):
- the untreated model's gradients (averaged over ranks by FSDP2's reduce-scatter or DDP's
  all-reduce) equal the whole-batch reference within a tight fp32 tolerance: the mean of two
  half-batch means sums the same terms in another order, so the last bits differ (bf16
  parameters with a MixedPrecisionPolicy: within bf16 rounding);
- every treatment's loss and gradients are ``torch.equal`` to the untreated model's under the
  same wrapper (same math, same reduction order); the chunked head's within 1e-5 (fp32);
- every treatment issues exactly the untreated model's all-gathers, reduce-scatters and
  all-reduces per step (the recompute runs inside the block's backward, after FSDP2 has
  unsharded it for the backward anyway).
"""
import argparse
import copy

import torch
import torch.distributed as dist

import remat
from remat.presets import build_model
from remat.prove.collectives import CollectiveCounter
from workers import Worker, finish, start

TREATMENTS = ("keep", "full", "selective", "attention", "mlp", "offload", "full+offload")
HEADS = (("keep", "chunked"), ("full", "chunked"))
FP32_TOL = dict(rtol=1e-5, atol=1e-7)     # reduction order (see the docstring)
BF16_TOL = dict(rtol=2e-2, atol=2e-3)     # bf16 parameters and activations against fp32
CHUNKED_TOL = dict(rtol=1e-5, atol=1e-7)  # the chunked head's own fp32 rounding (remat.head)


def tiny_config(tie=False):
    from transformers import LlamaConfig
    # config defaults otherwise (use_cache, dropout 0): models as users build them
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tie)


class Run(Worker):
    def __init__(self, rank, world, tie=False):
        super().__init__(rank, world)
        self.counts = {}
        self.config = tiny_config(tie)
        self.base = build_model(self.config, seed=0)
        ids = torch.randint(0, self.config.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(0))
        self.full_batch = dict(input_ids=ids, labels=ids)
        self.batch = {k: v.chunk(world)[rank] for k, v in self.full_batch.items()}
        reference = copy.deepcopy(self.base)
        loss = reference(**self.full_batch).loss
        loss.backward()
        self.reference = {n: p.grad for n, p in reference.named_parameters()}
        self.reference_loss = loss.detach()

    def step(self, model, case):
        """Two steps; the second is counted. Returns its loss (averaged over ranks) and gradients."""
        for i in range(2):
            model.zero_grad(set_to_none=True)
            counter = CollectiveCounter() if i else None
            with counter or _nothing():
                loss = model(**self.batch).loss
                loss.backward()
        self.counts[case] = counter.counts.as_dict()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        grads = {}
        for name, p in _named_parameters(model):
            g = p.grad
            if g is not None and hasattr(g, "to_local"):
                g = g.to_local()  # this rank's dim-0 shard, as torch.chunk cuts it
            grads[name] = g
        return loss / self.world, grads

    def expected(self, name, grads_are_sharded):
        g = self.reference[name]
        return g.chunk(self.world, dim=0)[self.rank] if grads_are_sharded else g

    def compare(self, case, loss, grads, want_loss, want, tol, sharded=False):
        """``want``: a dict of gradients shaped like ``grads`` (None: the whole-batch reference)."""
        if tol is None and not torch.equal(loss, want_loss):
            self.fail(case, f"loss {loss.item()} != {want_loss.item()}")
        elif tol is not None and not torch.allclose(loss, want_loss.float(), **tol):
            self.fail(case, f"loss {loss.item()} not close to {want_loss.item()}")
        for name, g in grads.items():
            w = self.expected(name, sharded) if want is None else want[name]
            if g is None or w is None:
                if (g is None) != (w is None):
                    self.fail(case, f"{name}: gradient {'missing' if g is None else 'unexpected'}")
                continue
            same = torch.equal(g, w) if tol is None else torch.allclose(g.float(), w.float(), **tol)
            if not same:
                err = (g.float() - w.float()).abs().max().item()
                self.fail(case, f"{name}: gradient differs (max abs {err:.3g}, tolerance {tol})")

    def same_collectives(self, case, baseline):
        got, want = self.counts[case], self.counts[baseline]
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if got[kind] != want[kind]:
                self.fail(case, f"{got[kind]} {kind} per step, {want[kind]} without remat ({baseline})")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _named_parameters(model):
    inner = getattr(model, "module", model)  # DDP
    return inner.named_parameters()


def fsdp2(run, mesh, mixed=("fp32", "bf16"), reshards=(True, False), cases=None, label="fsdp2"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policies = {"fp32": None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    cases = cases or [(t, None) for t in TREATMENTS] + list(HEADS)
    for mp_name in mixed:
        mp = policies[mp_name]
        for reshard in reshards:
            wrapper = f"{label}/{mp_name}/reshard={reshard}"
            kwargs = dict(mesh=mesh, reshard_after_forward=reshard, **({"mp_policy": mp} if mp else {}))
            baseline = None
            for spec, head in cases:
                case = f"{wrapper}/{spec}" + (f"+{head}" if head else "")
                model = copy.deepcopy(run.base)
                remat.apply(model, spec, head=head)
                for block in model.model.layers:
                    fully_shard(block, **kwargs)
                fully_shard(model, **kwargs)
                try:
                    loss, grads = run.step(model, case)
                except Exception as e:  # noqa: BLE001 - a crash in one case is a finding, not the end
                    run.fail(case, f"{type(e).__name__}: {e}")
                    continue
                if baseline is None:  # "keep": the untreated model under this wrapper
                    baseline = (loss, grads, case)
                    run.compare(case, loss, grads, run.reference_loss, None,
                                FP32_TOL if mp is None else BF16_TOL, sharded=True)
                    continue
                tol = None if head is None else (CHUNKED_TOL if mp is None else BF16_TOL)
                run.compare(case, loss, grads, baseline[0], baseline[1], tol)
                run.same_collectives(case, baseline[2])


def ddp(run):
    from torch.nn.parallel import DistributedDataParallel
    baseline = None
    for spec, head in [(t, None) for t in TREATMENTS] + list(HEADS):
        case = f"ddp/{spec}" + (f"+{head}" if head else "")
        model = copy.deepcopy(run.base)
        remat.apply(model, spec, head=head)
        model = DistributedDataParallel(model)  # find_unused_parameters=False, static_graph=False
        try:
            loss, grads = run.step(model, case)
        except Exception as e:  # noqa: BLE001
            run.fail(case, f"{type(e).__name__}: {e}")
            continue
        if baseline is None:
            baseline = (loss, grads, case)
            run.compare(case, loss, grads, run.reference_loss, None, FP32_TOL)
            continue
        run.compare(case, loss, grads, baseline[0], baseline[1], None if head is None else CHUNKED_TOL)
        run.same_collectives(case, baseline[2])


def fsdp1(run):
    """FSDP1 (one unit per decoder layer, then the root) with and without Hugging Face
    checkpointing, and with remat applied before wrapping: collectives per step and the loss."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    layer = type(run.base.model.layers[0])
    variants = {"fsdp1/eager": None, "fsdp1/hf_full": dict(use_reentrant=False),
                "fsdp1/hf_full_reentrant": dict(use_reentrant=True), "fsdp1/remat_full": "full"}
    for case, how in variants.items():
        model = copy.deepcopy(run.base)
        if isinstance(how, dict):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=how)
        elif how:
            remat.apply(model, how)
        try:
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer}),
                                             device_id=torch.device("cpu"), use_orig_params=True)
            loss, _ = run.step(model, case)
        except Exception as e:  # noqa: BLE001
            run.fail(case, f"{type(e).__name__}: {e}")
            continue
        if not torch.allclose(loss, run.reference_loss, **FP32_TOL):
            run.fail(case, f"loss {loss.item()} not close to {run.reference_loss.item()}")
        if case != "fsdp1/eager":
            run.same_collectives(case, "fsdp1/eager")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--record", help="write the collective counts (rank 0's) to this JSON file")
    p.add_argument("--only", default="fsdp2,ddp,fsdp1,tied")
    args = p.parse_args()
    rank, world = start()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))  # stay on the CPU even where a GPU is visible
    run = Run(rank, world)
    parts = args.only.split(",")
    if "fsdp2" in parts:
        fsdp2(run, mesh)
    if "ddp" in parts:
        ddp(run)
    if "fsdp1" in parts:
        fsdp1(run)
    if "tied" in parts:  # tied input and output embeddings: the chunked head returns the shared gradient once
        tied = Run(rank, world, tie=True)
        fsdp2(tied, mesh, mixed=("fp32",), reshards=(True,), cases=[("keep", None), ("full", "chunked")],
              label="fsdp2-tied")
        run.problems += tied.problems
        run.counts.update(tied.counts)
    finish(run.problems, args.record, dict(model="llama hidden 32, 2 layers, vocab 128",
                                          batch_per_rank=list(run.batch["input_ids"].shape),
                                          note="c10d operator calls per training step (the second step), rank 0",
                                          counts=run.counts))


if __name__ == "__main__":
    main()
