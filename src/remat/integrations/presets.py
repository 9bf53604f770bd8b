"""Built-in model presets: Hugging Face configs only, never weights.

Every CLI command takes ``--model`` as a preset name, a path to a JSON config file of any
name (``mistral-7b.json``) or a folder holding ``config.json``, so "what fits, and how
fast?" can be answered without a GPU and without downloading anything. Models are built
from the config with random weights, on the meta device when only shapes matter, with the
attention implementation the model supports (:func:`attention_for`). Configs that are not
decoder-only causal LMs (T5, BERT) are refused in one line rather than with transformers'
list of every config class.

``llama-1b`` is the DESIGN.md bench model (the shape of Llama-3.2-1B with an untied
head, as the anchors measured it).
"""
from __future__ import annotations

import json
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
    """A ``transformers`` config from a preset name, a JSON config file of any name, or a folder
    holding ``config.json``. Every problem is a ValueError naming the file and the fix."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ImportError("model presets and config files need transformers: pip install 'remat[hf]'",
                          name="transformers") from None
    if name_or_path in PRESETS:
        kwargs = dict(PRESETS[name_or_path])
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    elif os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{name_or_path} is a folder without a config.json; pass a preset "
                             f"({', '.join(preset_names())}), a JSON config file or a folder holding config.json")
        config = _config_from_file(path)
    elif os.path.isfile(name_or_path):
        config = _config_from_file(name_or_path)
    elif os.sep in name_or_path or name_or_path.endswith(".json"):
        raise ValueError(f"no such file: {name_or_path}; pass a preset ({', '.join(preset_names())}), "
                         "a JSON config file or a folder holding config.json")
    else:
        raise ValueError(f"unknown model {name_or_path!r}: not a preset ({', '.join(preset_names())}) "
                         "and no such file; pass a preset name or a path to a JSON config file")
    config.use_cache = False
    return config


def _config_from_file(path: str):
    # Read the JSON here rather than with AutoConfig.from_pretrained, which wants the name
    # config.json and answers a broken file with a page about the Hugging Face Hub.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}; pass a readable Hugging Face config file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); pass a Hugging Face config.json, as "
                         "`config.save_pretrained(folder)` writes it") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"{path} is not a Hugging Face model config: expected a JSON object with a "
                         f"'model_type' string such as \"llama\", got "
                         f"{type(data).__name__ if not isinstance(data, dict) else 'no model_type'}")
    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        import transformers
        raise ValueError(f"{path}: model_type {model_type!r} is not known to transformers "
                         f"{transformers.__version__}; upgrade transformers or correct the model_type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: transformers cannot make a {model_type} config from it "
                         f"({type(e).__name__}: {e}); correct the file") from None


def attention_for(config) -> str:
    """The attention implementation to build ``config``'s model with: the one the config names,
    else ``sdpa`` where the model class supports it and the config softcaps no attention logits,
    else ``eager``.

    Gemma-2 (attention logit softcapping) refuses ``sdpa`` on transformers 5, so forcing
    ``sdpa`` on every model, as remat once did, cannot build it; transformers 4.x builds it with
    ``sdpa`` but drops the softcapping there (it warns to train with ``eager``), so a config that
    softcaps gets ``eager`` on every version.
    """
    named = getattr(config, "_attn_implementation_internal", None)
    if named:
        return named
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    return "sdpa" if getattr(_causal_lm_class(config), "_supports_sdpa", False) else "eager"


def _causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = "an encoder-decoder model" if getattr(config, "is_encoder_decoder", False) else \
            "not a causal language model transformers knows"
        raise ValueError(f"{type(config).__name__} (model_type {config.model_type!r}) is {kind}; remat plans "
                         "decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ...): pass such a config")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def build_model(config, *, device="cpu", dtype=None, attn_implementation=None, seed=0):
    """A causal LM with random weights from ``config``, in training mode.

    ``attn_implementation``: default :func:`attention_for` (sdpa where the model allows it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    _causal_lm_class(config)  # a short error for T5 and the like, before transformers' long one
    attn_implementation = attn_implementation or attention_for(config)
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


def materialise(model, device, seed: int = 0):
    """Give a model built on the ``meta`` device (or sharded by FSDP2 after that) real storage on
    ``device``, initialised the model's own way (``_init_weights``, rotary tables recomputed);
    returns ``model``. Each FSDP2 rank fills only its own shards.

    Transformers 4.x's ``_init_weights`` fills only linear and embedding weights: the norms keep
    what their constructor gave them (Llama's ones, Gemma's zeros), which ``to_empty`` turned
    into garbage (NaN losses). So every floating parameter starts as NaN, and one that
    ``_init_weights`` left so gets its module's constructor value (:func:`_constructor_fill`)."""
    import torch
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                _local(p).fill_(float("nan"))
        for module in model.modules():
            model._init_weights(module)  # transformers 5 also recomputes the rotary buffers here
            if hasattr(module, "rope_init_fn") and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                inv_freq, _ = module.rope_init_fn(module.config, device)  # transformers 4 does not
                module.inv_freq.copy_(inv_freq)
                if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                    module.original_inv_freq.copy_(inv_freq)
        for name, module in model.named_modules():
            left = {n: p for n, p in module.named_parameters(recurse=False) if _local(p).isnan().any()}
            if left:
                _constructor_fill(name, module, left)
    return model


def _local(p):
    """The part of ``p`` this process holds: an FSDP2 shard's local tensor, else ``p``."""
    return p.to_local() if hasattr(p, "to_local") else p


def _constructor_fill(name, module, left):
    """Fill ``left`` (``module``'s parameters that ``_init_weights`` did not initialise) with what
    the module's constructor gives them, read from a fresh instance built on the CPU from their
    shape (a norm takes its size first: ``LlamaRMSNorm(hidden_size)``, ``nn.LayerNorm(n)``). Those
    values must be constants, so a shard fills as the whole would; anything else is a ValueError:
    there is no init to copy."""
    import torch
    shape = next(iter(left.values())).shape
    try:
        with torch.device("cpu"):
            fresh = dict(type(module)(shape[0] if len(shape) == 1 else tuple(shape)).named_parameters(recurse=False))
    except (TypeError, ValueError, RuntimeError):  # a constructor that does not take a size first
        fresh = {}
    for key, p in left.items():
        value = fresh.get(key)
        if value is None or value.shape != p.shape or not bool((value == value.flatten()[0]).all()):
            raise ValueError(f"{name}.{key} ({type(module).__name__}) is not initialised by the model's "
                             "_init_weights and remat cannot rebuild its constructor value; build the model on a "
                             "real device instead of 'meta', or use transformers >= 5 (whose _init_weights "
                             "initialises every module)")
        _local(p).fill_(value.flatten()[0].item())
