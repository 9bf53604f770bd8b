"""Shrink any transformers config to a tiny one, keeping every default that is not a size.

The registry zoo (:mod:`registry_zoo`) builds every model type transformers maps to a
training head from its config class's defaults; those defaults describe billion-parameter
models. :func:`shrink` changes them in place, recursively through the config's sub-configs
(``text_config``, ``vision_config``, ``encoder``/``decoder``, audio towers ...):

- widths to ``HIDDEN``, feed-forward widths to ``INTER``, heads to ``HEADS`` (key/value heads
  to ``KV``, or kept equal to the heads where the default is multi-head, or 1 where it is
  multi-query), every head dimension to ``HIDDEN // HEADS`` (the rotary parts of latent
  attention to 8, GPT-J's ``rotary_dim`` in proportion, M-RoPE sections to half the rotary
  dimensions); a field whose default *equals* any width (or vocabulary) of the tree -- a
  projector's ``out_hidden_size``, OPT's ``word_embed_proj_dim`` -- follows it, and one that is
  a small multiple of a width stays that multiple, so sub-configs stay consistent with each other;
- layers to the fewest that keep one of each layer kind: per-layer lists (``layer_types``,
  any list as long as the layer count), lists of layer indices (``attn_layer_indices``,
  ``cross_attention_layers``) and periods (``attn_layer_period``) are read as one kind per
  layer, and the first layer of each kind is kept (at least two layers);
- vocabularies to ``VOCAB``; special token ids beyond it get distinct ids from the top of the
  new vocabulary (equal ids stay equal), :func:`special_ids` lists them so batches avoid them;
- experts to ``EXPERTS`` routed ``TOP_K`` at a time (groups to match), state-space state,
  heads and head dimensions so that heads x head dimension = expand x width;
- images to ``IMAGE`` pixels in ``PATCH``-pixel patches; a field counting image tokens
  (``image_seq_length``, ``mm_tokens_per_image``) scales with the number of patches (a square
  count stays a square that divides the patch grid), LLaVA-NeXT's tile resolutions with the
  image, the vision layers a projector reads are clamped into the shrunk tower; hierarchical
  vision models keep their stages, one block each, widths in proportion.

Every other field keeps its default (``use_cache``, router logits, attention kind, tied
embeddings, layer drop); :func:`dropout_on` sets every dropout probability to 0.1 as
:func:`zoo._dropout_on` does. The rules are generic on purpose: they are read off names and
default values, not a list of models, so a model type added to transformers is shrunk the same
way. Where they cannot work, :data:`registry_zoo.CONFIG_CHANGES` says so per type, with the reason.
Limits: a derived field that the config computes in ``__init__`` from another one and that is
neither a width, a count nor a per-layer list keeps its default value (the shrinking is done in
place, not through the constructor, so that nothing but sizes changes).
"""
from __future__ import annotations

import re

HIDDEN, INTER, HEADS, KV, LAYERS_MIN = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 256
EXPERTS, TOP_K = 4, 2
IMAGE, PATCH = 32, 4
DROPOUT = 0.1

WIDTH_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "model_dim", "emb_dim",
              "width", "n_embed", "embedding_size", "word_embed_proj_dim", "text_hidden_size", "d_latents",
              "lru_width", "out_hidden_size"}
INTER_KEYS = {"intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
              "ffn_hidden_size", "mlp_dim", "d_inner", "intermediate_dim", "inner_dim"}
LAYER_KEYS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "depth"}
HEAD_KEYS = {"num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
             "n_heads", "attention_heads", "swa_num_attention_heads", "index_n_heads", "linear_num_value_heads",
             "linear_num_heads", "num_attention_heads_per_layer"}
KV_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
           "swa_num_key_value_heads", "linear_num_key_heads"}
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
TOP_K_KEYS = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "router_top_k",
              "num_selected_experts"}
STATE_KEYS = {"state_size", "d_state", "mamba_d_state", "ssm_state_size"}
# (heads, head dimension, expand): a state-space mixer whose heads x head dimension must be expand x width
SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
             ("mamba_num_heads", "mamba_head_dim", "mamba_expand"), ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
# fields counting the image tokens one image becomes: they scale with the number of patches
IMAGE_TOKEN_KEYS = {"image_seq_length", "mm_tokens_per_image", "num_image_tokens", "image_token_count"}
DIMENSION = re.compile(r"(hidden|_dim$|^dim$|_dim_|d_model|embd|embed|intermediate|ffn|d_ff|d_inner|channels$|"
                       r"_size$)")
NOT_A_WIDTH = re.compile(r"(vocab|patch|image|kernel|window|chunk|position|batch|state|group|conv|bucket|"
                         r"block|sample|stride|codebook|cache|buffer|num_|max_|segment|pool|^seq|token)")
_PERIODIC = re.compile(r"(_period|_interval|_frequency|_freq|_pattern)$")


def sub_configs(config) -> dict:
    """{field: sub-config} for the config's nested configs that are set."""
    from transformers import PretrainedConfig
    found = {}
    for key in list(getattr(config, "sub_configs", {}) or {}) + ["text_config", "vision_config", "encoder", "decoder"]:
        value = getattr(config, key, None)
        if isinstance(value, PretrainedConfig):
            found[key] = value
    return found


def _tree(config):
    yield config
    for sub in sub_configs(config).values():
        yield from _tree(sub)


def _ints(config):
    for key, value in config.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool):
            yield key, value


def _set(config, key, value, changed):
    try:
        if getattr(config, key, None) == value:
            return
        setattr(config, key, value)
    except Exception:  # noqa: BLE001 -- a read-only or per-layer property: derived, leave it
        return
    changed.append(key)


def is_token_id(key: str) -> bool:
    return ("token" in key and re.search(r"_(id|ids|index)$", key) is not None) or \
        key in {"unk_index", "mask_index", "pad_index", "bos_index", "eos_index"}


def special_ids(config) -> set:
    """Every special token id of the (shrunk) config tree, so that ordinary tokens avoid them."""
    ids = set()
    for node in _tree(config):
        for key, value in node.to_dict().items():
            if is_token_id(key):
                for one in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(one, int) and not isinstance(one, bool):
                        ids.add(one)
    return ids


def _layer_kinds(config, count: int) -> tuple:
    """(kept layer indices, {field: rewrite}) for a config of ``count`` layers."""
    per_layer, indices = {}, {}
    for key, value in config.to_dict().items():
        if not isinstance(value, (list, tuple)) or key in ("depths", "architectures"):
            continue
        if len(value) == count and count > LAYERS_MIN:
            per_layer[key] = list(value)
        elif value and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < count for v in value) and \
                re.search(r"(layer|idx|ind(ex|ices)|_ids$)", key):
            indices[key] = set(value)
    signatures = [tuple(str(v[i]) for v in per_layer.values()) + tuple(i in v for v in indices.values())
                  for i in range(count)]
    kept = sorted({s: i for i, s in reversed(list(enumerate(signatures)))}.values())
    if len(kept) < LAYERS_MIN:
        kept = list(range(min(LAYERS_MIN, count)))
    rewrites = {key: type(value)([value[i] for i in kept]) if isinstance(value, tuple) else [value[i] for i in kept]
                for key, value in per_layer.items()}
    for key, members in indices.items():
        original = config.to_dict()[key]
        rewrites[key] = type(original)(new for new, old in enumerate(kept) if old in members)
    return kept, rewrites


def shrink(config) -> list:
    """Shrink ``config`` in place (see the module doc); returns the ``sub.field`` names changed."""
    widths, inters, vocabs = set(), set(), set()
    for node in _tree(config):
        for key, value in _ints(node):
            if key in WIDTH_KEYS and value > HIDDEN:
                widths.add(value)
            elif key in INTER_KEYS and value > INTER:
                inters.add(value)
            elif key.endswith("vocab_size") and key != "type_vocab_size" and value > VOCAB:
                vocabs.add(value)
    ids, changed = {}, []
    _shrink_node(config, "", widths, inters, vocabs, ids, changed, patch_ratio=None, mrope=False)
    return changed


def _patch_ratio(config) -> float | None:
    image, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    image = image[0] if isinstance(image, (list, tuple)) else image
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if not (isinstance(image, int) and isinstance(patch, int) and patch > 0 and image >= patch):
        return None
    return (IMAGE // PATCH) ** 2 / (image // patch) ** 2


def _shrink_node(config, prefix, widths, inters, vocabs, ids, changed, patch_ratio, mrope):
    subs = sub_configs(config)
    vision = subs.get("vision_config")
    ratio = _patch_ratio(vision) if vision is not None else _patch_ratio(config)
    ratio = ratio if ratio is not None else patch_ratio
    # a Qwen-style vision tower (video frames in patches) means multimodal RoPE in the text model
    mrope = mrope or isinstance(getattr(vision, "temporal_patch_size", None), int)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    old_image = getattr(vision, "image_size", None)
    if isinstance(pinpoints, (list, tuple)) and isinstance(old_image, int) and old_image > IMAGE:
        # LLaVA-NeXT tiles: resolutions in multiples of the tower's image size, scaled with it
        _set(config, "image_grid_pinpoints", [[v * IMAGE // old_image for v in pair] for pair in pinpoints], changed)
    mine = []
    values = dict(_ints(config))
    count = next((values[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth")
                  if k in values), None)
    if count is not None and count > LAYERS_MIN:
        kept, rewrites = _layer_kinds(config, count)
        for key, value in rewrites.items():
            _set(config, key, value, mine)
        new_count = len(kept)
    else:
        new_count = count
    heads = next((values[k] for k in sorted(HEAD_KEYS) if k in values), None)
    # None where a model derives the value from others (head_dim = width / heads, key/value heads =
    # heads): some configs leave it None and their model does not derive it
    for key, fill in (("head_dim", HEAD_DIM), *((k, HEADS) for k in KV_KEYS), ("vocab_size", VOCAB)):
        if key in config.to_dict() and config.to_dict()[key] is None and heads is not None:
            _set(config, key, fill, mine)
    for key, value in values.items():
        new = _new_int(key, value, values, heads, count, new_count, widths, inters, vocabs, ratio)
        if new is not None:
            _set(config, key, new, mine)
    for key, value in config.to_dict().items():
        if is_token_id(key):
            _set(config, key, _remap(value, ids), mine)
        elif key in ("image_size", "patch_size") and isinstance(value, (list, tuple)) and len(value) == 2:
            _set(config, key, type(value)([IMAGE if key == "image_size" else PATCH] * 2), mine)
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
            _set(config, key, _rope(value, _rotary_half(config), mrope), mine)
    _stages(config, mine)
    _ssm_heads(config, mine)
    changed.extend(prefix + key for key in mine)
    for key, sub in subs.items():
        _shrink_node(sub, f"{prefix}{key}.", widths, inters, vocabs, ids, changed, ratio, mrope)
    if vision is not None:
        _feature_layers(config, vision, changed, prefix)


def _feature_layers(config, vision, changed, prefix):
    """The vision layers a projector reads (``vision_feature_layer(s)``: hidden-state indices)
    clamped into the shrunk tower: as many as before, so the projector's width is unchanged."""
    layers = next((getattr(vision, k) for k in ("num_hidden_layers", "depth", "num_layers")
                   if isinstance(getattr(vision, k, None), int)), None)
    if layers is None:
        return
    for key in ("vision_feature_layer", "vision_feature_layers"):
        value = getattr(config, key, None)
        clamp = (lambda i: max(i, -(layers + 1)) if i < 0 else min(i, layers))
        if isinstance(value, int) and not isinstance(value, bool):
            new = clamp(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(i, int) for i in value):
            new = type(value)(clamp(i) for i in value)
        else:
            continue
        mine = []
        _set(config, key, new, mine)
        changed.extend(prefix + k for k in mine)


def _new_int(key, value, values, heads, count, new_count, widths, inters, vocabs, ratio):
    """The shrunk value of the int field ``key`` (None: keep the default)."""
    if key == "head_dim" and value == values.get("qk_rope_head_dim"):
        return 8 if value > 8 else None  # DeepSeek: the rotary part of a multi-head latent attention head
    if key == "rotary_dim":  # GPT-J, CodeGen: rotary on this many of each head's dimensions
        old = values.get("head_dim") or (next(iter(widths), 0) // heads if heads else 0)
        return max(2, value * HEAD_DIM // old // 2 * 2) if old and value > HEAD_DIM // 4 else None
    if key in LAYER_KEYS:
        return new_count if value == count and new_count is not None else min(value, LAYERS_MIN)
    if key in WIDTH_KEYS or (value in widths and DIMENSION.search(key) and not NOT_A_WIDTH.search(key)):
        return HIDDEN if value > HIDDEN else None
    if key in INTER_KEYS or "intermediate" in key or (value in inters and DIMENSION.search(key)
                                                        and not NOT_A_WIDTH.search(key)):
        return INTER if value > INTER else None
    multiple = next((value // w for w in sorted(widths) if value % w == 0 and 2 <= value // w <= 8), None)
    if multiple and DIMENSION.search(key) and not NOT_A_WIDTH.search(key) and "intermediate" not in key:
        return HIDDEN * multiple  # Zamba's attention over [hidden, embeddings]: twice the width
    if (key.endswith("vocab_size") and key != "type_vocab_size") or (value in vocabs and (
            "vocab" in key or "offset" in key)):
        return VOCAB if value > VOCAB else None
    if key in HEAD_KEYS:
        return HEADS if value > HEADS else None
    if key in KV_KEYS:
        return value if value == 1 else HEADS if value == heads else KV
    if key.endswith(("head_dim", "head_size", "_kv", "dim_head", "d_head")) or key in (
            "kv_channels", "attention_head_dim", "linear_key_head_dim", "linear_value_head_dim"):
        return (8 if "rope" in key or "nope" in key else HEAD_DIM) if value > HEAD_DIM else None
    if key in ("kv_lora_rank", "q_lora_rank"):
        return 32 if value > 32 else None
    if key in EXPERT_KEYS:
        return EXPERTS if value > EXPERTS else None
    if key in TOP_K_KEYS:
        return min(value, TOP_K)
    if key in ("n_group", "num_expert_group"):
        return min(value, 2)
    if key == "topk_group":
        return min(value, 1)
    if key in ("first_k_dense_replace", "num_dense_layers"):
        return min(value, 1)  # one dense layer, then a MoE one
    if _PERIODIC.search(key):
        return min(value, 2) if value > 0 else None
    if key.endswith("_offset") and key.replace("_offset", "_period") in values:
        return 1 if value % values[key.replace("_offset", "_period")] else 0
    if key in STATE_KEYS:
        return 16 if value > 16 else None
    if key in ("time_step_rank", "mamba_dt_rank", "dt_rank"):
        return 8 if value > 8 else None
    if key == "image_size":
        return IMAGE if value > IMAGE else None
    if key == "patch_size":
        return PATCH if value > PATCH else None
    if key in IMAGE_TOKEN_KEYS and ratio is not None:
        return _image_tokens(value, ratio)
    return None


def _image_tokens(value: int, ratio: float) -> int:
    """An image token count scaled with the patches; a square one (tokens pooled from a square
    patch grid) stays square and divides the new grid, as the pooling needs."""
    side = round(value ** 0.5)
    if side * side != value:
        return max(1, round(value * ratio))
    grid = IMAGE // PATCH
    wanted = side * ratio ** 0.5
    return max(d for d in range(1, grid + 1) if grid % d == 0 and d <= max(1.0, wanted)) ** 2


def _remap(value, ids):
    """A special token id beyond the tiny vocabulary -> a distinct id from its top (equal ids stay equal)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_remap(v, ids) for v in value)
    if not isinstance(value, int) or isinstance(value, bool) or value < VOCAB:
        return value
    if value not in ids:
        ids[value] = VOCAB - 1 - len(ids)
    return ids[value]


def _rotary_half(config) -> int:
    """Half the rotary dimensions of one (shrunk) attention head: what M-RoPE sections sum to."""
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (HIDDEN // heads if isinstance(heads, int) and heads else HEAD_DIM)
    params = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or params.get("partial_rotary_factor") or 1.0
    return max(3, int(head_dim * factor) // 2)


# the section a Qwen2-VL-style model falls back to when its config names none (for 128-dim heads)
MROPE_DEFAULT = (16, 24, 24)


def _rope(params: dict, half: int, mrope: bool) -> dict:
    """M-RoPE sections sum to half the rotary dimensions: scaled to the new ones, keeping their
    ratios (the model's own default section, scaled, where the config names none)."""
    params = {k: (_rope(v, half, mrope) if isinstance(v, dict) else v) for k, v in params.items()}
    if not any(isinstance(v, dict) for v in params.values()) and mrope and "mrope_section" not in params:
        params["mrope_section"] = list(MROPE_DEFAULT)
    section = params.get("mrope_section")
    if isinstance(section, (list, tuple)) and sum(section) != half:
        total = sum(section)
        scaled = [max(1, s * half // total) for s in section]
        scaled[-1] += half - sum(scaled)
        params["mrope_section"] = type(section)(scaled)
    return params


def _ssm_heads(config, changed):
    """heads x head dimension = expand x width for a Mamba-2 style mixer (the width is already shrunk)."""
    width = getattr(config, "hidden_size", None)
    for heads, dim, expand in SSM_HEADS:
        factor = getattr(config, expand, None)
        if not (isinstance(getattr(config, heads, None), int) and isinstance(getattr(config, dim, None), int)
                and isinstance(factor, (int, float)) and isinstance(width, int)):
            continue
        inner = int(factor * width)
        if isinstance(getattr(config, "mamba_d_ssm", None), int):  # Falcon-H1: the mixer's own width
            inner = 2 * HIDDEN
            _set(config, "mamba_d_ssm", inner, changed)
        _set(config, dim, HEAD_DIM, changed)
        _set(config, heads, inner // HEAD_DIM, changed)
        for groups in ("n_groups", "mamba_n_groups"):
            value = getattr(config, groups, None)
            if isinstance(value, int) and value > 1 and getattr(config, heads) % value:
                _set(config, groups, 1, changed)


STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "dims", "channels", "hidden_dims", "embed_dim_per_stage")


STAGE_DEPTH = {"poolformer": 2, "pvt": 2}
"""Layers per stage where one is too few: PoolFormer's and PVT's stages are lists of layers that their
encoders loop over, and a list of one layer is no block list, so at depth 1 their blocks would be the
patch embeddings alone (a conv, whose checkpoint saves what it saves untouched: its input)."""


def _stages(config, changed):
    """Hierarchical vision models (ResNet, ConvNeXt, Swin ...): one block per stage, stage widths
    scaled so the widest is ``2 * INTER`` (their ratios kept, multiples of 32 for GroupNorm's 32
    groups), per-stage heads so that the first is 1."""
    values = config.to_dict()
    for key in STAGE_WIDTHS:
        widths = values.get(key)
        if isinstance(widths, (list, tuple)) and widths and all(isinstance(w, int) for w in widths) and \
                max(widths) > 2 * INTER:
            _set(config, key, type(widths)(max(32, w * 2 * INTER // max(widths) // 32 * 32) for w in widths),
                 changed)
    depths = values.get("depths")
    if isinstance(depths, (list, tuple)) and depths and all(isinstance(d, int) for d in depths):
        most = STAGE_DEPTH.get(config.model_type, 1)
        _set(config, key="depths", value=type(depths)(min(d, most) for d in depths), changed=changed)

    for key in ("num_heads", "num_attention_heads", "heads"):
        heads = values.get(key)
        if isinstance(heads, (list, tuple)) and heads and all(isinstance(h, int) and h > 0 for h in heads):
            _set(config, key, type(heads)(max(1, h // min(heads)) for h in heads), changed)


def dropout_on(config) -> None:
    """Every dropout probability of the tree to DROPOUT (LayerDrop stays), as :func:`zoo._dropout_on`."""
    for node in _tree(config):
        for key, value in node.to_dict().items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    ("dropout" in key or key.endswith("pdrop")) and "layerdrop" not in key:
                try:
                    setattr(node, key, DROPOUT)
                except Exception:  # noqa: BLE001 -- a field typed int (MPT's attn_pdrop): left as it is
                    pass
