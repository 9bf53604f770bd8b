"""The model zoo (issue 10): tiny models of many architectures, built the way users build them.

Each :class:`Case` builds one model from its library's config class with the config's
defaults -- ``use_cache`` stays on, MoE models return router logits, attention is the
implementation the model supports ("sdpa" where it can, else "eager") -- and changes only
sizes (two layers, hidden 32-64, vocab 256, sequences of 12 tokens) and dropout, which is
switched on wherever the config has a dropout field so that RNG preservation is
exercised. The batch is the one users give: ``input_ids``, ``attention_mask`` and
``labels`` for language models, pixels and labels for image classifiers; models without a
loss of their own (CLIP's vision tower, plain PyTorch modules) get a simple loss on their
output. Non-Hugging-Face entries cover ``nn.TransformerEncoder``, a residual CNN with
BatchNorm, a UNet whose blocks change shape (named with ``blocks=``), a model that is an
``nn.Sequential`` of residual blocks and, where ``timm`` imports, timm models.

:func:`run_treatment` and :func:`run_plan` are the checks (the comparison and the mechanism
are :mod:`oracle`'s); :mod:`test_zoo` asserts them case by case and ``benchmarks/zoo_table.py``
prints them as a table.
"""
from __future__ import annotations

import copy
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import oracle

DROPOUT = 0.1
VOCAB = 256
SEQ = 12
BATCH = 2
# "segments:2": two consecutive blocks recomputed as one unit (remat.treat.segments); on the
# two-layer models that is the whole stack (each stack of an encoder-decoder), and the last
# segment is a single block on sequential_mlp (2+1) and the UNet (2+2+1)
TREATMENTS = ("full", "selective", "attention", "mlp", "every:2", "offload", "full+offload", "segments:2",
              "attn-saved")


class Unavailable(Exception):
    """The installed libraries cannot build this case (missing class or package); a reason, not a failure."""


@dataclass(frozen=True)
class Case:
    """One zoo model: how to build it, feed it and take its loss."""

    name: str
    build: Callable[[], nn.Module] = field(repr=False)
    """Builds the model in train mode (seeded: two builds are identical)."""
    batch: Callable[[nn.Module], Any] = field(repr=False)
    """``batch(model)``: the batch a user passes (a dict of keyword arguments or one tensor)."""
    loss: Callable[[nn.Module, Any], torch.Tensor] = field(repr=False)
    """``loss(model, batch)``: the scalar a training step calls ``backward`` on."""
    has_attention: bool = True
    """Whether the blocks hold an attention sub-module (else ``"attention"`` must be refused)."""
    has_mlp: bool = True
    """Whether the blocks hold an MLP sub-module (else ``"mlp"`` must be refused)."""
    blocks: Any = None
    """``blocks=`` for ``remat.apply`` / ``remat.plan``; None: automatic discovery."""
    lm_batch: bool = False
    """The batch is token ids with labels (what the planner accepts today)."""


# ----------------------------------------------------------------------------- Hugging Face

def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise Unavailable(f"transformers is not installed ({error})") from None
    return transformers


def _hf_class(name: str):
    cls = getattr(_transformers(), name, None)
    if cls is None:
        raise Unavailable(f"transformers {_transformers().__version__} has no {name}")
    return cls


def _dropout_on(config) -> None:
    """Every dropout probability of the config to DROPOUT (LayerDrop stays as it is)."""
    for key, value in config.to_dict().items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                ("dropout" in key or key.endswith("pdrop")) and "layerdrop" not in key:
            setattr(config, key, DROPOUT)
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            _dropout_on(getattr(config, sub))


def _hf_model(model_class: str, config_class: str, attn: Optional[str], **sizes) -> nn.Module:
    config = _hf_class(config_class)(**sizes)
    _dropout_on(config)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # defaults beyond the tiny vocab
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= getattr(config, "vocab_size", VOCAB):
            setattr(config, key, 0)
    cls = _hf_class(model_class)
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attn} if attn else {}
    return cls._from_config(config, **kwargs).train()


def _ids(model, seq=SEQ, low=3):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(low, VOCAB, (BATCH, seq), generator=generator)


def _lm_batch(model):
    ids = _ids(model)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _mlm_batch(model):
    ids = _ids(model)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _seq2seq_batch(model):
    ids = _ids(model)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(model, seq=7)}


def _pixels(model, size=16, labels=None):
    generator = torch.Generator().manual_seed(2)
    batch = {"pixel_values": torch.randn(BATCH, 3, size, size, generator=generator)}
    if labels:
        batch["labels"] = torch.randint(0, labels, (BATCH,), generator=generator)
    return batch


def _hf_loss(model, batch):
    return model(**batch).loss


def _pooled_loss(model, batch):
    out = model(**batch)
    return out.pooler_output.square().mean() + out.last_hidden_state.square().mean()


# sizes shared by the Llama-like decoders; everything else stays at the config's defaults
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def _causal(name, model_class, config_class, attn="sdpa", has_mlp=True, **sizes):
    return Case(name, functools.partial(_hf_model, model_class, config_class, attn, **sizes),
                _lm_batch, _hf_loss, has_mlp=has_mlp, lm_batch=True)


# hybrid attention / state-space models and pure state-space models: each built with a layer
# of every kind it has (a mamba or linear-attention layer and an attention layer), its
# DynamicCache(config=...) laid out per layer kind as the model builds it with use_cache on
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
_HYBRID = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2)
HYBRID_CASES = [
    _causal("jamba", "JambaForCausalLM", "JambaConfig", **_HYBRID, num_hidden_layers=2, attn_layer_period=2,
            attn_layer_offset=1, num_experts=4, expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=8),
    _causal("bamba", "BambaForCausalLM", "BambaConfig", **_HYBRID, num_hidden_layers=2, attn_layer_indices=[1],
            **_MAMBA2),
    _causal("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config", **_HYBRID, num_hidden_layers=2,
            mamba_d_ssm=128, **_MAMBA2),
    _causal("lfm2", "Lfm2ForCausalLM", "Lfm2Config", **_HYBRID, num_hidden_layers=2,
            layer_types=["conv", "full_attention"]),
    _causal("zamba2", "Zamba2ForCausalLM", "Zamba2Config", **_HYBRID, num_hidden_layers=3,
            layers_block_type=["linear_attention", "hybrid", "hybrid"], hybrid_layer_ids=[1, 2],
            attention_hidden_size=128, attention_head_dim=32, mamba_headdim=16, n_mamba_heads=8,
            mamba_d_state=16, chunk_size=8, has_mlp=False),  # its mamba layers have no MLP
    _causal("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", **_HYBRID, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    _causal("mamba2", "Mamba2ForCausalLM", "Mamba2Config", attn=None, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
            num_heads=8, head_dim=16, state_size=16, chunk_size=8, has_mlp=False),
]

HF_CASES = [
    _causal("llama", "LlamaForCausalLM", "LlamaConfig", **DECODER),
    _causal("mistral", "MistralForCausalLM", "MistralConfig", **DECODER),
    _causal("mixtral", "MixtralForCausalLM", "MixtralConfig", **DECODER, num_local_experts=4,
            output_router_logits=True),
    _causal("qwen2", "Qwen2ForCausalLM", "Qwen2Config", **DECODER),
    _causal("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", **DECODER, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            output_router_logits=True),
    _causal("qwen3", "Qwen3ForCausalLM", "Qwen3Config", **DECODER, head_dim=8),
    _causal("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **DECODER, head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True),
    _causal("gemma", "GemmaForCausalLM", "GemmaConfig", **DECODER, head_dim=8),
    _causal("gemma2", "Gemma2ForCausalLM", "Gemma2Config", attn="eager", **DECODER, head_dim=8),
    _causal("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", attn="eager", **DECODER, head_dim=8),
    _causal("phi3", "Phi3ForCausalLM", "Phi3Config", **DECODER),
    _causal("olmo2", "Olmo2ForCausalLM", "Olmo2Config", **DECODER),
    _causal("cohere", "CohereForCausalLM", "CohereConfig", **DECODER),
    _causal("granite", "GraniteForCausalLM", "GraniteConfig", **DECODER),
    _causal("stablelm", "StableLmForCausalLM", "StableLmConfig", **DECODER),
    _causal("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", **DECODER),
    _causal("gpt2", "GPT2LMHeadModel", "GPT2Config", attn="eager", vocab_size=VOCAB, n_embd=32, n_layer=2,
            n_head=4),
    _causal("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    _causal("falcon", "FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
            num_hidden_layers=2, num_attention_heads=4),
    *HYBRID_CASES,
    Case("bert", functools.partial(_hf_model, "BertForMaskedLM", "BertConfig", "sdpa", vocab_size=VOCAB,
                                   hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4),
         _mlm_batch, _hf_loss, lm_batch=True),
    # one layer group shared by every layer: one block, called three times a step
    Case("albert", functools.partial(_hf_model, "AlbertForMaskedLM", "AlbertConfig", "sdpa", vocab_size=VOCAB,
                                     embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4),
         _mlm_batch, _hf_loss, lm_batch=True),
    Case("modernbert", functools.partial(_hf_model, "ModernBertForMaskedLM", "ModernBertConfig", "sdpa",
                                         vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
         _mlm_batch, _hf_loss, lm_batch=True),
    Case("t5", functools.partial(_hf_model, "T5ForConditionalGeneration", "T5Config", None, vocab_size=VOCAB,
                                 d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0),  # as in every released T5 config
         _seq2seq_batch, _hf_loss, lm_batch=True),
    Case("bart", functools.partial(_hf_model, "BartForConditionalGeneration", "BartConfig", "sdpa",
                                   vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64),
         _seq2seq_batch, _hf_loss, has_mlp=False, lm_batch=True),
    Case("vit", functools.partial(_hf_model, "ViTForImageClassification", "ViTConfig", "sdpa", image_size=16,
                                  patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_labels=5),
         functools.partial(_pixels, labels=5), _hf_loss),
    Case("clip_vision", functools.partial(_hf_model, "CLIPVisionModel", "CLIPVisionConfig", "sdpa",
                                          image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4),
         _pixels, _pooled_loss),
]


# ----------------------------------------------------------------------------- plain PyTorch

def _seeded(factory):
    @functools.wraps(factory)
    def build():
        torch.manual_seed(0)
        return factory().train()
    return build


def _tensor(*shape, seed=3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _square_loss(model, x):
    return model(x).square().mean()


@_seeded
def transformer_encoder():
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=DROPOUT,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


class ResBlock(nn.Module):
    """conv-BN-ReLU-dropout-conv-BN plus the input: BatchNorm running statistics and RNG."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout2d(DROPOUT)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = self.drop(F.relu(self.bn1(self.conv1(x))))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, channels=8, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock(channels), ResBlock(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def _cnn_loss(model, x):
    labels = torch.arange(x.shape[0]) % 5
    return F.cross_entropy(model(x), labels)


class ConvBlock(nn.Module):
    """Two convolutions with GroupNorm and dropout; ``skip`` (an up block's encoder features) is concatenated."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(2, cout)
        self.drop = nn.Dropout(DROPOUT)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x, skip=None):
        if skip is not None:
            x = torch.cat([F.interpolate(x, size=skip.shape[-2:]), skip], dim=1)
        return self.conv2(self.drop(F.silu(self.norm(self.conv1(x)))))


class UNet(nn.Module):
    """Blocks as named attributes that change shape: discovery cannot find them, ``blocks=`` names them."""

    BLOCKS = ("down1", "down2", "mid", "up2", "up1")

    def __init__(self, c=8):
        super().__init__()
        self.down1, self.down2 = ConvBlock(3, c), ConvBlock(c, 2 * c)
        self.mid = ConvBlock(2 * c, 2 * c)
        self.up2, self.up1 = ConvBlock(4 * c, c), ConvBlock(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        return self.out(self.up1(self.up2(m, skip=d2), d1))


class ResidualMLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(DROPOUT),
                                 nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


PLAIN_CASES = [
    Case("nn_transformer_encoder", transformer_encoder, lambda model: _tensor(BATCH, SEQ, 32), _square_loss,
         has_mlp=False),
    Case("resnet_bn", _seeded(ResNet), lambda model: _tensor(4, 3, 8, 8), _cnn_loss, has_attention=False,
         has_mlp=False),
    Case("unet", _seeded(UNet), lambda model: _tensor(BATCH, 3, 16, 16), _square_loss, has_attention=False,
         has_mlp=False, blocks=list(UNet.BLOCKS)),
    Case("sequential_mlp", _seeded(lambda: nn.Sequential(*(ResidualMLP() for _ in range(3)))),
         lambda model: _tensor(BATCH, SEQ, 32), _square_loss, has_attention=False),
]


# ----------------------------------------------------------------------------- timm

def _timm(name, **kwargs):
    def build():
        try:
            import timm
        except ImportError:
            raise Unavailable("timm is not installed") from None
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=5, **kwargs).train()
    return build


TIMM_CASES = [
    Case("timm_vit", _timm("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                           drop_rate=DROPOUT, attn_drop_rate=DROPOUT, proj_drop_rate=DROPOUT),
         lambda model: _tensor(BATCH, 3, 16, 16), _cnn_loss),
    Case("timm_resnet", _timm("resnet18", drop_rate=DROPOUT), lambda model: _tensor(4, 3, 16, 16), _cnn_loss,
         has_attention=False, has_mlp=False),
]

CASES = {case.name: case for case in HF_CASES + PLAIN_CASES + TIMM_CASES}


def case_of(case) -> Case:
    """``case`` itself, or the hand-written case of that name (the checks take either)."""
    return CASES[case] if isinstance(case, str) else case


_PRISTINE: dict = {}  # id(case) -> (case, model): a Case may hold a list (blocks=), so it is not hashable


def build(case) -> nn.Module:
    """A fresh copy of the zoo model ``case`` (a Case or a name; built once per process, then deep-copied)."""
    case = case_of(case)
    if id(case) not in _PRISTINE:
        _PRISTINE[id(case)] = (case, case.build())
    return copy.deepcopy(_PRISTINE[id(case)][1])


# ----------------------------------------------------------------------------- the check

def compare(case, treated: nn.Module, reference: nn.Module, steps: int = 2) -> oracle.Comparison:
    """:func:`oracle.compare` on the case's batch and loss: ``steps`` SGD steps (lr 0.1, seed 100
    before the first), every loss, gradient and buffer recorded, the first step metered."""
    case = case_of(case)
    return oracle.compare(treated, reference, case.batch(reference), case.loss, steps=steps, seed=100, lr=0.1)


def _one_thread(function):
    """Tiny models: one intra-op thread is faster, and on a loaded two-core machine OpenMP's
    spinning threads made the zoo 20x slower. Both sides of a comparison use the same count."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return function(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


# offload on the CPU: the engine's inline mode, which copies each saved tensor to another CPU
# buffer and back synchronously (its whole pack/unpack bookkeeping), so that an offload cell
# tests a move that really happened rather than the no-op the engine is on a CPU otherwise
INLINE_OFFLOAD = {"_inline": True, "min_bytes": 0}


@_one_thread
def run_treatment(name, spec: str, steps: int = 2) -> str:
    """Apply ``spec`` to a fresh zoo model (``name``: a Case or a hand-written case's name)
    and train it beside an untouched copy.

    Returns ``"exact"``, or ``"refused"`` when the blocks lack the sub-module ``spec`` names
    and ``remat.apply`` refused with a ValueError saying so. Raises anything else: an
    unexpected error, an AssertionError for a difference, for a refusal that should (not)
    have happened, or for a treatment that did nothing (:func:`oracle.check_mechanism`).
    :class:`Unavailable` when the case cannot be built here."""
    import remat
    case = case_of(name)
    name = case.name
    model = build(case)
    reference = copy.deepcopy(model)
    missing = {"attention": not case.has_attention, "mlp": not case.has_mlp}.get(spec, False)
    try:
        remat.apply(model, spec, blocks=case.blocks, offload_options=INLINE_OFFLOAD)
    except ValueError as error:
        if missing and re.search(f"no {spec} sub-module", str(error)):
            return "refused"
        raise
    assert not missing, f"{spec!r} was accepted, but {name}'s blocks have no {spec} sub-module"
    oracle.check_installed(model, case.blocks)
    result = compare(case, treated=model, reference=reference, steps=steps).assert_equal()
    oracle.check_mechanism(model, result, blocks=case.blocks)
    return "exact"


@_one_thread
def run_plan(name, budget="1GiB", smallest: bool = False):
    """``remat.plan`` a fresh zoo model (``name``: a Case or a hand-written case's name) on its
    batch (fake tensors on the CPU), with the case's loss as ``loss_fn`` where the model computes
    none of its own, and check that planning left the model, its gradients and the RNG as they
    were; returns the plan. ``smallest``: returns ``(plan, smallest)`` where ``smallest`` is the
    plan of the smallest peak (what :class:`remat.NoPlanFits` offers for a budget of one byte),
    solved from the same profile -- the plan that treats the most."""
    import remat
    case = case_of(name)
    model = build(case)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    kwargs = {} if case.loss is _hf_loss else {"loss_fn": case.loss}  # what a user must pass: no loss of its own
    batch = case.batch(model)
    profiled = remat.profile(model, batch, blocks=case.blocks, **kwargs)
    plan = remat.plan(model, batch, budget=budget, blocks=case.blocks, profiled=profiled, **kwargs)
    tightest = None
    if smallest:
        try:
            tightest = remat.plan(model, batch, budget=1, blocks=case.blocks, profiled=profiled, **kwargs)
        except remat.NoPlanFits as error:
            tightest = error.plan
    assert set(plan.blocks) == set(remat.discover(model, case.blocks).block_names), "plan misses blocks"
    assert torch.equal(torch.get_rng_state(), rng), "planning changed the RNG state"
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"planning changed {key}"
    assert all(p.grad is None for p in model.parameters()), "planning left gradients"
    return (plan, tightest) if smallest else plan
