"""remat.Guard (issue 14): a step that runs out of memory is re-planned and redone, and the
loss curve equals a run that never ran out; every new longest batch is planned before it runs.

The out-of-memory error is injected by a forward pre-hook that raises
``torch.OutOfMemoryError`` at a chosen step, as the CUDA allocator would.
"""
import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import remat
from remat.api import current_plan


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _batches(count=20, lengths=(8, 12, 6, 16, 10)):
    generator = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        ids = torch.randint(0, 64, (2, lengths[i % len(lengths)]), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _train(model, batches, run_step, accumulate=2):
    """AdamW, two micro-batches per optimizer step: the curve of losses, bit for bit."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(11)
    losses = []
    for index, batch in enumerate(batches):
        losses.append(run_step(batch))
        if index % accumulate == accumulate - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses


def _step_fn(model):
    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()
    return step


class _OOMAt:
    """A forward hook that makes the backward of the training steps numbered in ``calls``
    (counted from 0) raise torch.OutOfMemoryError half way, after the later blocks' parameter
    gradients were accumulated: the guard must put ``.grad`` back as it was. The planner's
    profiling forwards (fake tensors) are not counted."""

    def __init__(self, calls):
        self.calls, self.count = set(calls), 0

    def __call__(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, FakeTensor) or not hidden.requires_grad:
            return
        self.count += 1
        if self.count - 1 in self.calls:
            hidden.register_hook(self.raise_oom)

    @staticmethod
    def raise_oom(grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _keep_peak(model, batch):
    return remat.plan(copy.deepcopy(model), batch, "64GiB", heads=["plain"]).notes["predicted_peak_bytes"]


def test_injected_oom_is_recovered_and_the_loss_curve_is_unchanged():
    batches = _batches()
    reference = _llama()
    model = copy.deepcopy(reference)
    expected = _train(reference, batches, _step_fn(reference))

    longest = max(batches, key=lambda b: b["input_ids"].numel())
    budget = int(_keep_peak(model, longest) * 1.02)          # keep fits; 0.85 of it needs treatments
    guard = remat.Guard(model, budget=budget, heads=["plain"])
    injected = _OOMAt(calls=[3, 4])            # step 3 (the longest batch) fails twice, then runs
    handle = model.model.layers[2].register_forward_hook(injected)
    got = _train(model, batches, lambda batch: guard(_step_fn(model), batch))
    handle.remove()

    assert [g.item() for g in got] == [e.item() for e in expected]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert guard.recovered == 2 and guard.budget < budget
    assert set(current_plan(model).blocks.values()) != {"keep"}       # the re-plan checkpoints


def test_longer_batches_are_planned_before_they_run(capsys):
    model = _llama()
    guard = remat.Guard(model, budget="1GiB", heads=["plain"])
    seen = []
    for batch in _batches(count=6, lengths=(8, 6, 12, 12, 16, 4)):
        guard(_step_fn(model), batch)
        seen.append(guard.planned_tokens)
    assert seen == [16, 16, 24, 24, 32, 32] and guard.replans == 3
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("remat.Guard:")]
    assert len(said) == 3, said  # one line a plan, by default on stderr: why, and the plan it replaced
    assert said[0].startswith("remat.Guard: planned for the first batch (16 tokens), at 1.00 GiB: ")
    assert said[1].startswith("remat.Guard: re-planned for a longer batch (24 tokens; the plan was for 16), at "
                              "1.00 GiB: ") and (" -> " in said[1] or said[1].endswith(" (unchanged)"))


def test_gives_up_with_the_budgets_tried():
    model = _llama()
    guard = remat.Guard(model, budget="1GiB", heads=["plain"], max_retries=2)
    model.model.layers[0].register_forward_hook(_OOMAt(calls=range(100)))
    with pytest.raises(RuntimeError, match="budgets tried: 1.00 GiB, 870.40 MiB, 739.84 MiB"):
        guard(_step_fn(model), _batches(count=1)[0])
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_are_not_swallowed():
    model = _llama()
    guard = remat.Guard(model, budget="1GiB", heads=["plain"])

    def broken(batch):
        raise KeyError("labels")
    with pytest.raises(KeyError):
        guard(broken, _batches(count=1)[0])
    assert guard.recovered == 0


@pytest.mark.parametrize("bad", [dict(budget="-1GiB"), dict(budget=float("inf")), dict(budget="1GiB", shrink=1.5),
                                 dict(budget="1GiB", max_retries=-1)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        remat.Guard(_llama(), **bad)


def test_budget_none_needs_a_gpu_model():
    with pytest.raises(ValueError, match="not on a GPU"):
        remat.Guard(_llama())


def test_plans_after_the_first_are_profiled_on_fake_tensors(monkeypatch):
    """A model on a GPU (stood in for here): the first plan is measured there under an allocator
    cap at the budget, every later one -- a longer batch, an out-of-memory step -- on fake
    tensors with the GPU's rate table, so re-planning takes no GPU memory."""
    import contextlib

    import remat.guard as guard_module
    import remat.planner as planner
    real_plan, calls, caps = planner.plan, [], []

    def recording_plan(model, batch, budget, **options):
        calls.append((options.get("device"), options.get("gpu")))
        options["device"] = "fake"                  # a CPU model: the measured path cannot run here
        return real_plan(model, batch, budget, **options)

    @contextlib.contextmanager
    def cap(device, budget):
        caps.append(budget)
        yield
    monkeypatch.setattr(planner, "plan", recording_plan)
    monkeypatch.setattr(guard_module, "_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(guard_module, "_allocator_cap", cap)
    monkeypatch.setattr(guard_module, "_rate_table", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(guard_module, "_unplanned_bytes", lambda model, device, options: 0)

    model = _llama()
    guard = remat.Guard(model, budget="1GiB", heads=["plain"])
    model.model.layers[2].register_forward_hook(_OOMAt(calls=[2]))
    for batch in _batches(count=3, lengths=(8, 16, 16)):
        guard(_step_fn(model), batch)
    assert guard.replans == 3 and guard.recovered == 1
    assert calls == [("cuda", None), ("fake", "NVIDIA H100 80GB HBM3"), ("fake", "NVIDIA H100 80GB HBM3")]
    assert caps == [2**30]


def test_profile_device_fake_and_bad_values(monkeypatch):
    import remat.planner as planner
    real_plan, devices = planner.plan, []

    def recording_plan(model, batch, budget, **options):
        devices.append(options.get("device"))
        return real_plan(model, batch, budget, **options)
    monkeypatch.setattr(planner, "plan", recording_plan)
    model = _llama()
    guard = remat.Guard(model, budget="1GiB", heads=["plain"], profile_device="fake")
    guard(_step_fn(model), _batches(count=1)[0])
    assert guard.replans == 1 and devices == [None]     # a CPU model: remat.plan's default, fake tensors
    with pytest.raises(ValueError, match="profile_device"):
        remat.Guard(model, budget="1GiB", profile_device="gpu")


def _micro_steps(model, batches):
    for batch in batches:
        model(**batch).loss.backward()


def test_a_redo_with_accumulation_gives_the_gradients_of_a_run_that_never_failed():
    """Two micro-batches accumulate, the third runs out of memory half way through its backward
    (after the later blocks' gradients were added to) and is redone: every gradient equals the
    run without a failure, bit for bit. Only the gradients the failed backward reached were
    copied, each once, and the others are the same tensors as before."""
    from remat.guard import GradKeeper, redo_out_of_memory
    batches = _batches(count=3, lengths=(12,))
    reference = _llama()
    model = copy.deepcopy(reference)
    torch.manual_seed(3)
    _micro_steps(reference, batches)
    torch.manual_seed(3)
    _micro_steps(model, batches[:2])
    before = {name: p.grad for name, p in model.named_parameters()}
    keepers = []

    class Recording(GradKeeper):
        def __init__(self, *args):
            super().__init__(*args)
            keepers.append(self)

        def restore(self):
            self.at_failure = set(self.copies)
            super().restore()
    handle = model.model.layers[2].register_forward_hook(_OOMAt(calls=[0]))
    import remat.guard as guard_module
    real = guard_module.GradKeeper
    guard_module.GradKeeper = Recording
    try:
        redo_out_of_memory(model, lambda: _micro_steps(model, batches[2:]), lambda: 2**30, budget=2**30,
                           max_retries=1, who="test")
    finally:
        guard_module.GradKeeper = real
        handle.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert p.grad is before[name], "restored into the same tensor"
    (keeper,) = keepers
    names = {id(p): name for name, p in model.named_parameters()}
    copied = {names[key] for key in keeper.at_failure}   # what the failed backward had reached
    assert copied and all(".layers.3." in n or n.startswith(("model.norm", "lm_head")) for n in copied), copied
    assert not any(".layers.0." in n or "embed_tokens" in n for n in copied)
    assert keeper.on_device


def test_a_plain_loop_copies_nothing_and_hooks_nothing():
    from remat.guard import GradKeeper
    model = _llama()
    keeper = GradKeeper(model, 2**30)
    with keeper.watching():
        assert all(not p._backward_hooks for p in model.parameters())
        _micro_steps(model, _batches(count=1))
    assert keeper.copies == {} and keeper.copied_bytes == 0
    keeper.restore()
    assert all(p.grad is None for p in model.parameters())


def test_the_copies_go_to_the_gpu_only_where_they_fit_beside_the_plan(monkeypatch):
    """The rule, with a GPU stood in for: the existing gradients' bytes next to the budget less the
    step's peak (the plan's predicted one, or the allocator's if higher)."""
    import remat.guard as guard_module
    model = _llama()
    _micro_steps(model, _batches(count=1))
    grads = [(p, p.grad) for p in model.parameters()]
    nbytes = sum(g.numel() * g.element_size() for _, g in grads)
    monkeypatch.setattr("remat.api.current_plan", lambda m: remat.Plan(blocks={}, notes={
        "predicted_peak_bytes": 10 * nbytes}))

    class Cuda:
        type = "cuda"

    class Grad:
        device = Cuda()

        def __init__(self, grad):
            self.grad = grad

        def untyped_storage(self):
            return self.grad.untyped_storage()
    existing = [(p, Grad(g)) for p, g in grads]
    measured = [0]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: measured[0])
    # private: the gradient keeper's fit rule alone, at sizes a CPU step cannot reach
    assert guard_module._fits_beside_plan(model, 11 * nbytes, existing)
    assert not guard_module._fits_beside_plan(model, 11 * nbytes - 1, existing)
    measured[0] = 12 * nbytes   # the allocator saw a higher peak than the plan predicted: that one counts
    assert not guard_module._fits_beside_plan(model, 12 * nbytes, existing)
    assert guard_module._fits_beside_plan(model, 13 * nbytes, existing)


def test_both_budget_none_callers_use_the_one_default(monkeypatch):
    import remat.guard as guard_module
    from remat.integrations.hf import RematCallback
    asked = []

    def default(module, who, instead):
        asked.append(who)
        return 123 * 2**20
    monkeypatch.setattr(guard_module, "free_memory_budget", default)
    # where the callbacks' shared planner (both RematCallbacks inherit it) looks the default up
    monkeypatch.setattr("remat.integrations._planning.free_memory_budget", default)
    assert remat.Guard(_llama()).budget == 123 * 2**20
    assert RematCallback().resolve_budget(_llama()) == 123 * 2**20
    assert asked == ["remat.Guard", "RematCallback"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"RematCallback\(budget=None\).*not on a GPU.*spec='full'"):
        RematCallback().resolve_budget(_llama())


def test_under_fsdp_every_existing_gradient_is_copied_before_the_step():
    """FSDP adds the reduced gradients to ``.grad`` outside autograd, where no hook sees it: the keeper
    then copies them all when it is made, and a redo still restores them."""
    from remat.guard import GradKeeper
    model = _fully_sharded(_llama())
    _micro_steps(model, _batches(count=1))
    saved = {id(p): p.grad.clone() for p in model.parameters()}
    keeper = GradKeeper(model, 2**30)
    assert set(keeper.copies) == set(saved)
    with keeper.watching():
        for p in model.parameters():      # as FSDP's reduce-scatter adds, outside autograd
            p.grad.add_(1.0)
    keeper.restore()
    assert all(torch.equal(p.grad, saved[id(p)]) for p in model.parameters())


def _fully_sharded(model):
    """``model`` as FSDP2's ``fully_shard`` leaves its class (``FSDP<Name>``, a subclass made for it),
    without sharding anything: FSDP's accumulation outside autograd cannot run in one CPU process."""
    model.__class__ = type(f"FSDP{type(model).__name__}", (type(model),), {})
    return model


def test_autograd_accumulates_except_under_fsdp():
    """The keeper copies the existing gradients when it is made only under FSDP (FSDP2's classes, FSDP1's
    wrapper modules), where autograd does not add to ``.grad`` itself; elsewhere it copies none before
    the step's backward reaches them."""
    from remat.guard import GradKeeper

    class FSDPLinear(torch.nn.Linear):
        pass
    for model, under_fsdp in ((_llama(), False), (_fully_sharded(_llama()), True),
                              (torch.nn.Sequential(FSDPLinear(2, 2)), True)):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        keeper = GradKeeper(model, 2**30)
        assert set(keeper.copies) == ({id(p) for p in model.parameters()} if under_fsdp else set()), type(model)
