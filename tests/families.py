"""Tiny models of many families, built from configs (no downloads), with dropout on.

Each factory returns ``(model, make_inputs)`` where ``make_inputs()`` gives fresh kwargs for
one training forward that returns ``.loss``; the first floating input is marked
``requires_grad`` so input gradients are compared too.
"""
from __future__ import annotations

import torch
import torch.nn as nn

DROPOUT = 0.1
_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_rate",
                 "activation_dropout")
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _config(model_type: str, **kwargs):
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type, **kwargs)
    for key in _DROPOUT_KEYS:
        if hasattr(config, key):
            setattr(config, key, DROPOUT)
    config.use_cache = False
    return config


def _causal(model_type: str, **kwargs):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type, **kwargs), attn_implementation="eager"
                                             if model_type in ("gpt2", "opt") else "sdpa")
    vocab = model.config.vocab_size

    def make_inputs(batch=2, seq=11):
        ids = torch.randint(0, vocab, (batch, seq))
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        labels = ids.clone()
        labels[0, :3] = -100
        return {"inputs_embeds": embeds, "labels": labels}
    return model.train(), make_inputs


CAUSAL = {
    "llama": lambda: _causal("llama", **SMALL),
    "mistral": lambda: _causal("mistral", **SMALL),
    "qwen2": lambda: _causal("qwen2", **SMALL, tie_word_embeddings=True),
    "qwen3": lambda: _causal("qwen3", **SMALL, head_dim=8),
    "gemma": lambda: _causal("gemma", **SMALL, head_dim=8),
    "gpt2": lambda: _causal("gpt2", vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64),
    "gpt_neox": lambda: _causal("gpt_neox", vocab_size=97, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64),
    "phi": lambda: _causal("phi", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=64),
    "opt": lambda: _causal("opt", vocab_size=97, hidden_size=32, ffn_dim=48, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
}


def bert():
    from transformers import BertForMaskedLM
    torch.manual_seed(0)
    model = BertForMaskedLM(_config("bert", vocab_size=97, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     max_position_embeddings=64))

    def make_inputs(batch=2, seq=11):
        ids = torch.randint(0, 97, (batch, seq))
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        return {"inputs_embeds": embeds, "labels": labels}
    return model.train(), make_inputs


def _seq2seq(model_type: str, **kwargs):
    from transformers import AutoModelForSeq2SeqLM
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(_config(model_type, **kwargs))

    def make_inputs(batch=2, seq=9):
        ids = torch.randint(3, 97, (batch, seq))
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        return {"inputs_embeds": embeds, "labels": torch.randint(3, 97, (batch, 7))}
    return model.train(), make_inputs


def t5():
    return _seq2seq("t5", vocab_size=97, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                    num_heads=4, decoder_start_token_id=0, pad_token_id=0)


def bart():
    return _seq2seq("bart", vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                    decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1,
                    decoder_start_token_id=2, forced_eos_token_id=None)


def vit():
    from transformers import ViTForImageClassification
    torch.manual_seed(0)
    model = ViTForImageClassification(_config("vit", image_size=16, patch_size=4, num_channels=3,
                                              hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                              num_attention_heads=4, num_labels=5))

    def make_inputs(batch=2):
        return {"pixel_values": torch.randn(batch, 3, 16, 16, requires_grad=True),
                "labels": torch.randint(0, 5, (batch,))}
    return model.train(), make_inputs


class PlainBlock(nn.Module):
    """A block that needs a keyword argument, to check kwargs reach the block."""

    def __init__(self, width: int):
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(DROPOUT),
                                 nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x, *, scale):
        x = x + scale * torch.tanh(self.attn(self.norm(x)))
        return x + self.mlp(x)


class PlainModel(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x, scale=0.5, target=None):
        for block in self.blocks:
            x = block(x, scale=scale)
        y = self.out(x).squeeze(-1)
        return type("Out", (), {"loss": ((y - target) ** 2).mean()})()


def plain():
    torch.manual_seed(0)
    model = PlainModel()

    def make_inputs(batch=3):
        return {"x": torch.randn(batch, 5, 16, requires_grad=True), "scale": 0.7,
                "target": torch.randn(batch, 5)}
    return model.train(), make_inputs


FAMILIES = dict(CAUSAL, bert=bert, t5=t5, bart=bart, vit=vit, plain=plain)
