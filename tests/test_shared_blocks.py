"""Blocks called several times a step (issue 29, item 6): ALBERT's one layer group, called for every layer.

``AlbertForMaskedLM`` keeps one ``AlbertLayerGroup`` in ``albert.encoder.albert_layer_groups`` and
calls it ``num_hidden_layers`` times a forward. remat treats that module as one block called N times
(:mod:`remat.planning.calls`): every treatment applies to every call, gradients match the untouched
model, the recompute really runs (forwards of the shared layer counted), the profile knows the
calls, the simulator walks each call (its predicted peak is the CPU-measured one) and the solver
gives every call of a block one treatment.
"""
import copy
import itertools
import operator
import warnings

import pytest
import torch

import oracle
import remat
from remat.planning.calls import pinned, unrolled
from remat.planning.simulator import simulate
from remat.planning.solver import plan_score
from remat.prove.memtrack import PeakTracker

transformers = pytest.importorskip("transformers")

LAYERS, TOKENS = 6, 32
GROUP = "albert.encoder.albert_layer_groups.0"
# offload on the CPU: the engine's inline mode really copies each saved tensor out and back
INLINE = {"_inline": True, "min_bytes": 0}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster, and steadier on a loaded machine (as the zoo runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def albert(groups=1, inner=1, dropout=0.1, seed=0):
    config = transformers.AlbertConfig(vocab_size=512, embedding_size=32, hidden_size=64, num_attention_heads=4,
                                       intermediate_size=128, num_hidden_layers=LAYERS, num_hidden_groups=groups,
                                       inner_group_num=inner, hidden_dropout_prob=dropout,
                                       attention_probs_dropout_prob=dropout)
    torch.manual_seed(seed)
    return transformers.AlbertForMaskedLM(config).train()


def batch(tokens=TOKENS):
    ids = torch.randint(3, 512, (2, tokens), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def check(treated, reference, data):
    """:func:`oracle.check` within fp32 rounding: a block called six times a step sums its weight
    gradients over the calls in another order under a recompute."""
    return oracle.check(treated, reference, data, rtol=oracle.FP32_REORDERED)


def forwards(model, data, module):
    """How many times ``module`` runs forward in one training step."""
    calls = []
    handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        model.zero_grad(set_to_none=True)
        oracle.model_loss(model, data).backward()
    finally:
        handle.remove()
    return len(calls)


def test_discovery_finds_the_shared_group_and_the_layers_of_larger_groups():
    assert remat.discover(albert()).block_names == (GROUP,)
    assert remat.discover(albert(inner=2)).block_names == (f"{GROUP}.albert_layers.0", f"{GROUP}.albert_layers.1")
    assert remat.discover(albert(groups=3, inner=2)).block_names == tuple(
        f"albert.encoder.albert_layer_groups.{g}" for g in range(3))


# (spec, a module inside what the treatment recomputes, how many times it runs a step: twice per
# call where each call is recomputed; the recomputed module itself is called past its hooks)
RECOMPUTES = [("full", "layer", 2 * LAYERS), ("selective", "layer", 2 * LAYERS),
              ("attention", "query", 2 * LAYERS), ("mlp", "query", LAYERS),
              ("full+offload", "layer", 2 * LAYERS), ("every:2", "layer", 2 * LAYERS),
              ("segments:2", "layer", 2 * LAYERS), ("offload", "layer", LAYERS)]


@pytest.mark.parametrize("spec, where, runs", RECOMPUTES)
def test_every_treatment_applies_to_every_call_and_recomputes(spec, where, runs):
    reference, data = albert(), batch()
    model = copy.deepcopy(reference)
    remat.apply(model, spec, offload_options=INLINE)
    assert remat.api.treatments(model) == {GROUP: remat.current_plan(model).blocks[GROUP]} != {GROUP: "keep"}
    result = check(model, reference, data)
    layer = model.albert.encoder.albert_layer_groups[0].albert_layers[0]
    module = {"layer": layer, "query": layer.attention.query}[where]
    assert forwards(model, data, module) == runs  # one recompute per call (offload: none)
    if spec == "mlp":  # the checkpointed ffn projection: its recompute (all a Linear needs again is its
        transposes = (m.ops_by_op[torch.ops.aten.t.default] for m in (result.treated, result.reference))
        assert operator.sub(*transposes) == LAYERS  # weight transposed) once per call
    if "offload" in spec:
        from remat.treat.treatments import engine_of
        stats = engine_of(model).stats()
        assert stats["bytes_d2h"] > 0 and stats["bytes_h2d"] > 0  # every call's saved tensors went out and back


@pytest.mark.parametrize("spec", ["tiled", "full+tiled"])
def test_tiled_treatments_run_in_chunks_on_every_call(spec):
    reference, data = albert(), batch()
    model = copy.deepcopy(reference)
    remat.apply(model, spec, tile_tokens=16)  # 64 tokens in chunks of 16
    check(model, reference, data)


def test_groups_of_layers_plan_apply_and_match():
    """num_hidden_groups 3 of inner_group_num 2 layers: three blocks, each called twice (inner_group_num
    alone, two layers called in turn, is planned in test_the_tied_solver_is_the_best_tied_plan)."""
    reference, data = albert(3, 2), batch()
    model = copy.deepcopy(reference)
    prof = remat.profile(copy.deepcopy(model), data, device="fake")
    assert prof.block_calls == (0, 0, 1, 1, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the offload engine has no GPU here
        plan = remat.plan(model, data, budget=_middle(prof), profiled=prof)
    assert plan.notes["predicted_peak_bytes"] <= _middle(prof)
    remat.apply(model, plan, offload_options=INLINE)
    check(model, reference, data)


def _middle(prof):
    keep, full = (simulate(prof, t).peak_bytes for t in ("keep", "full"))
    return (keep + full) // 2


@pytest.fixture(scope="module")
def profiled():
    model, data = albert(), batch()
    return model, data, remat.profile(copy.deepcopy(model), data, device="fake")


def test_the_profile_knows_the_calls_and_the_stubbed_step_runs(profiled):
    """The capture sees six calls of one block; the head's stubbed step (which ran "10 of its 6 phases"
    when each block was taken to run once) is profiled in both head modes; naming the container works."""
    model, data, prof = profiled
    assert prof.block_names == (GROUP,) and prof.block_calls == (0,) * LAYERS
    assert {h.mode for h in prof.heads} == {"plain", "chunked"}
    assert remat.profile(model, data, device="fake", blocks="albert.encoder.albert_layer_groups").block_calls == \
        (0,) * LAYERS
    keep = prof.cost(0, "keep")
    grads = sum(-(-p.numel() * 4 // 512) * 512 for p in model.albert.encoder.albert_layer_groups[0].parameters())
    assert keep.grad_bytes == grads and keep.bwd_end >= grads


def test_the_simulator_walks_every_call(profiled):
    _, _, prof = profiled
    sim = simulate(prof, "full")
    forwards_ = [p for p in sim.timeline if p.name.startswith("forward of block")]
    assert [p.name.split("(")[1].split(",")[0] for p in forwards_] == [f"{GROUP}#{k}" for k in range(1, LAYERS + 1)]
    keep = simulate(prof, "keep")
    # each call keeps its own: the peak grows by one call's kept bytes per call
    assert keep.peak_bytes - sim.peak_bytes > (LAYERS - 1) * (prof.cost(0, "keep").kept - prof.cost(0, "full").kept)


@pytest.mark.parametrize("inner, specs", [(1, ("keep", "full", "selective")), (2, ("keep", "full"))])
def test_predicted_peak_is_the_measured_one(inner, specs):
    """Six calls' kept bytes (two layers called in turn: twelve), one set of gradients: the simulator's
    peak is what a CPU step holds."""
    model, ids = albert(inner=inner, dropout=0.0), batch(64)["input_ids"]
    prof = remat.profile(copy.deepcopy(model), ids, gpu="cpu")
    for spec in specs:
        remat.apply(model, spec)
        model.zero_grad(set_to_none=True)
        with PeakTracker(list(model.parameters()) + list(model.buffers())) as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
        remat.remove(model)
        predicted = simulate(prof, {name: spec for name in prof.block_names}).peak_bytes
        # over by at most a block's gradients: a later call's backward peak is the one measured alone,
        # where its gradients stay (in the step they are summed into the buffer one by one)
        assert -0.01 < (predicted - tracker.peak) / tracker.peak < 0.025, (spec, predicted, tracker.peak)


def test_plans_tie_every_call_and_apply_exactly(profiled):
    model, data, prof = profiled
    with pytest.raises(remat.NoPlanFits) as info:
        remat.plan(model, data, budget=1, profiled=prof)
    smallest = info.value.smallest_peak
    assert list(info.value.plan.blocks) == [GROUP] and "1x " in str(info.value)
    for budget in (smallest, _middle(prof), 10 * simulate(prof, "keep").peak_bytes):
        plan = remat.plan(model, data, budget=budget, profiled=prof)
        assert list(plan.blocks) == [GROUP]
        assert plan.notes["predicted_peak_bytes"] == simulate(prof, plan).peak_bytes <= budget
        treated, reference = copy.deepcopy(model), copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remat.apply(treated, plan, offload_options=INLINE)
        check(treated, reference, data)


def test_the_tied_solver_is_the_best_tied_plan():
    """Two blocks, each called six times: the solver's plan scores as the best of every tied choice that fits."""
    reference, data = albert(inner=2), batch()
    model = copy.deepcopy(reference)
    prof = remat.profile(copy.deepcopy(model), data, device="fake")
    assert prof.block_calls == (0, 1) * LAYERS
    budget = _middle(prof)
    plan = remat.plan(model, data, budget=budget, profiled=prof, treatments=["keep", "full", "selective", "attention"])
    remat.apply(model, plan)
    check(model, reference, data)
    best = None
    for combo in itertools.product(["keep", "full", "selective", "attention"], repeat=2):
        for head in prof.heads:
            bound = simulate(prof, list(combo), head=head.mode, chunk_tokens=head.chunk_tokens).bound_bytes
            if bound <= budget:
                score = plan_score(prof, list(combo), head)
                best = score if best is None else min(best, score)
    chosen = plan_score(prof, [plan.blocks[n] for n in prof.block_names], prof.head(plan.head, plan.chunk_tokens))
    assert chosen == pytest.approx(best, rel=1e-9)
    flat = pinned(prof, {0: "full", 1: "keep"})
    assert len(flat.block_names) == 2 * LAYERS == len(unrolled(prof).block_names)
    assert {flat.treatments(i) for i in range(2 * LAYERS)} == {("full",), ("keep",)}


def test_distributed_time_models_refuse_with_what_to_do(profiled):
    model, data, prof = profiled
    for world in ({"ddp_world": 2}, {"fsdp_world": 2}):
        with pytest.raises(ValueError, match="runs 6 times.*plan for one GPU"):
            remat.plan(model, data, budget="1GiB", profiled=prof, **world)
