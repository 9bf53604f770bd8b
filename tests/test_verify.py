"""remat.verify: the untouched and the treated model on the user's batch, every difference judged.

Checked on zoo models as users build them (config defaults: use_cache on, dropout on), fp32 on the
CPU: block treatments bitwise; tiled and the chunked head within rounding, decided by the float64
re-run (the issue's false alarms: BERT's key biases, whose true gradient is zero); planted bugs (a
recompute that draws other dropout masks, a block given a stale cache, a recompute torch's checkpoint
refuses) wrong, the float64 re-run not shrinking them; the weaker scale test without float64; a model
that cannot run twice alike named; the model left exactly as it was. The whole model x treatment
matrix is ``slow``.
"""
import warnings

import pytest
import torch
import torch.nn as nn

import remat
import zoo
from remat.diagnosis.verification import Verification
from remat.treat import treatments as treatments_module
from remat.treat.treatments import treatment_of

TILE = 5
CHUNK = 5


def _case(name):
    model = zoo.build(name)
    return model, zoo.CASES[name].batch(model)


def _verify(model, batch, spec, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the KV-cache note, transformers' fallbacks
        return remat.verify(model, batch, spec, **options)


@pytest.fixture
def dropout_bug(monkeypatch):
    """The recompute of every checkpoint draws its own dropout masks (preserve_rng_state=False)."""
    original = treatments_module.checkpoint

    def without_rng(function, *args, **kwargs):
        kwargs["preserve_rng_state"] = False
        return original(function, *args, **kwargs)
    monkeypatch.setattr(treatments_module, "checkpoint", without_rng)


@pytest.fixture
def stale_cache(monkeypatch):
    """Each treated block is given a cache that already holds three tokens of keys and values (planted
    where remat hands a treated block its state: ``block_state.guarded``)."""
    from transformers import Cache, DynamicCache
    original = treatments_module.block_state.guarded

    def stale():
        cache = DynamicCache()
        generator = torch.Generator().manual_seed(0)
        for layer in range(2):
            keys = torch.randn(zoo.BATCH, 2, 3, 8, generator=generator)
            cache.update(keys, keys.clone(), layer)
        return cache

    def guarded(forward, args, kwargs, *rest, **options):
        def with_stale_cache(*call_args, **call_kwargs):   # the block's own forward, handed a stale cache
            call_kwargs = {k: stale() if v is not None and ("past_key" in k or isinstance(v, Cache)) else v
                           for k, v in call_kwargs.items()}
            return forward(*call_args, **call_kwargs)
        return original(with_stale_cache, args, kwargs, *rest, **options)
    monkeypatch.setattr(treatments_module.block_state, "guarded", guarded)


def test_full_is_bitwise_and_the_model_is_left_exactly_as_it_was():
    model, batch = _case("llama")
    remat.apply(model, "selective")
    plan = remat.current_plan(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model.eval()
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    result = _verify(model, batch, "full")
    assert result.verdict == "bitwise", result
    assert result.float64.startswith("not needed")
    assert {c.kind for c in result.tensors} == {"loss", "parameter", "buffer"}
    assert [p for p, _, _ in params] == list(model.parameters())
    assert all(torch.equal(p, value) and p.grad is grad for p, value, grad in params)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    assert remat.current_plan(model) is plan
    assert {treatment_of(b) for b in model.model.layers} == {"selective"}


def test_the_applied_plan_is_verified_when_no_spec_is_given():
    model, batch = _case("llama")
    remat.apply(model, "full+offload", offload_options=zoo.INLINE_OFFLOAD)
    result = _verify(model, batch, None)
    assert result.verdict == "bitwise" and "applied plan" in result.treatment
    assert {treatment_of(b) for b in model.model.layers} == {"full+offload"}
    remat.apply(model, "full+tiled", tile_tokens=TILE)
    result = _verify(model, batch, None)       # its float64 re-run: a deep copy of the treated model
    assert result.verdict == "within rounding" and result.float64 == "ran", result
    assert {treatment_of(b) for b in model.model.layers} == {"full+tiled"}


def test_a_deep_copied_tiled_model_comes_off_and_back_cleanly():
    """verify's float64 copy is a deep copy of the treated model; a copied ``bound=True`` patch (the tiled
    sub-modules') holds another bound method than its module's ``__dict__``, which remove took for someone
    else's wrapper and left behind (put back, it called itself)."""
    import copy

    from remat.treat import patches
    model, batch = _case("llama")
    remat.apply(model, "tiled", tile_tokens=TILE)
    twin = copy.deepcopy(model)
    remat.remove(twin)
    assert all("forward" not in m.__dict__ for m in twin.modules())
    with patches.suspended(remat.apply(twin, "tiled", tile_tokens=TILE)):
        twin(**batch).loss.backward()
    twin(**batch).loss.backward()


def test_a_spec_on_a_model_with_hugging_face_checkpointing_on_runs_without_it():
    model, batch = _case("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert _verify(model, batch, "selective").verdict == "bitwise"   # not checkpointed twice
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


@pytest.mark.parametrize("name, spec, options", [
    ("bert", "tiled", dict(tile_tokens=TILE)),
    ("vit", "tiled", dict(tile_tokens=TILE)),
    ("bert", "full", dict(head="chunked", chunk_tokens=CHUNK)),
])
def test_the_issues_false_alarms_are_within_rounding_by_float64(name, spec, options):
    model, batch = _case(name)
    result = _verify(model, batch, spec, **options)
    assert result.verdict == "within rounding", result
    assert result.float64 == "ran"
    differing = [c for c in result.tensors if c.verdict != "bitwise"]
    assert differing and all(c.float64_difference < 1e-3 * c.difference for c in differing)
    assert max(c.difference for c in differing) < 1e-5
    assert "float64" in result.why and "rounding" in result.why


def test_a_zero_true_gradient_is_measured_against_the_models_gradient_scale():
    """BERT's key biases get no true gradient (softmax ignores a bias shared by every key): their own
    relative difference under the chunked head is about 1, against the gradient scale it is rounding."""
    model, batch = _case("bert")
    result = _verify(model, batch, "full", head="chunked", chunk_tokens=CHUNK, float64=False)
    assert result.verdict == "within rounding", result
    keys = [c for c in result.tensors if c.name.endswith("attention.self.key.bias")]
    assert keys and all(c.verdict != "wrong" and c.difference < 1e-5 for c in keys)
    assert "sqrt(eps)" in result.why


def test_a_recompute_with_other_dropout_masks_is_wrong(dropout_bug):
    model, batch = _case("llama")
    result = _verify(model, batch, "full")
    assert result.verdict == "wrong", result
    assert "in float64 still" in result.why
    worst = [c for c in result.tensors if c.verdict == "wrong"]
    assert worst and all(c.float64_difference > 1e-2 for c in worst)


def test_the_wrong_gradients_are_traced_to_their_block(dropout_bug):
    model, batch = _case("llama")
    result = _verify(model, batch, {"model.layers.0": "full"})
    assert result.verdict == "wrong"
    assert "start at block model.layers.0" in result.why
    right = [c for c in result.tensors if ".layers.1." in c.name]
    assert right and all(c.verdict == "bitwise" for c in right)


def test_without_float64_the_dropout_bug_is_still_wrong(dropout_bug):
    model, batch = _case("bert")
    result = _verify(model, batch, "full", float64=False)
    assert result.verdict == "wrong", result
    assert result.float64.startswith("not asked")


def test_a_block_given_a_stale_cache_is_wrong(stale_cache):
    model, batch = _case("llama")
    assert model.config.use_cache   # the zoo keeps the config's default: a cache reaches every block
    result = _verify(model, batch, "full")
    assert result.verdict == "wrong", result
    assert next(c for c in result.tensors if c.name == "loss").verdict == "wrong"


def test_a_recompute_the_checkpoint_refuses_is_wrong(monkeypatch):
    """The caller's cache carried into the recompute (what remat once did): T5's recompute saves other
    tensors and torch's checkpoint refuses it; verify says wrong, with the error, instead of raising."""
    monkeypatch.setattr(treatments_module.block_state, "guarded", lambda forward, args, kwargs, *a, **k: (forward, args, kwargs))
    model, batch = _case("t5")
    result = _verify(model, batch, "full")
    assert result.verdict == "wrong"
    assert "CheckpointError" in result.why and "untouched one runs" in result.why


def test_hugging_face_checkpointing_is_verified_as_it_is():
    model, batch = _case("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    result = _verify(model, batch, None)
    assert result.verdict == "bitwise" and result.treatment == "Hugging Face checkpointing (every layer)"
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                           "preserve_rng_state": False})
    assert _verify(model, batch, None).verdict == "wrong"


def test_a_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    model, batch = _case("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                         target_modules=["q_proj", "v_proj", "up_proj"]))
    result = _verify(wrapped, batch, "full")
    assert result.verdict == "bitwise"
    assert {c.name.split(".")[-2] for c in result.tensors if c.kind == "parameter"} == {"default"}  # LoRA only
    assert _verify(wrapped, batch, "full+tiled", tile_tokens=TILE).verdict == "within rounding"


class _Counting(nn.Module):
    """A block whose forward changes a plain attribute, and so its own result, at every call."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.linear(x)) * (1 + 0.01 * self.calls)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Counting(), _Counting()])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x).square().mean()


def test_a_model_that_cannot_run_twice_alike_is_named_and_compared_as_far_as_it_can_be():
    torch.manual_seed(0)
    model = _Stack()
    result = _verify(model, torch.randn(3, 4, 8), "full")
    assert not result.deterministic
    assert any("blocks.0.calls" in p for p in result.problems), result.problems
    assert all(c.reference_spread > 0 for c in result.tensors if c.verdict != "bitwise")
    assert result.verdict in ("within rounding", "wrong")
    assert model.blocks[0].calls > 0   # what it changed stays changed: verify cannot undo it, and says so


def test_bad_input_is_refused_in_one_line():
    model, batch = _case("llama")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        remat.verify("llama", batch, "full")
    with pytest.raises(ValueError, match="nothing to verify"):
        remat.verify(model, batch)
    with pytest.raises(TypeError, match="scalar loss"):
        remat.verify(model, batch, "full", loss_fn=lambda m, b: m(**b).logits)
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        remat.verify(meta, torch.zeros(1, 2), "full")


def test_the_report_reads_as_a_table():
    model, batch = _case("bert")
    result = _verify(model, batch, "tiled", tile_tokens=TILE)
    text = str(result)
    assert isinstance(result, Verification) and result.ok
    assert text.splitlines()[0].endswith("WITHIN ROUNDING")
    assert "parameter gradients" in text and "float64 re-run: ran" in text
    assert "bert.encoder.layer.0.intermediate.dense.weight" in text


MATRIX = ("llama", "bert", "vit", "t5", "jamba")
TREATMENTS = (("full", {}), ("selective", {}), ("attention", {}), ("mlp", {}), ("attn-saved", {}),
              ("offload", dict(offload_options=zoo.INLINE_OFFLOAD)),
              ("full+offload", dict(offload_options=zoo.INLINE_OFFLOAD)),
              ("tiled", dict(tile_tokens=TILE)), ("full+tiled", dict(tile_tokens=TILE)),
              ("full", dict(head="chunked", chunk_tokens=CHUNK)))


@pytest.mark.slow   # 5 models x 10 treatments, 0.5-3 s each on two cores
@pytest.mark.parametrize("spec, options", TREATMENTS, ids=[s + ("+chunked" if o.get("head") else "")
                                                          for s, o in TREATMENTS])
@pytest.mark.parametrize("name", MATRIX)
def test_every_treatment_gets_the_right_verdict(name, spec, options):
    if name == "vit" and options.get("head"):
        pytest.skip("ViT has no LM head to chunk")
    model, batch = _case(name)
    result = _verify(model, batch, spec, **options)
    exact = "tiled" not in spec and not options.get("head")
    assert result.verdict == ("bitwise" if exact else "within rounding"), result


@pytest.mark.slow   # a PEFT wrapper x 10 treatments
@pytest.mark.parametrize("spec, options", TREATMENTS, ids=[s + ("+chunked" if o.get("head") else "")
                                                          for s, o in TREATMENTS])
def test_every_treatment_on_a_peft_wrapper(spec, options):
    peft = pytest.importorskip("peft")
    model, batch = _case("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                         target_modules=["q_proj", "v_proj", "up_proj"]))
    result = _verify(wrapped, batch, spec, **options)
    exact = "tiled" not in spec and not options.get("head")
    assert result.verdict == ("bitwise" if exact else "within rounding"), result


@pytest.mark.slow   # the planted bugs on each model family
@pytest.mark.parametrize("name", MATRIX)
def test_the_dropout_bug_is_wrong_on_every_family(name, dropout_bug):
    model, batch = _case(name)
    assert _verify(model, batch, "full").verdict == "wrong"

