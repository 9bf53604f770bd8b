"""remat.treat.mask_skip: under torch.compile the attention mask is skipped where eager skips it.

Each compiled run goes through a backend that records every SDPA call dynamo put in the graph
(its ``attn_mask`` and ``is_causal``), then runs the graph as captured. transformers 5.24 with
torch 2.13 already skips the causal mask under compile; transformers 5.17 (the GPU machine's)
refuses whenever dynamo traces. The tests put 5.17's rule in place where the installed one
differs, so that remat's wrapper is what makes the difference.
"""
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
if not hasattr(torch.compiler, "_is_exporting_flag"):
    pytest.skip("this torch cannot tell torch.export from torch.compile: remat wraps nothing", allow_module_level=True)

import remat  # noqa: E402
from remat.treat import mask_skip  # noqa: E402


def _tiny(kind="llama"):
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=128, attn_implementation="sdpa")
        return transformers.BertModel(config)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _compiled_sdpa_calls(model, **inputs):
    """(the SDPA calls in the compiled graphs as (has a mask, is_causal), the output)."""
    calls = []

    def backend(gm, example_inputs):
        graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]  # checkpoints nest theirs
        for node in (n for graph in graphs for n in graph.nodes):
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask is not None, node.kwargs.get("is_causal", False)))
        return gm.forward

    torch._dynamo.reset()
    try:
        output = torch.compile(model, backend=backend)(**inputs)
    finally:
        torch._dynamo.reset()
    return calls, output


def _rule_of_5_17(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    """transformers 5.17's decision: never skip while dynamo traces (the rest as eager decides)."""
    if torch.compiler.is_compiling():
        return False
    return padding_mask is None and (q_length == 1 or q_length == kv_length)


@pytest.fixture
def rule_5_17(monkeypatch):
    _release_all()  # an earlier test's model, still alive in this worker, would hold the wrappers through the test
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", _rule_of_5_17)
    yield
    _release_all()


# private (_holders, _forget): models of earlier tests in this process may still hold the wrappers;
# releasing them all, alive or not, has no public call (release() takes one model)
def _release_all():
    for finalizer in list(mask_skip._holders.values()):
        finalizer.detach()
    mask_skip._holders.clear()
    mask_skip._forget(None)


def test_a_function_that_replaced_the_wrapper_is_wrapped_at_the_next_apply(rule_5_17, monkeypatch):
    """One model holds remat's wrapper when something replaces transformers' function (the rule of
    5.17 set again; in a test process, a model of an earlier test not yet collected holds it):
    applying remat to the next model wraps the replacement, and its compiled attention runs
    causal without a mask."""
    ids = torch.randint(0, 128, (2, 16))
    first = _tiny()
    remat.apply(first, "keep")
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", _rule_of_5_17)
    second = _tiny()
    remat.apply(second, "keep")
    calls, _ = _compiled_sdpa_calls(second, input_ids=ids, labels=ids)
    assert calls == [(False, True)] * 2


def test_without_remat_the_5_17_rule_compiles_a_masked_non_causal_attention(rule_5_17):
    ids = torch.randint(0, 128, (2, 16))
    calls, _ = _compiled_sdpa_calls(_tiny(), input_ids=ids)
    assert calls == [(True, False)] * 2


def test_applied_model_compiles_causal_attention_without_a_mask_and_same_loss_and_grads(rule_5_17):
    ids = torch.randint(0, 128, (2, 16))
    reference = _tiny()
    reference_loss = reference(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    model = remat.apply(_tiny(), "full")
    assert mask_skip.wrapped()
    calls, output = _compiled_sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(False, True)] * 2
    output.loss.backward()
    torch.testing.assert_close(output.loss, reference_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_padding_mask_is_left_to_transformers(rule_5_17):
    ids = torch.randint(0, 128, (2, 16))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :4] = 0
    model = remat.apply(_tiny(), "keep")
    eager = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
    calls, output = _compiled_sdpa_calls(model, input_ids=ids, attention_mask=attention_mask, labels=ids)
    assert calls and all(has_mask for has_mask, _ in calls)
    torch.testing.assert_close(output.loss, eager)


def test_the_installed_transformers_skips_under_compile_once_remat_holds_the_model():
    ids = torch.randint(0, 128, (2, 16))
    model = remat.apply(_tiny(), "keep")
    calls, _ = _compiled_sdpa_calls(model, input_ids=ids)
    assert calls == [(False, True)] * 2
    remat.remove(model)


def test_encoder_without_padding_mask_runs_unmasked_under_compile():
    model = _tiny("bert")
    remat.apply(model, "keep")
    calls, _ = _compiled_sdpa_calls(model, input_ids=torch.randint(0, 128, (2, 16)))
    assert calls == [(False, False)] * 2
    remat.remove(model)


def test_held_while_an_applied_model_lives_and_given_back_by_remove_or_collection(rule_5_17):
    first, second = remat.apply(_tiny(), "keep"), remat.apply(_tiny(), "full")
    assert masking_utils._ignore_causal_mask_sdpa is not _rule_of_5_17
    remat.remove(first)
    assert mask_skip.wrapped(), "the second model still holds it"
    del second
    gc.collect()
    assert not mask_skip.wrapped() and masking_utils._ignore_causal_mask_sdpa is _rule_of_5_17
    remat.apply(first, "keep")
    remat.apply(first, "full")  # applying again holds once
    remat.remove(first)
    assert masking_utils._ignore_causal_mask_sdpa is _rule_of_5_17


def test_another_wrapper_on_top_stays_and_remats_part_passes_through(rule_5_17):
    model = remat.apply(_tiny(), "keep")
    remats = masking_utils._ignore_causal_mask_sdpa

    def theirs(*args, **kwargs):
        return remats(*args, **kwargs)
    masking_utils._ignore_causal_mask_sdpa = theirs
    remat.remove(model)
    assert masking_utils._ignore_causal_mask_sdpa is theirs
    calls, _ = _compiled_sdpa_calls(_tiny(), input_ids=torch.randint(0, 128, (2, 16)))
    assert calls == [(True, False)] * 2


class _Branch(torch.nn.Module):
    def forward(self, x):
        return x * (2 if mask_skip.compiling_not_exporting() else 3)


def test_compiling_is_told_from_exporting_and_from_eager():
    x = torch.ones(2)
    torch._dynamo.reset()
    assert torch.compile(_Branch(), backend="eager")(x).tolist() == [2, 2]
    torch._dynamo.reset()
    assert torch.export.export(_Branch(), (x,)).module()(x).tolist() == [3, 3]
    assert _Branch()(x).tolist() == [3, 3]


def test_use_cache_off_model_made_positions_are_not_taken_for_packing(rule_5_17):
    """With no cache, transformers looks for packed sequences in the position ids; under compile it
    cannot read them and keeps the mask. Positions the model made itself are never packed."""
    ids = torch.randint(0, 128, (2, 16))
    model = _tiny()
    model.config.use_cache = False
    assert _compiled_sdpa_calls(model, input_ids=ids)[0] == [(True, False)] * 2
    remat.apply(model, "keep")
    calls, output = _compiled_sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(False, True)] * 2
    packed = torch.arange(16).repeat(2, 1)
    packed[:, 8:] -= 8  # two documents a row: the caller's positions keep transformers' packed mask
    calls, output = _compiled_sdpa_calls(model, input_ids=ids, labels=ids, position_ids=packed)
    assert calls and all(has_mask for has_mask, _ in calls)
    torch.testing.assert_close(output.loss, model(input_ids=ids, labels=ids, position_ids=packed).loss)
    remat.remove(model)
    assert mask_skip.patches.patches(model, mask_skip.PATCH_TAG) == []


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache-default", "cache-off"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt_neox", "phi"])
def test_families_compile_with_eagers_loss_and_gradients(family, use_cache, rule_5_17, monkeypatch):
    """Each family as a user builds it (config defaults, ``use_cache`` on as from_pretrained gives it,
    or off as trainers set it; no dropout), applied and compiled: the same loss and gradients as
    eager, and the decoders that build their mask through masking_utils run causal SDPA without
    a mask."""
    import families
    monkeypatch.setattr(families, "DROPOUT", 0.0)  # compiled and eager runs draw other dropout masks
    model, _ = families.CAUSAL[family]()
    model.config.use_cache = use_cache
    remat.apply(model, "full")
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    calls, output = _compiled_sdpa_calls(model, input_ids=ids, labels=ids)
    output.loss.backward()
    torch.testing.assert_close(output.loss, eager, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in expected:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        assert calls and all(call == (False, True) for call in calls), calls


def test_only_the_held_models_forward_skips_the_mask(rule_5_17):
    """While one model holds the wrappers, another model compiled in the same process (same class,
    never applied) gets transformers' own answer: its attention keeps the mask."""
    ids = torch.randint(0, 128, (2, 16))
    held = remat.apply(_tiny(), "keep")
    assert mask_skip.wrapped()
    other = _tiny()
    assert _compiled_sdpa_calls(other, input_ids=ids)[0] == [(True, False)] * 2
    assert _compiled_sdpa_calls(held, input_ids=ids)[0] == [(False, True)] * 2
    assert mask_skip.patches.patches(other, mask_skip.PATCH_TAG) == []
    remat.remove(held)


def test_a_held_models_forward_in_another_thread_leaves_this_threads_compile_alone(rule_5_17):
    """The running flag is per thread: while a held model's eager forward is inside its first block
    in another thread, a model compiled here (never applied) keeps transformers' answer (the mask)."""
    import threading
    ids = torch.randint(0, 128, (2, 16))
    held = remat.apply(_tiny(), "keep")
    inside, done = threading.Event(), threading.Event()

    def pause(module, args, kwargs):
        inside.set()
        done.wait(timeout=300)  # a bound on a test that broke, not a timing: set just below
    handle = held.model.layers[0].register_forward_pre_hook(pause, with_kwargs=True)
    worker = threading.Thread(target=held, kwargs={"input_ids": ids})
    worker.start()
    try:
        assert inside.wait(timeout=300)
        calls, _ = _compiled_sdpa_calls(_tiny(), input_ids=ids)
    finally:
        done.set()
        worker.join()
        handle.remove()
        remat.remove(held)
    assert calls == [(True, False)] * 2


def test_mask_skip_false_wraps_nothing_and_patches_nothing(rule_5_17):
    ids = torch.randint(0, 128, (2, 16))
    model = remat.apply(_tiny(), "keep", mask_skip=False)
    assert not mask_skip.wrapped() and masking_utils._ignore_causal_mask_sdpa is _rule_of_5_17
    assert mask_skip.patches.patches(model, mask_skip.PATCH_TAG) == []
    assert _compiled_sdpa_calls(model, input_ids=ids)[0] == [(True, False)] * 2
    remat.apply(model, "keep")                     # on again, then off again by the next apply
    assert mask_skip.wrapped()
    remat.apply(model, "full", mask_skip=False)
    assert not mask_skip.wrapped() and mask_skip.patches.patches(model, mask_skip.PATCH_TAG) == []


def test_a_function_whose_compiled_answer_is_eagers_is_not_wrapped(monkeypatch):
    """The condition, not a version: a rule that already skips under compile (as eager) needs no
    wrapper; one that refuses under compile (5.17's) does. Where no function needs it, apply
    wraps nothing and patches nothing."""
    def skips_as_eager(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return padding_mask is None and (q_length == 1 or q_length == kv_length)

    assert mask_skip.needed("_ignore_causal_mask_sdpa", _rule_of_5_17)
    assert not mask_skip.needed("_ignore_causal_mask_sdpa", skips_as_eager)
    _release_all()
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", skips_as_eager)
    monkeypatch.setattr(mask_skip, "needed", lambda name, original: name == "_ignore_bidirectional_mask_sdpa")
    model = remat.apply(_tiny(), "keep")
    assert mask_skip.wrapped() == ["_ignore_bidirectional_mask_sdpa"]
    remat.remove(model)
    monkeypatch.setattr(mask_skip, "needed", lambda name, original: False)
    model = remat.apply(_tiny(), "keep")
    assert not mask_skip.wrapped() and mask_skip.patches.patches(model, mask_skip.PATCH_TAG) == []
    assert masking_utils._ignore_causal_mask_sdpa is skips_as_eager


def test_the_installed_versions_wrap_exactly_what_their_compile_path_gets_wrong():
    """Without remat, a compiled unpadded batch: where SDPA already runs causal without a mask,
    remat does not wrap the causal decision."""
    ids = torch.randint(0, 128, (2, 16))
    calls, _ = _compiled_sdpa_calls(_tiny(), input_ids=ids)
    gc.collect()  # models of earlier tests in this worker, released by their finalizers
    before = mask_skip.wrapped()
    model = remat.apply(_tiny(), "keep")
    assert ("_ignore_causal_mask_sdpa" in mask_skip.wrapped()) == (calls != [(False, True)] * 2)
    remat.remove(model)
    assert mask_skip.wrapped() == before


def test_a_deleted_model_is_released_by_its_finalizer(rule_5_17):
    gc.collect()   # models of earlier tests in this worker, released by their finalizers
    before = mask_skip.wrapped()   # a model another test still holds keeps its wraps (CI saw one)
    model = remat.apply(_tiny(), "keep")
    id_model = id(model)
    finalizer = mask_skip._holders[id_model]
    assert finalizer.alive and mask_skip.wrapped()
    del model
    gc.collect()
    assert not finalizer.alive and id_model not in mask_skip._holders and mask_skip.wrapped() == before
    # the rule is put back exactly when no model holds the wraps any more
    assert (masking_utils._ignore_causal_mask_sdpa is _rule_of_5_17) == (not mask_skip._holders)
    assert bool(mask_skip.wrapped()) == bool(mask_skip._holders)
