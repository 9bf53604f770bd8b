"""A treated block sees what the untouched block sees, in its forward and in every recompute (issue 44).

Built from the issue's repros: PI0 reads its vision-language model's KV cache inside the training
forward (its action expert attends to the prefix), xLSTM writes each block's new recurrent state in
place into the tensors it handed the block; and from what such models do in general (a prefix cache
handed in by the caller, a dict one block fills and another reads, state written in place with the
recompute's op sequence unchanged, where torch's own checks see nothing). Every treatment checked
here is compared with an untouched copy over two SGD steps (``registry_cells.run_cell``: bitwise,
and the treatment recomputed something), or refused, before the model is touched where that is
known then, or in the first step with remat taken off the model, which then trains bitwise as the
untouched copy. Each fails on the code before issue 44 (wrong gradients, a CheckpointError, a
refusal that left remat on, or a refusal only in the step).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import registry_cells as cells
import registry_zoo as rz
import remat
import zoo
from remat.treat import patches


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _exact(model_type, spec, head="plain"):
    """The cell of ``spec`` on a registry model: bitwise with the plain head, within fp32 rounding with
    the chunked one (and, either way, the treatment recomputed or moved something)."""
    cell = cells.run_cell(rz.case(model_type), spec, head)
    assert cell.verdict in (("exact",) if head == "plain" else ("exact", "rounding")), cell


# ----------------------------------------------------------------------------- a model that reads its cache

@pytest.mark.parametrize("spec", ["full", "selective", "attn-saved", "full+offload", "segments:2", "attention"])
def test_pi0_action_expert_attends_to_the_prefix_cache_as_untouched(spec):
    """PI0 asks its VLM for a cache (``use_cache=True`` inside its forward) and hands it to its action
    expert: the treated VLM layers write their keys and values back into it, so the loss and every
    gradient (the vision tower's included: it reaches the loss only through that cache) are bitwise."""
    _exact("pi0", spec)


def test_pi0_is_a_model_that_reads_its_cache():
    from remat.treat import block_state
    model = zoo.build(rz.case("pi0"))
    assert block_state.cache_reader(model) == "PI0Model.forward calls self.vlm(..., use_cache=True)"
    assert block_state.cache_reader(zoo.build(rz.case("llama"))) is None


def test_a_withheld_cache_layer_read_later_is_refused_and_remat_taken_off(monkeypatch):
    """Were PI0 not known to read its cache, the treated VLM layers would keep their keys and values in
    copies of their own (as for any model in a training forward) and the action expert would attend to
    empty layers: its update of such a layer raises, from inside the first step, and remat is taken off
    the model, which then trains bitwise as an untouched copy."""
    monkeypatch.setattr(remat.api, "cache_reader", lambda model: None)
    case = rz.case("pi0")
    model = zoo.build(case)
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    with pytest.raises(ValueError, match="its KV cache .* filled in a copy of its own") as refused:
        model(**case.batch(model))
    assert "remat.apply has been undone" in str(refused.value)
    assert patches.patches(model) == []
    torch.manual_seed(0)
    reference(**case.batch(reference))  # the untouched twin of the forward that stopped
    assert zoo.compare(case, treated=model, reference=reference).first_difference is None


@pytest.mark.parametrize("spec", ["attention", "full"])
def test_inkling2_layers_share_conv_states_between_attention_and_the_rest_of_the_block(spec):
    """Inkling2's cache layer keeps one convolution state per sub-module (``conv_states``, a dict by
    convolution): a treated attention fills its own in its copy, and the block's other convolutions
    then read and fill theirs in the caller's layer, which only the attention's entries refuse."""
    pytest.importorskip("transformers.models.inkling2", reason="Inkling2 needs a newer transformers")
    _exact("inkling2_text", spec)


def test_a_layer_withheld_in_part_refuses_only_the_entries_the_block_changed():
    from remat.treat import cache_views
    from remat.treat.refusals import StepRefusal

    class Layer:
        def __init__(self):
            self.states = {0: None, 1: None}
            self.rows = [None, None]

    caller, changed = Layer(), Layer()
    changed.states = {0: torch.ones(2), 1: None}
    changed.rows = [None, torch.ones(2)]
    withheld = cache_views._changed_contents(changed, caller)
    assert withheld == {"states": frozenset({0}), "rows": None}    # a dict by key, anything else whole
    cache_views._withhold(caller, "the treated attention", withheld)
    try:
        assert caller.states[1] is None                                # the others' entries read
        caller.states[2] = torch.zeros(1)                              # and are written
        for read in (lambda: caller.states[0], lambda: 0 in caller.states, lambda: caller.rows,
                     lambda: list(caller.states.values())):
            with pytest.raises(StepRefusal, match=r"filled in a copy of its own"):
                read()
    finally:
        cache_views.release_withheld()
    assert type(caller) is Layer and type(caller.states) is dict and type(caller.rows) is list
    assert caller.states[0] is None and torch.equal(caller.states[2], torch.zeros(1))


def test_a_cache_layers_counter_a_treated_block_adds_to_counts_once_and_its_recompute_sees_it_as_read():
    """transformers 5.25's linear-attention layers count tokens into a 0-dim tensor made with the layer
    (``cumulative_length_linear.add_``). A treated block counts into a copy of its own: the caller's
    counter (the same tensor object) then holds the count, as the untouched block's would, and the
    recompute starts from the count as the forward read it and counts into its own copy, so the
    caller's is not counted twice. A larger tensor written in place (a static cache) is still refused."""
    from remat.treat.cache_views import CacheView
    from remat.treat.refusals import StepRefusal

    class Layer:
        def __init__(self):
            self.count = torch.tensor(3)
            self.states = {0: None}

    class Cache:
        def __init__(self):
            self.layers = [Layer()]

    cache = Cache()
    counter = cache.layers[0].count
    view = CacheView(cache, "the treated block")
    forward = view.forward_cache()
    forward.layers[0].count.add_(5)
    forward.layers[0].states[0] = torch.ones(2)
    view.after_forward(write_back=False)
    assert cache.layers[0].__dict__["count"] is counter and int(counter) == 8
    recompute = view.recompute_cache()
    assert int(recompute.layers[0].count) == 3 and recompute.layers[0].count is not counter
    recompute.layers[0].count.add_(5)
    assert int(counter) == 8
    from remat.treat import cache_views
    cache_views.release_withheld()

    static = Cache()
    static.layers[0].states[0] = torch.zeros(2)
    view = CacheView(static, "the treated block")
    view.forward_cache().layers[0].states[0].add_(1)
    with pytest.raises(StepRefusal, match="wrote in place"):
        view.after_forward(write_back=False)


def test_a_prefix_cache_the_caller_hands_in_is_read_as_untouched():
    """Prefix tuning: the caller's cache already holds keys and values when a training forward starts.
    A treated block attends over them as the untouched one does (its view holds the caller's layer),
    and its recompute sees the same prefix; the caller's cache is not appended to by a recompute."""
    from transformers import DynamicCache
    model = zoo.build(rz.case("llama"))
    reference = copy.deepcopy(model)
    remat.apply(model, "full")
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(3))

    def prefix(m):
        torch.manual_seed(1)  # the prefix's own dropout masks, the same for both
        with torch.no_grad():
            return m(input_ids=ids[:, :3], use_cache=True).past_key_values

    grads = []
    for m in (model, reference):
        cache = prefix(m)
        assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 3
        torch.manual_seed(0)
        loss = m(input_ids=ids[:, 3:], labels=ids[:, 3:], past_key_values=cache, use_cache=True).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
        assert cache.get_seq_length() <= 6  # never appended to twice
    assert torch.equal(grads[0][0], grads[1][0])
    for name, grad in grads[1][1].items():
        assert torch.equal(grads[0][1][name], grad), name


# ----------------------------------------------------------------------------- state written in place after a block

@pytest.mark.parametrize("spec", ["full", "selective", "segments:2", "full+offload"])
def test_xlstm_with_its_default_cache_is_exact(spec):
    """xLSTM (``use_cache=True`` by default) copies each block's new recurrent state into the tensors it
    handed the block, after the block returned: the recompute gets the state as the forward saw it."""
    _exact("xlstm", spec)


class _StateBlock(nn.Module):
    """Reads a state tensor handed to it in a tuple; its recompute runs the same ops whatever the state holds."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, state):
        h = self.drop(torch.tanh(self.proj(x) + state[0] + 0.5 * state[1]))  # no op saves the state
        return h, (h.detach().mean(0, keepdim=True), state[1] + 1)


class _WritesStateAfterEachBlock(nn.Module):
    """A recurrent model in xLSTM's manner: it writes each block's new state into the state tensors it
    handed the block, in place, once the block has returned."""

    def __init__(self, grad_state=False):
        super().__init__()
        self.blocks = nn.ModuleList([_StateBlock() for _ in range(3)])
        self.grad_state = grad_state

    def forward(self, x):
        state = (torch.ones(1, 8, requires_grad=self.grad_state) * 1, torch.zeros(1, 8))
        for block in self.blocks:
            x, new = block(x, state)
            with torch.no_grad():
                state[0].copy_(new[0])
                state[1].copy_(new[1])
        return x.square().mean()


@pytest.mark.parametrize("spec", ["full", "selective", "segments:3"])
def test_state_written_in_place_after_the_block_recomputes_from_the_forwards_values(spec):
    """The same op sequence in the recompute, so torch's checks see nothing: before issue 44 the
    gradients were silently wrong. Each step copies the state once the first has shown it is written."""
    torch.manual_seed(0)
    model = _WritesStateAfterEachBlock()
    reference = copy.deepcopy(model)
    remat.apply(model, spec, blocks="blocks")
    x = torch.randn(4, 8)
    for step in range(2):
        losses = []
        for m in (model, reference):
            torch.manual_seed(step)
            loss = m(x)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
    ledgers = [p.state.inputs for p in patches.patches(model, tag="treatment") if p.attribute == "forward"]
    assert ledgers and all(("arg", 1, 0) in ledger.mutated for ledger in ledgers), ledgers


def test_state_that_requires_grad_written_after_the_block_is_refused_in_backward():
    torch.manual_seed(0)
    model = _WritesStateAfterEachBlock(grad_state=True)
    remat.apply(model, "full", blocks="blocks")
    loss = model(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"argument 1\[0\].*wrote in place after the block returned"):
        loss.backward()


class _SharesThroughADict(nn.Module):
    """Gemma-3n's shared key/value states in small: the first block stores a tensor in a dict it is
    handed, the others read it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        for i, block in enumerate(self.blocks):
            block.forward = _shared_forward.__get__(block)
            block.index = i

    def forward(self, x):
        shared = {}
        for block in self.blocks:
            x = block(x, shared)
        shared.clear()  # done with it once the blocks ran: a recompute must not need it
        return x.square().mean()


def _shared_forward(self, x, shared):
    h = torch.nn.functional.linear(x, self.weight, self.bias)
    if self.index == 0:
        shared["kv"] = h * 2
        return torch.relu(h)
    return torch.relu(h + shared["kv"])


@pytest.mark.parametrize("spec", ["full", "segments:3"])
def test_a_dict_one_block_fills_and_later_blocks_read(spec):
    torch.manual_seed(0)
    model = _SharesThroughADict()
    reference = copy.deepcopy(model)
    remat.apply(model, spec, blocks="blocks")
    x = torch.randn(4, 8)
    losses = [m(x) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0].detach(), losses[1].detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ----------------------------------------------------------------------------- refusals before the model is touched

def test_mobilebert_masked_lm_head_refused_at_apply():
    """MobileBERT's masked-LM head multiplies by its decoder's weight and never calls the decoder:
    refused by ``apply`` (before: in the first step, remat left on the model)."""
    cell = cells.run_cell(rz.case("mobilebert"), "full", "chunked")
    assert cell.verdict == "refused" and "not called as a module" in cell.detail, cell


def test_minicpm3_chunked_head_follows_its_forward():
    """MiniCPM3 divides its hidden states by ``logits_scaling`` before its lm_head; remat took the field
    for Granite's divisor of the logits and refused the model in its first step. Read from the forward,
    the chunked head is within fp32 rounding."""
    _exact("minicpm3", "full", "chunked")


def test_paligemma2_chunked_head_with_a_gemma2_text_config():
    """PaliGemma-2 (PaliGemma with a Gemma-2 text config, as transformers' tester builds it): the
    soft-cap its forward reads from the text config is the chunked head's."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration
    text = {"model_type": "gemma2", "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 37,
            "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 1}
    vision = {"image_size": 20, "patch_size": 5, "hidden_size": 32, "projection_dim": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 37, "dropout": 0.1, "attention_dropout": 0.1}
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=0, projection_dim=32)

    def build():
        torch.manual_seed(0)
        return PaliGemmaForConditionalGeneration(config).train()

    def batch(model):
        ids = torch.randint(1, 99, (3, 25), generator=torch.Generator().manual_seed(1))
        ids[:, :16] = 0
        return {"input_ids": ids, "attention_mask": ids.ne(1), "labels": ids, "token_type_ids": torch.zeros_like(ids),
                "pixel_values": torch.randn(3, 3, 20, 20, generator=torch.Generator().manual_seed(2))}
    cell = cells.run_cell(zoo.Case("paligemma2", build, batch, zoo._hf_loss), "full", "chunked")
    assert cell.verdict == "rounding", cell


def test_deepseek_v4_tiled_refused_at_apply_without_hash_layers():
    """Without hash-routed layers DeepSeek-V4's MoE runs on the hidden states alone, but its decoder
    layer always hands it ``input_ids`` too: refused by ``apply``, read from the layer's forward."""
    import transformers
    entry = rz.registry()["deepseek_v4"]
    config = rz.config_for(entry)
    config.mlp_layer_types = ["moe"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM._from_config(config)
    with pytest.raises(ValueError, match=r"called with more than the hidden states .*input_ids=input_ids"):
        remat.apply(model, "tiled")
    assert patches.patches(model) == []


def test_selective_refused_in_the_first_step_takes_remat_off():
    """Falcon writes in place into an attention output selective keeps: only its forward shows that, so
    the refusal comes in the first step; remat is then off the model, which trains bitwise as before."""
    case = rz.case("falcon")
    cell = cells.run_cell(case, "selective", "plain")
    assert cell.verdict == "refused late", cell
    model = zoo.build(case)
    reference = copy.deepcopy(model)
    remat.apply(model, "selective")
    with pytest.raises(ValueError, match="modifies in place.*remat.apply has been undone"):
        model(**case.batch(model))
    assert patches.patches(model) == []
    torch.manual_seed(0)
    reference(**case.batch(reference))
    assert zoo.compare(case, treated=model, reference=reference).first_difference is None
