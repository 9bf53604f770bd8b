"""Built-in model presets: Hugging Face configs only, never weights.

Every CLI command takes ``--model`` as a preset name, a path to a JSON config file of any
name (``mistral-7b.json``) or a folder holding ``config.json``, so "what fits, and how
fast?" can be answered without a GPU and without downloading anything. Models are built
from the config with random weights, on the meta device when only shapes matter, with the
attention implementation the model supports (:func:`attention_for`). Configs that are
neither decoder-only causal LMs nor vision-language models (T5, BERT) are refused in one
line rather than with transformers' list of every config class.

Vision-language models (LLaVA, PaliGemma, Qwen2-VL, Qwen2.5-VL) train on images and text:
:func:`image_text_batch` builds the batch a processor would hand their forward -- the image
token repeated once per image feature, the pixels, Qwen's image grid and token types,
PaliGemma's prefix -- from the config alone, so they plan without an image or a tokenizer.

``llama-1b`` is the bench model of docs/design/planning.md (the shape of Llama-3.2-1B with an untied
head, as the anchors measured it); ``qwen2-vl-2b`` has the shape of Qwen2-VL-2B-Instruct.
"""
from __future__ import annotations

import json
import os

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False)

# Qwen2-VL-2B-Instruct's config.json (the 2B and 7B differ in sizes only)
_QWEN2_VL = dict(model_type="qwen2_vl", image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                 vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645)
_QWEN2_VL_TEXT = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
                      bos_token_id=151643, eos_token_id=151645)

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
    "qwen2-vl-2b": dict(_QWEN2_VL, tie_word_embeddings=True, text_config=dict(
        _QWEN2_VL_TEXT, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_window_layers=28, tie_word_embeddings=True,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2)),
    "qwen2-vl-tiny": dict(_QWEN2_VL, tie_word_embeddings=True, text_config=dict(
        _QWEN2_VL_TEXT, vocab_size=151936, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_window_layers=2, tie_word_embeddings=True,
        rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2)),
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
    return "sdpa" if getattr(_model_class(config), "_supports_sdpa", False) else "eager"


def is_vision_language(config) -> bool:
    """Whether ``config`` is a vision-language model's (built as transformers' image-text-to-text
    model: LLaVA, PaliGemma, Qwen2-VL ...) rather than a causal LM's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    return type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in _image_text_mapping()


def _image_text_mapping():
    from transformers.models.auto import modeling_auto
    # transformers >= 4.45 names it; older ones had vision-to-sequence only
    return getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", None) or {}


def _model_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if type(config) in _image_text_mapping():
        return _image_text_mapping()[type(config)]
    kind = "an encoder-decoder model" if getattr(config, "is_encoder_decoder", False) else \
        "not a causal language model or vision-language model transformers knows"
    raise ValueError(f"{type(config).__name__} (model_type {config.model_type!r}) is {kind}; remat plans "
                     "decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ...) and vision-language models "
                     f"({', '.join(IMAGE_TEXT_FAMILIES)}): pass such a config")


def build_model(config, *, device="cpu", dtype=None, attn_implementation=None, seed=0):
    """A causal LM (or a vision-language model, for such a config) with random weights from
    ``config``, in training mode.

    ``attn_implementation``: default :func:`attention_for` (sdpa where the model allows it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    _model_class(config)  # a short error for T5 and the like, before transformers' long one
    auto = AutoModelForCausalLM
    if is_vision_language(config):
        from transformers import AutoModelForImageTextToText as auto
    attn_implementation = attn_implementation or attention_for(config)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    # default dtype rather than from_config(dtype=...): the keyword was renamed in transformers 5
    torch.set_default_dtype(dtype or previous)
    try:
        with torch.device(device):
            model = auto.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


IMAGE_TEXT_FAMILIES = ("llava", "paligemma", "qwen2_vl", "qwen2_5_vl")
"""The vision-language model types :func:`image_text_batch` builds batches for."""

DYNAMIC_IMAGE_SIZE = (448, 448)
"""Qwen2-VL's default image size in a built batch (its processor takes any size; 448 x 448 is 256
image tokens a picture)."""


def image_geometry(config, image_size=None) -> tuple:
    """``((height, width), tokens per image)`` of ``config``'s images: a fixed-size vision tower
    (LLaVA, PaliGemma) takes its config's size only (its position table), and ``image_size``, if
    given, must be it; Qwen2-VL takes any size, rounded as its processor rounds it (to the nearest
    multiple of patch x merge, at least one). ValueError for another model type or a size the
    tower cannot take."""
    family = config.model_type
    vision = getattr(config, "vision_config", None)
    if family not in IMAGE_TEXT_FAMILIES or vision is None:
        raise ValueError(f"remat builds image batches for {', '.join(IMAGE_TEXT_FAMILIES)}, not model_type "
                         f"{family!r}; plan it from Python with remat.plan(model, batch, budget) and a batch "
                         "from its processor")
    if family in ("qwen2_vl", "qwen2_5_vl"):
        factor = vision.patch_size * vision.spatial_merge_size
        height, width = image_size or DYNAMIC_IMAGE_SIZE
        height, width = (max(factor, round(side / factor) * factor) for side in (height, width))
        tokens = (height // vision.patch_size) * (width // vision.patch_size) // vision.spatial_merge_size ** 2
        return (height, width), tokens
    side = vision.image_size
    if image_size is not None and tuple(image_size) != (side, side):
        raise ValueError(f"{family}'s vision tower takes {side}x{side} images only (its position embeddings are "
                         f"for that size), got {image_size[0]}x{image_size[1]}; pass --image-size {side}x{side} or "
                         "leave it out")
    tokens = (side // vision.patch_size) ** 2
    if family == "llava" and getattr(config, "vision_feature_select_strategy", "default") == "full":
        tokens += 1  # the class token is kept
    return (side, side), tokens


def check_images_fit(config, *, images: int, seq: int, image_size=None) -> int:
    """The tokens one image takes in a sequence (Qwen: with its vision start and end tokens);
    ValueError when ``images`` of them and one text token do not fit in ``seq``, or the size or
    count is one the model cannot take (:func:`image_geometry`)."""
    if images < 1:
        raise ValueError(f"--images must be a whole number >= 1 for a vision-language model, got {images}")
    (height, width), per_image = image_geometry(config, image_size)
    span = per_image + (2 if config.model_type in ("qwen2_vl", "qwen2_5_vl") else 0)
    if images * span + 1 > seq:
        raise ValueError(f"{images} image(s) of {height}x{width} take {images * span} tokens, more than --seq {seq} "
                         f"leaves room for (at least one text token): pass --seq {images * span + 1} or more, or "
                         "fewer or smaller images")
    return span


def image_text_batch(config, *, batch: int, seq: int, images: int = 1, image_size=None, dtype=None) -> dict:
    """A training batch of ``batch`` sequences of ``seq`` tokens, each holding ``images`` images, as
    ``config``'s processor would make it (see :func:`image_geometry` for the sizes): ``input_ids``
    with the image token once per image feature (Qwen: between vision start and end tokens) and
    text after, ``pixel_values`` (zeros, in ``dtype``), ``attention_mask``, ``labels`` (-100 on
    the image tokens; PaliGemma: on its prefix, image and prompt, which ``token_type_ids`` marks
    0), and Qwen's ``image_grid_thw`` and ``mm_token_type_ids``. ValueError when the images do
    not fit in ``seq``."""
    import inspect

    import torch
    span = check_images_fit(config, images=images, seq=seq, image_size=image_size)
    (height, width), per_image = image_geometry(config, image_size)
    family, vision = config.model_type, config.vision_config
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        image_id = config.image_token_index
    qwen = family in ("qwen2_vl", "qwen2_5_vl")
    special = {image_id, getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None),
               getattr(config, "video_token_id", None)}
    text_id = next(i for i in range(len(special) + 1) if i not in special)
    ids = torch.full((batch, seq), text_id, dtype=torch.long)
    image_mask = torch.zeros(batch, seq, dtype=torch.bool)
    start = 0 if family == "paligemma" else 1  # PaliGemma: images, then BOS; others: BOS first
    for _ in range(images):
        if qwen:
            ids[:, start] = config.vision_start_token_id
            ids[:, start + span - 1] = config.vision_end_token_id
        first = start + (1 if qwen else 0)
        ids[:, first:first + per_image] = image_id
        image_mask[:, first:first + per_image] = True
        start += span
    labels = ids.masked_fill(image_mask, -100)
    out = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    pixels = dict(dtype=dtype or torch.float32)
    if qwen:
        grid = torch.tensor([[1, height // vision.patch_size, width // vision.patch_size]] * (batch * images))
        row = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        out.update(pixel_values=torch.zeros(int(grid.prod(-1).sum()), row, **pixels), image_grid_thw=grid)
        forward = inspect.signature(_model_class(config).forward).parameters
        if "mm_token_type_ids" in forward:  # transformers >= 5: M-RoPE positions need them
            out["mm_token_type_ids"] = image_mask.int()
    else:
        channels = getattr(vision, "num_channels", 3)
        out["pixel_values"] = torch.zeros(batch * images, channels, height, width, **pixels)
    if family == "paligemma":  # prefix (image + prompt) attends both ways and carries no loss
        prefix = start + (seq - start) // 2
        token_types = torch.ones_like(ids)
        token_types[:, :prefix] = 0
        out.update(token_type_ids=token_types, labels=ids.masked_fill(token_types == 0, -100))
    return out


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
