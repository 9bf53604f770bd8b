"""One way to change a model (issue 9): the patch registry, atomic apply, undo that leaves
other libraries' wrappers alone, and treated models that pickle, save and copy.

Models are built with their config's defaults (``use_cache`` on), as ``from_pretrained``
gives them; the KV-cache and BatchNorm tests are here because both are about what a
treated block may change on its way through a training step.
"""
import copy
import inspect
import io
import pickle
import types

import pytest
import torch
import torch.nn as nn

import remat
import remat.api
from remat.treat import patches
from remat.treat.treatments import treatment_of
import oracle


def _llama(use_cache=None, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1, **extra)
    if use_cache is not None:
        config.use_cache = use_cache
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()

    def make_inputs(batch=2, seq=9):
        ids = torch.randint(0, 64, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}
    return model, make_inputs


def _batch(make_inputs):
    torch.manual_seed(123)
    return make_inputs()


def _state(model):
    """Everything apply may change on a module tree, as comparable data."""
    return [(name, type(m), sorted(k for k in m.__dict__ if not k.startswith("_") or k.startswith("_remat")),
             m.__dict__.get("forward")) for name, m in model.named_modules()]


# ------------------------------------------------------------------ the registry itself

def test_install_records_and_undo_restores_instance_attribute():
    module = nn.Linear(2, 2)
    theirs = types.MethodType(lambda self, x: x * 0, module)
    module.forward = theirs

    def doubled(patch, x):
        return patch.call_previous(x) * 2 + 1
    patch = patches.install(module, "forward", doubled, tag="t")
    assert torch.equal(module(torch.ones(1, 2)), torch.ones(1, 2))
    assert patches.patches(module) == [patch]
    patches.uninstall(patch)
    assert module.__dict__["forward"] is theirs and patches.patches(module) == []


def test_undo_runs_newest_first_across_modules():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    order = []
    for index, module in enumerate(model):
        patches.install_value(module, "flag", index, tag="t")
    for patch in reversed(patches.patches(model)):
        order.append(patch.module.flag)
    assert order == [1, 0]
    patches.remove(model)
    assert not any("flag" in m.__dict__ for m in model)


def test_suspended_puts_the_same_patches_back():
    model, _ = _llama()
    remat.apply(model, "every:2", head="chunked")
    before = [(p.module, p.attribute, p.tag) for p in patches.patches(model)]
    with patches.suspended(model):
        assert patches.patches(model) == [] and remat.current_plan(model) is None
        patches.install_value(model, "stray", 1, tag="t")   # removed with the block
    assert [(p.module, p.attribute, p.tag) for p in patches.patches(model)] == before
    assert "stray" not in model.__dict__ and remat.current_plan(model).head == "chunked"


# ------------------------------------------------------------------ remove keeps outside wrappers

def _autocast_like_accelerate(model):
    """What ``Accelerator(mixed_precision=...).prepare(model)`` does to ``model.forward``."""
    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*args, **kwargs)
    model.forward = forward


def test_remove_after_an_outside_wrapper_keeps_the_wrapper():
    model, make_inputs = _llama(use_cache=False)
    remat.apply(model, "full", head="chunked")
    _autocast_like_accelerate(model)
    wrapper = model.__dict__["forward"]
    remat.remove(model)
    assert model.__dict__["forward"] is wrapper                      # accelerate's autocast stays
    assert patches.patches(model) == [] and remat.current_plan(model) is None
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = model(**make_inputs())
    hook.remove()
    assert seen == [torch.bfloat16] and out.logits is not None     # autocast on, chunked head gone


def test_accelerate_prepare_then_remove_keeps_autocast():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)   # an earlier Trainer fixed the precision
    model, make_inputs = _llama(use_cache=False)
    remat.apply(model, "full", head="chunked")
    model = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    remat.remove(model)
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model(**make_inputs()).loss.backward()
    hook.remove()
    assert seen == [torch.bfloat16]


# ------------------------------------------------------------------ all-or-nothing apply

@pytest.mark.parametrize("bad", [dict(head="chunked", chunk_tokens=0), dict(head="chunked", chunk_tokens=2.5),
                                 dict(head="chunked", chunk_tokens=True), dict(head="sideways")])
def test_bad_head_arguments_leave_the_model_untouched(bad):
    model, _ = _llama()
    before = _state(model)
    with pytest.raises((ValueError, TypeError)):
        remat.apply(model, "full", **bad)
    assert _state(model) == before and remat.current_plan(model) is None


def test_refused_head_leaves_the_previous_plan_in_place():
    from transformers import ViTConfig, ViTForImageClassification
    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=48, image_size=16, patch_size=8))
    remat.apply(model, "selective")
    before = _state(model)
    plan = remat.current_plan(model)
    with pytest.raises(ValueError, match="head='plain'"):
        remat.apply(model, "full", head="chunked")
    assert _state(model) == before and remat.current_plan(model) is plan
    assert set(remat.api.treatments(model).values()) == {"selective"}


def test_failure_while_installing_rolls_back_to_the_previous_plan(monkeypatch):
    model, make_inputs = _llama(use_cache=False)
    reference = copy.deepcopy(model)
    remat.apply(model, "mlp", head="chunked")
    plan = remat.current_plan(model)
    before = _state(model)

    def broken(*args, **kwargs):
        raise RuntimeError("installing failed half way")
    monkeypatch.setattr(remat.api, "_guard_hf_checkpointing", broken)   # after blocks and head went in
    with pytest.raises(RuntimeError, match="half way"):
        remat.apply(model, "full")
    monkeypatch.undo()
    assert _state(model) == before and remat.current_plan(model) is plan
    assert {treatment_of(b) for b in model.model.layers} == {"mlp"}
    remat.apply(reference, "mlp", head="chunked")
    oracle.compare(model, reference, _batch(make_inputs)).assert_equal()  # both treated alike: the math only


def test_apply_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        remat.apply("model", "full")


# ------------------------------------------------------------------ pickle, torch.save, deepcopy

@pytest.mark.parametrize("spec", ["full", "selective", "mlp", "offload", "full+offload"])
def test_treated_model_saves_loads_and_trains_like_eager(spec, recwarn):
    model, make_inputs = _llama(use_cache=False)
    reference = copy.deepcopy(model)
    remat.apply(model, spec, head="chunked", offload_options={"_inline": True, "min_bytes": 0})  # offload moves
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert remat.current_plan(loaded) == remat.current_plan(model)
    assert {treatment_of(b) for b in loaded.model.layers} == {spec}
    remat.apply(reference, "keep", head="chunked")     # the same loss path, blocks untouched
    oracle.check(loaded, reference, _batch(make_inputs))
    # the loaded model's patches refer to the loaded modules, not to the saved ones
    assert all(p.module is m for m in loaded.modules() for p in m.__dict__.get("_remat_patches", ()))
    remat.remove(loaded)
    assert patches.patches(loaded) == [] and "forward" not in loaded.model.layers[0].__dict__


@pytest.mark.parametrize("spec", ["full", "offload", "full+offload", "mlp", "attention"])
def test_deepcopy_and_pickle_of_a_treated_model(spec, recwarn):
    model, make_inputs = _llama(use_cache=False)
    remat.apply(model, spec)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(p.module is m for m in copied.modules() for p in m.__dict__.get("_remat_patches", ()))
        # a sub-module's bound forward (mlp, attention) is bound to the copy's own patch: the newest, over
        # the copy's older ones (transformers 5.25's hub-kernel wrappers: remat.treat.hub_kernels)
        for m in copied.modules():
            forwards = [p for p in m.__dict__.get("_remat_patches", ()) if p.attribute == "forward"]
            if forwards and isinstance(m.forward, types.MethodType):
                assert m.forward.__self__ is forwards[-1]
                assert all(newer.previous.__self__ is older for older, newer in zip(forwards, forwards[1:]))
        oracle.compare(copied, model, _batch(make_inputs)).assert_equal()  # both treated alike: the math only


# ------------------------------------------------------------------ compiled block by block

def _graphs_compiling_blocks(spec, use_cache, compiled):
    """Graphs dynamo makes for one training step of a tiny Llama (config defaults but ``use_cache``)
    whose first ``compiled`` blocks are each ``block.compile()``-d, treated with ``spec`` (None:
    untouched); and its parameters' gradients beside an eager copy's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=use_cache)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    if spec is not None:
        remat.apply(model, spec)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    try:
        for block in model.model.layers[:compiled]:
            block.compile(backend=counting_backend)
        for m in (model, reference):
            m(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch._dynamo.reset()
    grads = [(name, p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())]
    return len(graphs), grads


@pytest.mark.parametrize("use_cache", [True, False])   # True: the config's default, as from_pretrained gives it
@pytest.mark.parametrize("spec", ["mlp", "attention", "full"])
def test_blocks_compiled_each_alone_share_their_graphs(spec, use_cache, recwarn):
    """FSDP2's per-block compile (``block.compile()`` on every block): remat's treatments add no
    graph to what the untouched model compiles, and without a KV cache the blocks of one class
    share theirs (as many graphs with four blocks compiled as with one; torch 2.6 breaks the graph
    inside a sub-module's checkpoint: more than one graph, the same count). A sub-module's patched
    forward (``mlp``, ``attention``) installed as a partial was a new dynamo guard per block (past
    ``recompile_limit`` the rest ran eager). With the config's default ``use_cache`` the model's own
    cache makes every block a new graph, treated or not (``remat doctor``: ``use-cache``). Loss and
    gradients stay eager's."""
    treated, grads = _graphs_compiling_blocks(spec, use_cache, 4)
    untouched, _ = _graphs_compiling_blocks(None, use_cache, 4)
    assert treated <= untouched, (treated, untouched)
    for name, grad, expected in grads:
        torch.testing.assert_close(grad, expected, msg=name)
    if not use_cache:
        one, _ = _graphs_compiling_blocks(spec, use_cache, 1)
        assert one and treated == one, (one, treated)


# ------------------------------------------------------------------ what users' tools read

def test_forward_keeps_its_signature():
    model, _ = _llama()
    expected = inspect.signature(model.forward)
    remat.apply(model, "full", head="chunked")
    assert inspect.signature(model.forward) == expected
    assert inspect.signature(model.model.layers[0].forward) == inspect.signature(
        type(model.model.layers[0]).forward.__get__(model.model.layers[0]))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.gpu
def test_data_parallel_is_refused_with_the_fix():
    model, make_inputs = _llama(use_cache=False)
    model = model.cuda()
    remat.apply(model, "full")
    parallel = nn.DataParallel(model)
    inputs = {k: v.cuda() for k, v in make_inputs(batch=4).items()}
    with pytest.raises(ValueError, match="DataParallel"):
        parallel(**inputs)


# ------------------------------------------------------------------ the KV cache and running stats

@pytest.mark.parametrize("spec", ["full", "selective", "every:2", "full+offload"])
def test_config_default_use_cache_is_safe_and_exact(spec, recwarn):
    model, make_inputs = _llama()                  # use_cache=True, as from_pretrained gives it
    assert model.config.use_cache is True
    reference = copy.deepcopy(model)
    remat.apply(model, spec, offload_options={"_inline": True, "min_bytes": 0})  # offload moves for real
    oracle.check(model, reference, _batch(make_inputs))
    out = model(**make_inputs(seq=9))
    cache = getattr(out, "past_key_values", None)
    if cache is not None and hasattr(cache, "get_seq_length"):
        assert cache.get_seq_length() <= 9                           # never grown by a recompute


def test_gemma2_full_with_the_default_cache():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                          max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).train()
    reference = copy.deepcopy(model)
    remat.apply(model, "full")

    def make_inputs():
        ids = torch.randint(0, 64, (2, 12))
        return {"input_ids": ids, "labels": ids.clone()}
    oracle.check(model, reference, _batch(make_inputs))


def test_generation_keeps_the_cache():
    model, _ = _llama()
    remat.apply(model, "full")
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (1, 5)), use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 5


class _ResidualConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


@pytest.mark.parametrize("spec", ["full", "selective", "full+offload"])
def test_batchnorm_statistics_update_once_under_recompute(spec, recwarn):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Sequential(*[_ResidualConv(8) for _ in range(3)]))
    reference = copy.deepcopy(model)
    remat.apply(model, spec, blocks="1")
    x = torch.randn(4, 3, 6, 6)
    for net in (model, reference):
        torch.manual_seed(1)
        net(x).square().mean().backward()
    for (name, b), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b, ref), name
    assert int(model[1][0].norm.num_batches_tracked) == 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_batchnorm_statistics_that_a_first_forward_left_unchanged_update_once_later():
    """A first batch whose mean is exactly 0 leaves BatchNorm's running mean bitwise as it was (only
    its batch count moves): the running mean must still be restored around every later recompute.
    (EfficientNet's depthwise norms on an AMD EPYC CPU: a second step's running mean differed by 1%.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Sequential(*[_ResidualConv(4) for _ in range(2)]))
    with torch.no_grad():
        for block in model[1]:
            block.conv.bias.zero_()   # a batch of zeros: the conv's outputs exactly 0, their mean too
    reference = copy.deepcopy(model)
    remat.apply(model, "full", blocks="1")
    batches = [torch.zeros(2, 4, 3, 3), torch.randn(2, 4, 3, 3)]
    for net in (model, reference):
        for step, x in enumerate(batches):
            torch.manual_seed(step)
            net.zero_grad()
            net(x.requires_grad_()).square().mean().backward()
    assert not torch.equal(model[1][0].norm.running_mean, torch.zeros(4))   # the second batch moved it
    assert torch.equal(model[1][0].norm.running_mean, reference[1][0].norm.running_mean)
    for (name, b), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b, ref), name
