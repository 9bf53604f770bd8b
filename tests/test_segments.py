"""``segments:K`` / ``segments:sqrt``: K consecutive blocks checkpointed as one unit.

Each model against an untouched copy (same weights, inputs and RNG; fp32, dropout on): loss,
input gradients and every parameter gradient ``torch.equal``, more ops and fewer bytes saved
(:mod:`oracle`). Models are built as users
get them: Hugging Face configs with their defaults (``use_cache`` on), and a root
``nn.Sequential`` of residual blocks with BatchNorm. The mechanism is checked too: what a
segment keeps after its forward, and how often each block runs.
"""
import copy
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import oracle
import remat
from remat.api import treatments
from remat.planning.plans import Plan, resolve
from remat.treat import patches
from versions import TORCH


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1)
    assert config.use_cache
    return LlamaForCausalLM(config).train()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=4, n_head=4, n_positions=64)
    assert config.use_cache and config.resid_pdrop > 0
    return GPT2LMHeadModel(config).train()


class Residual(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.norm(self.linear(x))))


def _sequential(n=5):
    torch.manual_seed(0)
    return nn.Sequential(*(Residual() for _ in range(n))).train()


def _lm_inputs(model):
    torch.manual_seed(123)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    labels = ids.clone()
    labels[0, :3] = -100
    return {"inputs_embeds": embeds, "labels": labels}


def _lm_loss(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # remat's one KV-cache notice
        return model(**inputs).loss


def _square_loss(model, x):
    return model(x).square().mean()


@pytest.mark.parametrize("spec", ["segments:2", "segments:sqrt", "segments:3", "segments:9"])
def test_llama_exact_with_default_cache(spec):
    model = _llama()
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    assert all(t.startswith("segment:") for t in treatments(model).values())
    oracle.check(model, reference, _lm_inputs(model), _lm_loss)


def test_gpt2_exact():
    model = _gpt2()
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:2")
    oracle.check(model, reference, _lm_inputs(model), _lm_loss)


def test_segments_mixed_with_other_treatments_exact():
    model = _llama()
    reference = copy.deepcopy(model)
    names = remat.discover(model).block_names
    remat.apply(model, {names[0]: "segment:0", names[1]: "segment:0", names[2]: "full",
                        names[3]: "selective", names[4]: "segment:1"})
    oracle.check(model, reference, _lm_inputs(model), _lm_loss)


def test_root_sequential_batchnorm_exact_and_stats_updated_once():
    model, x = _sequential(), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:2")
    assert remat.current_plan(model).blocks == {"0": "segment:0", "1": "segment:0", "2": "segment:1",
                                                "3": "segment:1", "4": "segment:2"}
    oracle.check(model, reference, x.requires_grad_(), _square_loss)  # buffers equal too
    for name, buffer in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert buffer.item() == 1, name


def test_only_segment_inputs_are_kept_and_each_block_recomputed_once():
    """After the forward, a block's output that feeds the next block of its segment is gone
    (nothing keeps it); the segment's input stays. The backward runs each block once more."""
    model = _sequential(4)
    remat.apply(model, "segments:2")
    outputs, calls = {}, {name: 0 for name in ("0", "1", "2", "3")}
    for name, block in model.named_children():
        block.linear.register_forward_hook(lambda m, a, out, name=name: calls.__setitem__(name, calls[name] + 1))
        block.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, weakref.ref(out)))
    loss = model(torch.randn(6, 8, requires_grad=True)).square().mean()
    alive = {name: ref() is not None for name, ref in outputs.items()}
    assert alive == {"0": False, "1": True, "2": False, "3": True}  # "1" is segment 1's input; "3" the output
    assert calls == {"0": 1, "1": 1, "2": 1, "3": 1}
    loss.backward()
    assert calls == {"0": 2, "1": 2, "2": 2, "3": 2}


def test_llama_keeps_only_segment_inputs():
    """The same on Llama, whose layers take the rotary tables and mask as keywords: those are
    kept (shared by all layers), the hidden state inside a segment is not (transformers 4.x's
    layers return it first in a tuple, 5.x's alone)."""
    model = _llama()
    remat.apply(model, "segments:2")
    outputs = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(
            i, weakref.ref(out[0] if isinstance(out, tuple) else out)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**_lm_inputs(model)).loss
    # 1 and 3 are the inputs of segments 1 and 2; 4 is the model's, kept by the final norm
    assert {i: ref() is not None for i, ref in outputs.items()} == {0: False, 1: True, 2: False, 3: True, 4: True}
    loss.backward()


def test_no_grad_and_eval_pass_through():
    model = _llama()
    reference = copy.deepcopy(model).eval()
    remat.apply(model, "segments:2").eval()
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False),
                           reference.generate(ids, max_new_tokens=3, do_sample=False))


def test_remove_restores_everything():
    model = _llama()
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:sqrt")
    remat.remove(model)
    assert remat.current_plan(model) is None
    assert set(treatments(model).values()) == {"keep"}
    assert patches.patches(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    oracle.check_untouched(oracle.compare(model, reference, _lm_inputs(model), _lm_loss).assert_equal())


def test_plan_json_round_trip_and_reapply(tmp_path):
    model = _llama()
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:2")
    plan = remat.current_plan(model)
    assert plan.summary() == "5x segment (in 3 segments); head plain"
    plan.save(tmp_path / "plan.json")
    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    other = copy.deepcopy(reference)
    remat.apply(other, loaded)
    assert treatments(other) == treatments(model)
    oracle.check(other, reference, _lm_inputs(other), _lm_loss)


def test_compiled_model_runs_segments_eagerly_and_exact():
    model, x = _sequential(4), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:2")
    model.compile(backend="aot_eager")
    oracle.compare(model, reference, x.requires_grad_(), _square_loss, meter=False).assert_equal()


def test_compiled_segments_update_batchnorm_statistics_once():
    """Compiled, a segment still runs (and recomputes) eagerly: its BatchNorm statistics move once a step."""
    model, x = _sequential(4), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    remat.apply(model, "segments:2")
    model.compile(backend="aot_eager")
    oracle.compare(model, reference, x, _square_loss, meter=False).assert_equal()


def test_treated_model_deepcopies():
    model, x = _sequential(), torch.randn(6, 8)
    remat.apply(model, "segments:3")
    reference = copy.deepcopy(model)
    remat.remove(reference)
    twin = copy.deepcopy(model)
    assert treatments(twin) == treatments(model)
    oracle.check(twin, reference, x.requires_grad_(), _square_loss)


def test_segments_stay_within_each_block_list():
    names = [f"encoder.block.{i}" for i in range(4)] + [f"decoder.block.{i}" for i in range(4)]
    plan = resolve("segments:3", names)
    assert [plan.blocks[n] for n in names] == ["segment:0"] * 3 + ["segment:1"] + ["segment:2"] * 3 + ["segment:3"]
    assert set(resolve("segments:100", names).blocks.values()) == {"segment:0", "segment:1"}
    sqrt = resolve("segments:sqrt", [f"layers.{i}" for i in range(16)])
    assert [sqrt.blocks[f"layers.{i}"] for i in range(16)] == [f"segment:{i // 4}" for i in range(16)]
    one = resolve("segments:1", ["0", "1"])
    assert dict(one.blocks) == {"0": "segment:0", "1": "segment:1"}


@pytest.mark.parametrize("spec, message", [
    ("segments:0", "K must be a whole number >= 1 or 'sqrt', got '0'"),
    ("segments:abc", "K must be a whole number >= 1 or 'sqrt', got 'abc'"),
    ("segments:", "K must be a whole number >= 1 or 'sqrt', got ''"),
    ("segments:-2", "K must be a whole number >= 1 or 'sqrt', got '-2'"),
    ("segments:2:full", "takes no treatment"),
    ("segment:2", "neither a treatment nor 'every'/'first'/'segments'"),
])
def test_bad_specs_name_what_is_accepted(spec, message):
    model = _sequential(3)
    with pytest.raises(ValueError, match=message) as info:
        remat.apply(model, spec)
    assert "segments:sqrt" in str(info.value)
    assert patches.patches(model) == []


def test_bad_segment_plans_are_refused():
    with pytest.raises(ValueError, match="'segment:<i>'"):
        Plan({"0": "segment:x"})
    with pytest.raises(ValueError, match="'segment:<i>'"):
        Plan.from_dict({"version": 1, "blocks": {"0": "segment:-1"}})
    model = _sequential(3)
    with pytest.raises(ValueError, match=r"segment 0 must be consecutive blocks .* \['0', '2'\]"):
        remat.apply(model, {"0": "segment:0", "1": "full", "2": "segment:0"})
    assert patches.patches(model) == []


@pytest.mark.skipif(TORCH < (2, 7), reason="FSDP2 on the CPU needs torch >= 2.7 (torch 2.6's FSDP2 calls "
                                           "Stream.record_event, which its CPU stream lacks)")
def test_segments_refused_where_each_block_is_its_own_fsdp2_unit(tmp_path):
    """A segment's backward recomputes its earlier blocks after FSDP2 resharded them: a block
    sharded on its own in a segment is refused with the fix, not run on sharded parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        remat.apply(model, "segments:2", blocks=lambda name, module: name.count(".") == 0 and name != "")
        for block in model:
            fully_shard(block)
        fully_shard(model)
        with pytest.raises(ValueError, match="fully_shard on groups"):
            model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    finally:
        dist.destroy_process_group()
