"""The chunked LM head against the model's own loss path (an untouched copy of the model).

Gradient errors are norm-wise relative (||ours - ref|| / ||ref||). Key-projection biases
are compared against the whole gradient's norm instead: their exact gradient is zero
(softmax is invariant to a bias on every key), so what both paths produce there is
rounding noise and a relative error of it means nothing.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.presets import build_model, load_config
from remat.prove.memtrack import PeakTracker
from remat.head.chunked_loss import chunked_cross_entropy, default_chunk_tokens
from remat.head import disable_chunked_head, enable_chunked_head

FP32_TOL = 1e-6
BF16_FACTOR = 1.5  # ours vs fp64 may be at most this times the plain path's error vs fp64


def _config(model_type, **kwargs):
    from transformers import AutoConfig
    base = dict(vocab_size=211, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base.update(kwargs)
    config = AutoConfig.for_model(model_type, **base)
    config.use_cache = False
    return config


def _build(model_type, masked=False, **kwargs):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    return auto.from_config(_config(model_type, **kwargs), attn_implementation="eager").train()


FAMILIES = {
    "gemma2_softcap": lambda: _build("gemma2", head_dim=8, final_logit_softcapping=2.0),
    "cohere_logit_scale": lambda: _build("cohere", logit_scale=0.25),
    "granite_logits_scaling": lambda: _build("granite", logits_scaling=4.0),
    "phi_head_bias": lambda: _build("phi"),
    "gpt2": lambda: _build("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": lambda: _build("gpt_neox"),
    "opt": lambda: _build("opt", ffn_dim=48, word_embed_proj_dim=32),
    "mixtral_aux_loss": lambda: _build("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                       output_router_logits=True, router_aux_loss_coef=0.1),
    "bert_masked": lambda: _build("bert", masked=True),
    "modernbert_masked": lambda: _build("modernbert", masked=True, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, cls_token_id=1, sep_token_id=2),
}


def _labels(ids, masked=False):
    labels = ids.clone()
    labels[0, :5] = -100
    labels[-1, -4:] = -100
    if masked:
        labels[:, 1::3] = -100
    return labels


def _step(model, ids, labels, seed=1, autocast=False, **kwargs):
    """One training forward/backward; returns (loss, {name: grad}) with the input-embedding
    gradient under 'inputs_embeds'. The seed makes dropout masks equal between copies."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(inputs_embeds=embeds, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = embeds.grad.double()
    return out.loss.detach().double(), grads, out


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _assert_close(ours, ref, tol=FP32_TOL):
    loss, grads, _ = ours
    ref_loss, ref_grads, _ = ref
    assert _rel(loss, ref_loss) < tol
    assert grads.keys() == ref_grads.keys()
    total = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    for name, ref_grad in ref_grads.items():
        err = (grads[name] - ref_grad).norm()
        if "k_proj.bias" in name or "key.bias" in name:
            assert err < tol * total, name
        else:
            assert err < tol * ref_grad.norm(), (name, (err / ref_grad.norm()).item())


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen-tiny"])  # untied / tied head
@pytest.mark.parametrize("chunk", [37, None])                       # uneven chunks / one chunk
def test_fp32_loss_and_every_gradient_match_the_model(preset, chunk):
    model = build_model(load_config(preset), dtype=torch.float32)
    reference = copy.deepcopy(model)
    enable_chunked_head(model, chunk_tokens=chunk)
    ids = torch.randint(0, model.config.vocab_size, (3, 45))  # 135 tokens: odd
    ours = _step(model, ids, _labels(ids))
    _assert_close(ours, _step(reference, ids, _labels(ids)))
    assert ours[2].logits is None
    if preset == "qwen-tiny":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("chunk", [7, None])
def test_float64_logits_keep_float64_sums(chunk):
    """float64 logits: the loss and every gradient in float64, as ``F.cross_entropy`` takes them (an
    fp32 sum, or the GPU's fp32 kernel, would differ by about 1e-8: the gap remat.verify's float64
    re-run must not see)."""
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (50,))
    y[::5] = -100
    ours = chunked_cross_entropy(h, w, b, y, chunk_tokens=chunk)
    ours_grads = torch.autograd.grad(ours, (h, w, b))
    ref = F.cross_entropy(F.linear(h, w, b), y)
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    assert ours.dtype == torch.float64
    assert _rel(ours, ref) < 1e-13
    for got, want in zip(ours_grads, ref_grads):
        assert got.dtype == torch.float64 and _rel(got, want) < 1e-13


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_families_softcap_scaling_bias_aux_masked(family):
    model = FAMILIES[family]()
    reference = copy.deepcopy(model)
    enable_chunked_head(model, chunk_tokens=13)
    ids = torch.randint(3, model.config.vocab_size, (2, 31))
    masked = family.endswith("masked")
    _assert_close(_step(model, ids, _labels(ids, masked)), _step(reference, ids, _labels(ids, masked)))


def test_num_items_in_batch_shift_labels_and_ignore_index():
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    enable_chunked_head(model, chunk_tokens=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    labels = _labels(ids)
    sevens = torch.where(labels == -100, 7, labels)
    for labels, kwargs in ((labels, {"num_items_in_batch": torch.tensor(57)}),
                           (labels, {"num_items_in_batch": 12}),
                           (labels, {"shift_labels": torch.roll(labels, -1, 1)}),
                           (sevens, {"ignore_index": 7})):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        _assert_close(_step(model, ids, labels, **kwargs), _step(reference, ids, labels, **kwargs))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32+autocast"])
def test_bf16_within_the_plain_paths_error_against_fp64(autocast):
    model = build_model(load_config("llama-tiny"), dtype=torch.float32 if autocast else torch.bfloat16)
    plain = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    enable_chunked_head(model, chunk_tokens=37)
    ids = torch.randint(0, model.config.vocab_size, (3, 45))
    ours = _step(model, ids, _labels(ids), autocast=autocast)
    ref = _step(plain, ids, _labels(ids), autocast=autocast)
    truth = _step(exact, ids, _labels(ids))
    assert _rel(ours[0], truth[0]) <= BF16_FACTOR * _rel(ref[0], truth[0]) + 1e-6
    for name, true_grad in truth[1].items():
        if "k_proj.bias" not in name:
            assert _rel(ours[1][name], true_grad) <= BF16_FACTOR * _rel(ref[1][name], true_grad), name


def test_frozen_head_gets_no_gradient_and_frozen_everything_still_gives_the_loss():
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.lm_head.weight.requires_grad_(False)
    enable_chunked_head(model, chunk_tokens=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    _assert_close(_step(model, ids, _labels(ids)), _step(reference, ids, _labels(ids)))
    assert model.lm_head.weight.grad is None


def _head_peak(mode, tokens, vocab, hidden=32, dtype=torch.float32, chunk=None):
    """Peak bytes the head allocates over forward and backward (inputs and weight not
    counted; the weight gradient is)."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    torch.manual_seed(0)
    h = torch.randn(2, tokens // 2, hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, dtype=dtype) / hidden ** 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2))
    with PeakTracker() as tracker:
        if mode == "plain":
            loss = ForCausalLMLoss(F.linear(h, w), labels, vocab)
        else:
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = chunked_cross_entropy(h, w, None, targets, chunk_tokens=chunk)
        loss.backward()
        del loss
    return tracker.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_peak_grows_with_the_chunk_not_with_tokens_times_vocab(dtype):
    hidden, vocab, chunk = 32, 1000, 64
    d = torch.empty((), dtype=dtype).element_size()
    base = _head_peak("chunked", 512, vocab, hidden, dtype, chunk)
    # 4x the tokens adds only [tokens x hidden] buffers (grad_h kept for backward, its scaled
    # copy, the input gradient) and per-token labels: 1/8 of the logits those tokens would take
    more_tokens = _head_peak("chunked", 2048, vocab, hidden, dtype, chunk)
    assert more_tokens - base <= 3 * d * (2048 - 512) * hidden + 16 * 2048
    # the peak holds one whole chunk's logits, turned into their gradient in place:
    # 4x the chunk adds about 3 chunks' worth in the compute dtype
    bigger_chunk = _head_peak("chunked", 512, vocab, hidden, dtype, 4 * chunk)
    assert bigger_chunk >= d * (4 * chunk) * vocab
    assert bigger_chunk - base >= 0.9 * d * (4 * chunk - chunk) * vocab
    # a bound with no tokens x vocab term: one chunk's logits and their fp32 copy (at most one
    # block of rows, here all of them), the fp32 weight-gradient accumulator beside one narrow
    # copy, the [tokens x hidden] buffers
    for tokens, v in ((512, vocab), (2048, vocab), (512, 4 * vocab)):
        bound = ((d + 4) * chunk * v + (4 + d) * v * hidden + 3 * d * tokens * hidden
                 + 16 * tokens + 48 * chunk)
        assert _head_peak("chunked", tokens, v, hidden, dtype, chunk) <= bound, (tokens, v)
        assert _head_peak("plain", tokens, v, hidden, dtype) >= 12 * tokens * v


def test_default_chunk_tokens():
    assert default_chunk_tokens(128256) == 2048
    assert default_chunk_tokens(10 ** 9) == 128 and default_chunk_tokens(100) == 8192


def test_other_calls_are_untouched_and_disable_restores():
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    enable_chunked_head(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    with torch.no_grad():  # evaluation with labels keeps its logits (Trainer's eval loop)
        out, ref = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    as_tuple = model(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].ndim == 0
    assert "forward" in model.__dict__
    disable_chunked_head(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    assert model(input_ids=ids, labels=ids).logits is not None


def test_remat_apply_full_with_chunked_head_then_remove():
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    remat.apply(model, "full", head="chunked", chunk_tokens=10)
    ids = torch.randint(0, model.config.vocab_size, (2, 23))
    ours = _step(model, ids, _labels(ids))
    _assert_close(ours, _step(reference, ids, _labels(ids)))
    assert ours[2].logits is None
    remat.remove(model)
    assert "forward" not in model.__dict__


def test_peft_lora_model_is_looked_through():
    peft = pytest.importorskip("peft")
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    reference = copy.deepcopy(lora)
    enable_chunked_head(lora, chunk_tokens=16)
    assert "forward" in lora.get_base_model().__dict__
    ids = torch.randint(0, 512, (2, 21))
    _assert_close(_step(lora, ids, _labels(ids)), _step(reference, ids, _labels(ids)))
    disable_chunked_head(lora)
    assert "forward" not in lora.get_base_model().__dict__
    with_head = peft.get_peft_model(build_model(load_config("llama-tiny")),
                                    peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(TypeError, match="plain torch.nn.Linear"):
        enable_chunked_head(with_head)


def _scales_its_parents_logits(config):
    """A Llama whose forward doubles the logits its parent's forward returned: a transform its own
    source shows no ``lm_head`` call for, so the chunked head cannot read it there."""
    from transformers import LlamaForCausalLM

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = LlamaForCausalLM.forward(self, input_ids=input_ids, **kwargs)
        out.logits = out.logits * 2.0
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out
    return type("ScalesItsParentsLogits", (LlamaForCausalLM,), {"forward": forward})(config)


def test_the_logit_transform_is_the_forwards_not_the_configs():
    """A config field the forward does not use changes nothing (a soft-cap value on a Llama config,
    which Llama's forward never reads: the chunked loss equals the plain one); fields the forward
    reads where remat named another meaning are read from the forward (MiniCPM3 divides its hidden
    states by ``logits_scaling`` before its lm_head, not its logits after it), and what a forward
    does to its logits and no config field says is reproduced (MuseGlimmer's ``output_multiplier``)."""
    from remat.head.transform import read_transform
    from transformers.models.minicpm3.modeling_minicpm3 import MiniCPM3ForCausalLM
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerForConditionalGeneration
    assert read_transform(MiniCPM3ForCausalLM.__new__(MiniCPM3ForCausalLM), "lm_head").text == ""
    glimmer = read_transform(MuseGlimmerForConditionalGeneration.__new__(MuseGlimmerForConditionalGeneration),
                             "lm_head").text
    assert glimmer.startswith("logits = logits * self.config.text_config.output_multiplier;"), glimmer
    reference = _build("llama", final_logit_softcapping=5.0)
    model = copy.deepcopy(reference)
    remat.apply(model, "keep", head="chunked")
    ids = torch.randint(0, 211, (2, 9))
    ours, ref = _step(model, ids, ids), _step(reference, ids, ids)
    _assert_close(ours, ref)


def test_refuses_what_it_cannot_reproduce():
    model = build_model(load_config("llama-tiny"), dtype=torch.float32)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(ValueError, match="head='plain'"):
        enable_chunked_head(model)
    with pytest.raises(ValueError, match="no LM head"):
        enable_chunked_head(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="positive integer"):
        enable_chunked_head(build_model(load_config("llama-tiny")), chunk_tokens=0)
    # a transform the forward's source does not show (a subclass scaling the logits its parent's forward
    # returned) is caught by the probe in the first step
    model = _scales_its_parents_logits(build_model(load_config("llama-tiny"), dtype=torch.float32).config)
    enable_chunked_head(model)
    ids = torch.randint(0, 512, (2, 9))
    with pytest.raises(ValueError, match="post-processes its logits"):
        model(input_ids=ids, labels=ids)
    model = enable_chunked_head(build_model(load_config("llama-tiny")))
    with pytest.raises(ValueError, match="must match"):
        model(input_ids=ids, labels=ids, logits_to_keep=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_matches_and_peak_is_one_chunk():
    model = build_model(load_config("llama-tiny"), device="cuda", dtype=torch.bfloat16)
    plain, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    enable_chunked_head(model, chunk_tokens=100)
    ids = torch.randint(0, model.config.vocab_size, (4, 257), device="cuda")
    ours, ref, truth = (_step(m, ids, _labels(ids)) for m in (model, plain, exact))
    assert _rel(ours[0], truth[0]) <= BF16_FACTOR * _rel(ref[0], truth[0]) + 1e-6
    for name, true_grad in truth[1].items():
        if "k_proj.bias" not in name:
            assert _rel(ours[1][name], true_grad) <= BF16_FACTOR * _rel(ref[1][name], true_grad) + 1e-6, name
    tokens, vocab, hidden, chunk = 8192, 32000, 512, 1024
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    chunked_cross_entropy(h, w, None, targets, chunk_tokens=chunk).backward()
    measured = torch.cuda.max_memory_allocated() - base - w.grad.numel() * 2
    d = 2  # bf16: grad_h and the fp32 weight-gradient accumulator kept; one chunk's logits at a time
    bound = d * tokens * hidden + 4 * vocab * hidden + max((d + 4) * chunk * vocab, d * chunk * vocab + d * vocab * hidden)
    assert measured <= 1.1 * (bound + d * tokens * hidden + 16 * tokens)
