"""The zoo built from the registry (issue 29): every model type transformers maps to a training head.

:func:`registry` walks transformers' auto mappings -- vision-language (image-text-to-text),
seq2seq LM, masked LM, causal LM, image classification, in that order of preference for a
type that several map (BERT is trained as a masked LM, Gemma 3 with its images) -- and gives
one :class:`Entry` per model type. :func:`case` turns an entry into a :class:`zoo.Case`: the
config class's defaults shrunk by :func:`registry_configs.shrink` (sizes only, every other
default kept, dropout 0.1), the model built from it, and the batch a user gives its head:

- causal / masked / seq2seq LM: token ids, attention mask and labels (``zoo``'s batches, with
  ordinary tokens drawn away from the config's special ids);
- image classification: pixels of the config's size and channels, five labels;
- vision-language: one image per sample and the text laid out as a processor lays it out:
  ``[start] image-token x n [end]`` amid ordinary tokens, where n is what the model's own
  ``get_image_features`` makes of one image and start/end are the config's image start/end
  (or begin/end-of-image) ids; Qwen-style towers (a ``temporal_patch_size``) take flattened
  patches and ``image_grid_thw``. Labels are the text; image tokens are ignored.

A case that cannot be built (a config class whose defaults do not validate, a model that needs
inputs no config describes, an untouched training step that fails) raises :class:`NotBuilt`
with the reason; it is not a remat failure. :mod:`registry_cells` runs and classifies the
treatments and ``remat.plan`` on a case; ``benchmarks/zoo_sweep.py`` runs them all, one process
per model type; ``tests/test_registry_zoo.py`` runs a few per family in ``make test``.
Limits: one image per sample at one size; a VLM whose processor lays out more than its config
says (tile grids it picks per image, Q-Former prompts, per-image position masks) is not built.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

import registry_configs as rc
import zoo

BATCH, SEQ, TARGET = 2, 12, 7
N_LABELS = 5
HEAD_ORDER = (("vlm", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
              ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
              ("masked_lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
              ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
              ("image_classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"))
# per-type changes the generic shrinker cannot make, each with why; applied after shrinking
CONFIG_CHANGES = {
    # defaults with no attention layer at all: the untouched model's training step with use_cache on
    # fails inside transformers (get_seq_length on a cache of linear-attention layers only);
    # every released checkpoint of these has attention layers
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # blocks cycle (recurrent, recurrent, attention): three layers keep one of each kind
    "recurrent_gemma": {"num_hidden_layers": 3},
    # a shared attention block tied across hybrid layers: a single hybrid layer does not build
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 128, "attention_head_dim": 32},
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
               "hybrid_layer_ids": [1, 2], "attention_hidden_size": 128, "attention_head_dim": 32},
    # the last num_kv_shared_layers reuse the cache of an earlier layer of their kind: two of each
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    # axial position embeddings: their widths sum to the hidden size and their shape multiplies to
    # the training sequence length
    "reformer": {"axial_pos_embds_dim": (32, 32), "axial_pos_shape": (3, 4)},
    # EfficientNet's defaults are B7's compound scaling (64M parameters at any width): B0's coefficients
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
    # the recurrent state's head size rounds the qk width up to 64 while the layer does not: below a width
    # of 128 the untouched model's cache does not fit its own layers (its default use_cache=True builds one)
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "num_blocks": 2},
}
# models that refuse dropout (DiffLlama: "no paper-defined dropout semantics"): left at their default 0
NO_DROPOUT = {"diffllama"}
# a model that needs one call before training, as its documentation says
MODEL_HOOKS = {"xmod": lambda model: model.set_default_language("en_XX")}
# EncoderDecoderConfig has no defaults: it is two configs a user picks; BERT to BERT is the documented pairing
OVERRIDES = {"encoder-decoder": lambda: _encoder_decoder()}


class NotBuilt(zoo.Unavailable):
    """The harness could not build this model type (the reason says why); not a remat failure."""


@dataclass(frozen=True)
class Entry:
    """One model type of the registry and the training head it is built with."""

    model_type: str
    head: str
    """``vlm``, ``seq2seq``, ``masked_lm``, ``causal_lm`` or ``image_classification``."""
    class_name: str
    """The transformers class the mapping names for that head."""


def registry() -> dict:
    """{model type: Entry}, every type that one of the five head mappings names, sorted."""
    from transformers.models.auto import modeling_auto
    entries = {}
    for head, mapping in HEAD_ORDER:
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            if model_type not in entries:
                name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
                entries[model_type] = Entry(model_type=model_type, head=head, class_name=name)
    return dict(sorted(entries.items()))


def first_line(error: BaseException, width: int = 400) -> str:
    """``Type: first line of the message``: what a table cell or a reason quotes."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= width else text[: width - 3] + "..."


def _encoder_decoder():
    from transformers import BertConfig, EncoderDecoderConfig
    encoder, decoder = BertConfig(), BertConfig(is_decoder=True, add_cross_attention=True)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.pad_token_id = decoder.pad_token_id
    return config


def config_for(entry: Entry):
    """The entry's config: its model class's config defaults (or :data:`OVERRIDES`), shrunk,
    :data:`CONFIG_CHANGES` applied, dropout on."""
    cls = _class(entry)
    try:
        config = OVERRIDES[entry.model_type]() if entry.model_type in OVERRIDES else cls.config_class()
    except Exception as error:  # noqa: BLE001 -- any failure of the defaults is a reason to report
        raise NotBuilt(f"{cls.config_class.__name__} defaults do not build: {first_line(error)}") from None
    try:
        rc.shrink(config)
    except Exception as error:  # noqa: BLE001
        raise NotBuilt(f"the config cannot be shrunk field by field: {first_line(error)}") from None
    for key, value in CONFIG_CHANGES.get(entry.model_type, {}).items():
        setattr(config, key, value)
    if entry.model_type not in NO_DROPOUT:
        rc.dropout_on(config)
    if entry.head == "image_classification":
        config.num_labels = N_LABELS
    if entry.head == "vlm":
        _query_token(config)
    if _is_seq2seq(entry, config) and getattr(config, "decoder_start_token_id", None) is None:
        # released checkpoints set it (T5: the pad id); without it the model cannot shift labels right
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


def _query_token(config) -> None:
    """BLIP-2 and InstructBLIP leave ``image_token_index`` None in their defaults; their processors
    set it and lay out one such token per Q-Former query: a free id at the top of the vocabulary."""
    if getattr(config, "image_token_index", 0) is None and isinstance(getattr(config, "num_query_tokens", None), int):
        taken = rc.special_ids(config)
        config.image_token_index = max(i for i in range(rc.VOCAB) if i not in taken)


def _is_seq2seq(entry: Entry, config) -> bool:
    """A seq2seq head on an encoder-decoder (its forward takes ``decoder_input_ids``); the seq2seq
    mapping also lists decoder-only audio LMs (Voxtral, Qwen2-Audio), which train on text as causal LMs do."""
    return entry.head == "seq2seq" and "decoder_input_ids" in inspect.signature(_class(entry).forward).parameters


def _class(entry: Entry):
    import transformers
    cls = getattr(transformers, entry.class_name, None)
    if cls is None:
        raise NotBuilt(f"transformers has no {entry.class_name}")
    return cls


MAX_PARAMS = 20_000_000


def build_model(entry: Entry) -> nn.Module:
    """The entry's model in train mode, seeded (two builds are identical)."""
    config, cls = config_for(entry), _class(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in cls._from_config(config).parameters())
        except Exception:  # noqa: BLE001 -- some models cannot be built on meta; the real build says why
            size = 0
        if size > MAX_PARAMS:
            raise NotBuilt(f"{size / 1e6:.0f}M parameters after shrinking: a size field the shrinker does not know")
        torch.manual_seed(0)
        try:
            model = cls._from_config(config)
        except Exception as error:  # noqa: BLE001
            raise NotBuilt(f"{entry.class_name} does not build from the shrunk config: {first_line(error)}") from None
    if entry.model_type in MODEL_HOOKS:
        MODEL_HOOKS[entry.model_type](model)
    return model.train()


# ----------------------------------------------------------------------------- batches

def _ordinary(config) -> torch.Tensor:
    special = rc.special_ids(config)
    text = getattr(config, "text_config", None) or getattr(config, "decoder", None) or config
    vocab = min(v for v in (getattr(config, "vocab_size", None), getattr(text, "vocab_size", None), rc.VOCAB)
                if isinstance(v, int))
    return torch.tensor([i for i in range(3, vocab) if i not in special])


def _ids(config, seq=SEQ, seed=1) -> torch.Tensor:
    pool = _ordinary(config)
    generator = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, len(pool), (BATCH, seq), generator=generator)]


def _lm_batch(layout, model):
    ids = _ids(model.config)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _mlm_batch(layout, model):
    ids = _ids(model.config)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _seq2seq_batch(layout, model):
    ids = _ids(model.config)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(model.config, TARGET, seed=2)}


def _size(config, key="image_size", default=rc.IMAGE) -> int:
    value = getattr(config, key, None)
    value = value[0] if isinstance(value, (list, tuple)) else value
    return value if isinstance(value, int) and value > 0 else default


def _channels(config) -> int:
    return next((v for v in (getattr(config, k, None) for k in ("num_channels", "in_channels", "in_chans"))
                 if isinstance(v, int) and v > 0), 3)


def _image_batch(layout, model):
    config = model.config
    vision = getattr(config, "vision_config", None) or config
    size = _size(vision)
    generator = torch.Generator().manual_seed(2)
    return {"pixel_values": torch.randn(BATCH, _channels(vision), size, size, generator=generator),
            "labels": torch.randint(0, N_LABELS, (BATCH,), generator=generator)}


def _pixels(config) -> dict:
    """One image per sample as the model's vision tower takes it."""
    vision = config.vision_config
    generator = torch.Generator().manual_seed(2)
    temporal = getattr(vision, "temporal_patch_size", None)
    if isinstance(temporal, int):  # Qwen-style: flattened patches and a (t, h, w) grid per image
        patch = _size(vision, "patch_size", rc.PATCH)
        side = rc.IMAGE // patch
        return {"pixel_values": torch.randn(BATCH * side * side, _channels(vision) * temporal * patch * patch,
                                            generator=generator),
                "image_grid_thw": torch.tensor([[1, side, side]] * BATCH)}
    size = _size(vision)
    return {"pixel_values": torch.randn(BATCH, _channels(vision), size, size, generator=generator)}


def _token(config, *keys) -> Optional[int]:
    for node in (config, getattr(config, "text_config", None)):
        for key in keys:
            value = getattr(node, key, None) if node is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _image_features(model, pixels: dict):
    """The model's own ``get_image_features`` on ``pixels`` (eval, no grad, the RNG untouched)."""
    was = model.training
    with torch.random.fork_rng(), torch.no_grad():
        model.eval()
        try:
            return model.get_image_features(**pixels)
        finally:
            model.train(was)


def _count_rows(out) -> int:
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = out[0] if isinstance(out, tuple) else out
    return sum(t.numel() // t.shape[-1] for t in (features if isinstance(features, (list, tuple)) else [features]))


def _image_inputs(model) -> tuple:
    """(pixel inputs, image tokens per image): the first layout of one image per sample that
    the model's own ``get_image_features`` takes -- 4-D pixels, then with ``image_sizes`` (Pixtral,
    LLaVA-NeXT), then 5-D (one image of one tile: Idefics, SmolVLM)."""
    if getattr(type(model), "get_image_features", None) is None:
        raise NotBuilt(f"{type(model).__name__} has no get_image_features: its image tokens cannot be counted")
    pixels = _pixels(model.config)
    size = _size(model.config.vision_config)
    sizes = {"image_sizes": torch.tensor([[size, size]] * BATCH)}
    candidates = [pixels, {**pixels, **sizes}]
    if pixels["pixel_values"].dim() == 4:  # 5-D: tiles of one image (LLaVA-NeXT: the image and its tiles)
        for tiles in (1, 2, 3, 5):
            five = pixels["pixel_values"][:, None].expand(-1, tiles, -1, -1, -1).contiguous()
            candidates += [{"pixel_values": five}, {"pixel_values": five, **sizes}]
    last = None
    for candidate in candidates:
        try:
            return candidate, _count_rows(_image_features(model, candidate)) // BATCH
        except Exception as error:  # noqa: BLE001 -- the next layout may be the one
            last = error
    raise NotBuilt(f"get_image_features takes no {rc.IMAGE}-pixel image per sample as 4-D or 5-D pixels "
                   f"(with or without image_sizes): {first_line(last)}")


def _vlm_layout(model) -> dict:
    config = model.config
    if getattr(config, "vision_config", None) is None:
        raise NotBuilt("no vision_config: the image inputs cannot be built from the config")
    image = _token(config, "image_token_id", "image_token_index")
    if image is None:  # the model places the image itself (BLIP-2, GIT, Fuyu ...): text and pixels
        return {"pixels": _pixels(config), "image": None, "count": 0, "start": None, "end": None}
    pixels, count = _image_inputs(model)
    return {"pixels": pixels, "image": image, "count": count,
            "start": _token(config, "vision_start_token_id", "image_start_token_id", "boi_token_id",
                            "boi_token_index"),
            "end": _token(config, "vision_end_token_id", "image_end_token_id", "eoi_token_id", "eoi_token_index")}


def _vlm_batch(layout, model):
    config = model.config
    text = _ids(config, seq=10)
    image = [] if layout["image"] is None else [t for t in (layout["start"],) if t is not None] + \
        [layout["image"]] * layout["count"] + [t for t in (layout["end"],) if t is not None]
    ids = torch.cat([text[:, :2], torch.tensor([image] * BATCH, dtype=torch.long).view(BATCH, -1), text[:, 2:]], dim=1)
    labels = ids.clone()
    labels[:, : 2 + len(image)] = -100
    labels[0, :3] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    batch.update({k: v.clone() for k, v in layout["pixels"].items()})
    forward = inspect.signature(type(model).forward).parameters
    if "mm_token_type_ids" in forward:
        batch["mm_token_type_ids"] = (ids == layout["image"]).long()  # the processor's: 1 on image tokens
    if "qformer_input_ids" in forward:  # InstructBLIP's processor gives the Q-Former the prompt too
        batch["qformer_input_ids"], batch["qformer_attention_mask"] = ids.clone(), torch.ones_like(ids)
    return batch


BATCHES = {"causal_lm": _lm_batch, "masked_lm": _mlm_batch, "seq2seq": lambda layout, model: layout["batch"](
    layout, model),
           "image_classification": _image_batch, "vlm": _vlm_batch}


def _build_case(entry: Entry, layout: dict) -> nn.Module:
    model = build_model(entry)
    layout["batch"] = _seq2seq_batch if _is_seq2seq(entry, model.config) else _lm_batch
    forward = inspect.signature(type(model).forward).parameters
    wanted = "pixel_values" if entry.head == "image_classification" else "input_ids"
    if wanted not in forward:
        raise NotBuilt(f"{entry.class_name}.forward takes no {wanted} "
                       f"(takes {', '.join(list(forward)[1:4])})")
    if entry.head == "vlm":
        layout.update(_vlm_layout(model))
    return model


def _pi0_case() -> zoo.Case:
    """PI0: a vision-language model whose KV cache of the images and the prompt an action expert attends
    to, inside the training forward (the forward asks for it with ``use_cache=True``); its config holds
    the two models' configs (no ``vision_config`` of its own) and its batch a robot's state and actions,
    the flow-matching noise and time: built by hand, at the smallest sizes its tests use."""
    def build():
        from transformers import PI0Config, PI0ForConditionalGeneration
        gemma = {"model_type": "gemma", "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
                 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
        vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4, "image_size": 8}
        config = PI0Config(vlm_config={"vision_config": vision, "text_config": gemma, "image_token_index": 127,
                                       "projection_dim": 16}, dit_config=gemma, chunk_size=4, max_state_dim=8,
                           max_action_dim=8)
        rc.dropout_on(config)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PI0ForConditionalGeneration(config).train()

    def batch(model):
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 126, (BATCH, 13), generator=generator)
        ids[:, :8] = 127  # two images of four patches each, then the prompt
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(BATCH, 2, 3, 8, 8, generator=generator),
                "pixel_attention_mask": torch.ones(BATCH, 2, dtype=torch.bool),
                "state": torch.randn(BATCH, 8, generator=generator),
                "actions": torch.randn(BATCH, 4, 8, generator=generator),
                "noise": torch.randn(BATCH, 4, 8, generator=generator), "timestep": torch.tensor([0.3, 0.7])}
    return zoo.Case("pi0", build, batch, zoo._hf_loss)


# model types the registry's generic builders cannot build, each built by hand (the function says why)
BY_HAND = {"pi0": _pi0_case}


@functools.lru_cache(maxsize=None)
def case(model_type: str) -> zoo.Case:
    """The zoo case of a registry model type (built on first use; :class:`NotBuilt` then)."""
    if model_type in BY_HAND:
        return BY_HAND[model_type]()
    entry = registry()[model_type]
    layout = {}
    return zoo.Case(model_type, functools.partial(_build_case, entry, layout),
                    functools.partial(BATCHES[entry.head], layout), zoo._hf_loss,
                    lm_batch=entry.head != "image_classification")


MAX_GRAD_NORM = 1e8
"""An untouched step's gradient beyond this norm means a degenerate tiny model (BLIP-2's query
tokens initialise to zeros, so a LayerNorm of identical rows divides by sqrt(eps): 1e18): the
noise floor of the comparison scales with the largest gradient, so it would hide any error."""


def check_built(the_case: zoo.Case) -> None:
    """Build the case and run one untouched training step; :class:`NotBuilt` with the reason if
    either fails, or if the step's loss or gradients are not usable for a comparison."""
    model, twin = zoo.build(the_case), zoo.build(the_case)
    try:
        torch.manual_seed(0)
        loss = the_case.loss(model, the_case.batch(model))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise NotBuilt(f"the model returns no scalar loss for its batch (got {type(loss).__name__})")
        if not torch.isfinite(loss):
            raise NotBuilt(f"the untouched model's loss is {loss.item()}")
        loss.backward()
        torch.manual_seed(0)
        again = the_case.loss(twin, the_case.batch(twin))
    except NotBuilt:
        raise
    except Exception as error:  # noqa: BLE001
        raise NotBuilt(f"the untouched model's training step fails: {first_line(error)}") from None
    if not torch.equal(loss.detach(), again.detach()):  # Reformer seeds its LSH and dropout from torch.seed()
        raise NotBuilt(f"the untouched model is not deterministic under a fixed seed (loss {loss.item()!r}, then "
                       f"{again.item()!r}): nothing can be compared with it")
    norm, name = max(((float(p.grad.norm()), n) for n, p in model.named_parameters() if p.grad is not None),
                     default=(0.0, ""))
    if not norm < MAX_GRAD_NORM:
        raise NotBuilt(f"the untouched model's first gradient reaches norm {norm:.1e} ({name}): degenerate at "
                       "this size, so one SGD step leaves nothing to compare")
