"""The budget is a card: the optimizer's step in the peak, the allocator's reserve kept out of the budget,
expandable segments held while a plan is applied, a budget larger than the card planned for the card.

The optimizer's side is measured: torch's AdamW steps on CPU tensors under remat's storage tracker
(the foreach, for-loop and fused implementations run the same ops on a CPU as on a GPU), against
:func:`remat.planning.costs.optimizer_temp_bytes` and the simulator's optimizer phase. The allocator's
side (expandable segments) needs CUDA to act; here its bookkeeping is checked with the setter
replaced, and the GPU bench (benchmarks/allocator_probe.py) shows the effect.
"""
import gc
import warnings

import pytest
import torch

import remat
from remat.planner import FRAGMENTATION_SHARE, RESERVE_SHARE, solve_profiled, within_card
from remat.planning.costs import CARD_BYTES, optimizer_temp_bytes
from remat.planning.simulator import simulate
from remat.planning.solver import NoPlanFits
from remat.presets import build_model, load_config
from remat.profiling.profiler import profile, trainable_shapes
from remat.prove.memtrack import PeakTracker
from remat.treat import allocator
from remat.units import parse_size

OPTIMIZERS = {"adamw": dict(foreach=True), "adamw-forloop": dict(foreach=False), "adamw-fused": dict(fused=True)}


def tiny(mixed: bool = False):
    torch.manual_seed(0)
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    if mixed:  # two dtype groups: the foreach step makes one temporary per group, two alive at once
        for block in model.model.layers[:1]:
            block.to(torch.float64)
        model.model.layers[0].register_forward_pre_hook(lambda m, args, kwargs: (
            tuple(a.double() if torch.is_floating_point(a) else a for a in args),
            {k: v.double() if isinstance(v, torch.Tensor) and torch.is_floating_point(v) else v
             for k, v in kwargs.items()}), with_kwargs=True)
        model.model.layers[0].register_forward_hook(lambda m, args, out: (
            out.float() if isinstance(out, torch.Tensor) else (out[0].float(), *out[1:])))
    return model.train()


def step_temporaries(model, ids, optimizer) -> int:
    """Bytes an optimizer step allocates above parameters, gradients and states, measured on its second step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **OPTIMIZERS[optimizer])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        with PeakTracker(list(model.parameters()) + grads + states) as tracker:
            before = tracker.current
            opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker.peak - before


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "two-dtypes"])
def test_the_optimizer_steps_temporaries_are_what_adamw_allocates(optimizer, mixed):
    model = tiny(mixed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    measured = step_temporaries(model, ids, optimizer)
    predicted = optimizer_temp_bytes(optimizer, trainable_shapes(model))
    assert predicted == measured, (optimizer, predicted, measured)
    if optimizer == "adamw":   # a temporary as large as the parameters: a term that sets peaks
        assert measured >= sum(n * s for n, s in trainable_shapes(model))


def test_the_optimizer_step_is_a_phase_whose_peak_is_measured():
    """A step with AdamW (foreach) peaks at the optimizer's step for a checkpointed tiny model: the
    simulator's optimizer phase predicts that peak, which every other phase misses by more than 1%."""
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    prof = profile(model, ids, gpu="cpu", optimizer="adamw")
    remat.apply(model, "full")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()                              # states allocated: the steady step follows
        opt.zero_grad(set_to_none=True)
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        gc.collect()
        with PeakTracker(list(model.parameters()) + list(model.buffers()) + states) as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        remat.remove(model)
    sim = simulate(prof, "full")
    assert sim.peak_at == "optimizer step (adamw)"
    assert abs(sim.peak_bytes - tracker.peak) <= 0.01 * tracker.peak, (sim.peak_bytes, tracker.peak)
    others = max(p.peak_bytes for p in sim.timeline if not p.name.startswith("optimizer"))
    assert others < 0.99 * tracker.peak     # without the phase the prediction would be low


def test_fsdp_ranks_step_over_their_shard():
    from remat.planning.sharding import shard
    from remat.profiling.profiler import block_param_bytes
    model = tiny()
    prof = profile(model, torch.zeros(2, 32, dtype=torch.long), gpu="h100", optimizer="adamw")
    sharded = shard(prof, 4, block_param_bytes(model, prof))
    assert sharded.optimizer_temp_bytes == -(-prof.optimizer_temp_bytes // 4) > 0


@pytest.fixture(scope="module")
def gpu_profile():
    """A fake-tensor profile of a small model for an H100 (a plan that runs on a card)."""
    model = build_model(load_config("llama-tiny"), dtype=torch.bfloat16)
    return profile(model, torch.zeros(2, 256, dtype=torch.long), gpu="h100", optimizer="adamw")


def test_a_plan_for_a_card_keeps_the_allocators_reserve_out_of_its_budget(gpu_profile, monkeypatch):
    monkeypatch.delenv(allocator.ENV_OPT_OUT, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    budget = int(simulate(gpu_profile, "full", head="chunked").peak_bytes * 1.3)
    plan = solve_profiled(gpu_profile, budget)
    reserve = int(RESERVE_SHARE * budget)
    assert plan.notes["allocator_reserve_bytes"] == reserve
    assert plan.notes["allocator"].startswith("expandable segments")
    assert plan.notes["predicted_peak_bytes"] <= budget - reserve
    assert plan.notes["card_bytes"] == plan.notes["predicted_peak_bytes"] + reserve <= budget
    assert plan.notes["budget_bytes"] == budget


def test_without_expandable_segments_a_share_of_the_activations_is_kept_for_fragmentation(gpu_profile, monkeypatch):
    monkeypatch.setenv(allocator.ENV_OPT_OUT, "0")
    budget = int(simulate(gpu_profile, "full", head="chunked").peak_bytes * 1.6)
    plan = solve_profiled(gpu_profile, budget)
    reserve = int(FRAGMENTATION_SHARE * (budget - gpu_profile.static_bytes))
    assert plan.notes["allocator_reserve_bytes"] == reserve
    assert "fixed-size segments" in plan.notes["allocator"] and "REMAT_EXPANDABLE_SEGMENTS=0" in plan.notes["allocator"]
    assert plan.notes["predicted_peak_bytes"] <= budget - reserve


@pytest.mark.parametrize("expandable", [True, False])
def test_the_budget_no_plan_fits_names_one_that_does(gpu_profile, monkeypatch, expandable):
    if expandable:
        monkeypatch.delenv(allocator.ENV_OPT_OUT, raising=False)
    else:
        monkeypatch.setenv(allocator.ENV_OPT_OUT, "0")
    smallest = simulate(gpu_profile, "full", head="chunked").peak_bytes
    with pytest.raises(NoPlanFits, match="kept for the caching allocator") as caught:
        solve_profiled(gpu_profile, int(smallest * 0.9))
    need = caught.value.smallest_peak
    plan = solve_profiled(gpu_profile, need)   # the budget the error names is one that plans
    assert plan.notes["card_bytes"] <= need


def test_a_cpu_plan_keeps_nothing_back():
    model = tiny()
    ids = torch.zeros(2, 32, dtype=torch.long)
    prof = profile(model, ids, gpu="cpu")
    plan = solve_profiled(prof, prof.static_bytes * 3)
    assert "allocator_reserve_bytes" not in plan.notes


def test_a_budget_larger_than_the_card_plans_for_the_card():
    with pytest.warns(UserWarning, match=r"more than an H100 holds \(79.20 GiB\); planning for 79.20 GiB"):
        assert within_card(parse_size("100GiB"), gpu="h100") == CARD_BYTES["h100"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert within_card(parse_size("60GiB"), gpu="h100") == parse_size("60GiB")
        assert within_card(parse_size("900GiB"), gpu="cpu") == parse_size("900GiB")   # no card to compare with
    model = build_model(load_config("llama-tiny"), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="more than an H200 holds"):
        plan = remat.plan(model, torch.zeros(1, 64, dtype=torch.long), "200GiB", gpu="h200")
    assert plan.notes["budget_bytes"] == CARD_BYTES["h200"]


def test_plan_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="expects a torch.nn.Module as its first argument, got str"):
        remat.plan("model", torch.zeros(1, 8, dtype=torch.long), "1GiB")


class FakeSetting:
    """The allocator setting, as :mod:`remat.treat.allocator` reads and writes it."""

    def __init__(self, value=None):
        self.value, self.writes = value, []

    def install(self, monkeypatch):
        monkeypatch.setattr(allocator, "_current", lambda: self.value)
        monkeypatch.setattr(allocator, "_set", lambda on: (self.writes.append(on), setattr(self, "value", on)))
        monkeypatch.delenv(allocator.ENV_OPT_OUT, raising=False)
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setattr(allocator, "_holders", {})
        monkeypatch.setattr(allocator, "_state", {"before": None})
        return self


def test_expandable_segments_are_held_while_any_model_holds_a_plan(monkeypatch):
    setting = FakeSetting(False).install(monkeypatch)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert allocator.hold(a) is None and setting.value is True
    assert allocator.hold(b) is None and allocator.hold(a) is None
    assert setting.writes == [True]
    allocator.release(a)
    assert setting.value is True                      # b still holds it
    del b
    gc.collect()                                      # a model deleted without remove releases it too
    assert setting.value is False and setting.writes == [True, False]


def test_a_setting_already_on_is_left_on(monkeypatch):
    setting = FakeSetting(True).install(monkeypatch)
    model = torch.nn.Linear(2, 2)
    allocator.hold(model)
    allocator.release(model)
    assert setting.writes == [] and setting.value is True


@pytest.mark.parametrize("env, value, reason", [
    ("REMAT_EXPANDABLE_SEGMENTS", "0", "REMAT_EXPANDABLE_SEGMENTS=0 opts out"),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False", "sets expandable_segments:False"),
])
def test_an_opt_out_is_respected_and_said(monkeypatch, env, value, reason):
    setting = FakeSetting(False).install(monkeypatch)
    monkeypatch.setenv(env, value)
    assert reason in allocator.hold(torch.nn.Linear(2, 2))
    assert setting.writes == []


def test_apply_holds_the_setting_for_a_model_that_trains_on_a_gpu_and_remove_gives_it_back(monkeypatch):
    setting = FakeSetting(False).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)   # FSDP2's way: meta first
    remat.apply(model, "full")
    assert setting.value is True and allocator.holds(model)
    remat.remove(model)
    assert setting.value is False and not allocator.holds(model)
    remat.apply(model, "full", expandable_segments=False)
    assert setting.writes == [True, False]
    cpu_model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    remat.apply(cpu_model, "full")                    # a CPU model: the CUDA allocator is not touched
    assert setting.writes == [True, False]


def test_a_plan_counting_on_expandable_segments_warns_where_they_cannot_be_had(monkeypatch):
    FakeSetting(False).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    model = build_model(load_config("llama-tiny"), device="meta", dtype=torch.bfloat16)
    names = remat.discover(model).block_names
    plan = remat.Plan(blocks={n: "full" for n in names},
                      notes={"allocator": "expandable segments (remat.apply switches them on)"})
    with pytest.warns(UserWarning, match="this plan was made counting on them"):
        remat.apply(model, plan)
    remat.remove(model)


def test_a_head_that_does_not_fit_is_left_out_with_a_note_not_a_warning():
    """On a GPU, planning inside the budget can run out of memory measuring the plain head's logits;
    that head cannot be part of a plan within the budget: it is left out and noted, not warned. (No
    CPU run runs out of memory, so the model's LM head raises it when it computes the logits: the
    chunked head never calls it, computing each chunk's logits from its weight.)"""
    model = tiny()

    def logits_out_of_memory(hidden):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")
    model.lm_head.forward = logits_out_of_memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof = profile(model, torch.zeros(2, 32, dtype=torch.long), gpu="h100")
    assert {h.mode for h in prof.heads} == {"chunked"}
    assert "needs more GPU memory than planning may take" in prof.notes["plain"]


def test_planning_holds_expandable_segments_only_while_it_plans(monkeypatch):
    setting = FakeSetting(False).install(monkeypatch)
    with allocator.while_planning():
        assert setting.value is True
    assert setting.value is False
    model = torch.nn.Linear(2, 2)
    allocator.hold(model)                         # a model applied meanwhile keeps them on
    with allocator.while_planning():
        pass
    assert setting.value is True
    allocator.release(model)
    assert setting.writes == [True, False, True, False]
