"""Built-in model presets: Hugging Face configs only, never weights.

Every CLI command takes ``--model`` as a preset name or a path to a ``config.json`` (or
a folder holding one), so "what fits, and how fast?" can be answered without a GPU and
without downloading anything. Models are built from the config with random weights,
on the meta device when only shapes matter.

``llama-1b`` is the DESIGN.md bench model (the shape of Llama-3.2-1B with an untied
head, as the anchors measured it).
"""
from __future__ import annotations

import os

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False)

PRESETS = {
    "llama-tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=False),
    "llama-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8),
    "llama-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
    "llama-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8),
    "qwen-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True),
    "qwen-tiny": dict(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True),
}


def preset_names() -> list:
    return sorted(PRESETS)


def load_config(name_or_path: str):
    """A ``transformers`` config from a preset name or a local config.json / folder."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ImportError("model presets and config.json files need transformers: "
                          "pip install 'remat[hf]'") from None
    if name_or_path in PRESETS:
        kwargs = dict(PRESETS[name_or_path])
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    elif os.path.exists(name_or_path):
        path = os.path.dirname(name_or_path) if os.path.isfile(name_or_path) else name_or_path
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{name_or_path}: no config.json there; pass a preset "
                             f"({', '.join(preset_names())}) or a path to a Hugging Face config.json")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(f"unknown model {name_or_path!r}: not a preset ({', '.join(preset_names())}) "
                         "and no such file; pass a preset name or a path to a config.json")
    config.use_cache = False
    return config


def build_model(config, *, device="cpu", dtype=None, attn_implementation="sdpa", seed=0):
    """A causal LM with random weights from ``config``, in training mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    # default dtype rather than from_config(dtype=...): the keyword was renamed in transformers 5
    torch.set_default_dtype(dtype or previous)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(previous)
    return model.train()
