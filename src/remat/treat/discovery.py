"""Find a model's repeated blocks, their attention/MLP sub-modules and its LM head.

How: a *block list* is an ``nn.ModuleList`` or ``nn.Sequential`` holding two or more
callable non-leaf modules that carry parameters and are all of one class (a ModuleList of mixed
classes is accepted when every class is named like a layer or block, as in hybrid
models). Of all such lists, only the outermost are kept: the experts list inside a
Mixtral layer is not a block list, because it lives inside one. This needs no
per-model code and covers decoder-only LMs (``model.layers``, ``transformer.h``,
``gpt_neox.layers``), encoders (``encoder.layer``), encoder-decoders (two lists),
vision transformers, PEFT wrappers (the lists are found wherever they are nested),
plain ``nn.Module`` stacks and a model that *is* its block list (a root ``nn.Sequential``
of residual blocks: the blocks are then named ``"0"``, ``"1"`` ... and the container ``""``).
Where no list holds two, a list holding one module named like a layer or block is taken
(outermost first): ALBERT keeps one ``AlbertLayerGroup`` in ``albert_layer_groups`` and calls
it for every layer, so that one module is its block, called N times a step (the profiler sees
the calls: :mod:`remat.planning.calls`); a one-layer model is found the same way.

The obvious alternative, a table of known attribute paths per architecture, breaks on
every new model family; the structural rule breaks only on models without repeated
blocks, and then the error lists what was found, why each container was not taken, and
how to pass ``blocks=``. A single block of another class (or blocks that change shape, as in a
UNet) is treated by naming it with ``blocks=``.

The LM head is ``get_output_embeddings()`` where a Hugging Face model has one, else a
top-level ``nn.Linear`` named like a head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch.nn as nn

BlockSelector = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]

_LAYERISH = re.compile(r"(Layer|Block|Stage)", re.IGNORECASE)
# "attention" is the block's token mixer: attention, or in hybrid and state-space models the
# mamba / linear-attention / short-convolution mixer that takes its place (Jamba, Bamba, LFM2,
# Qwen3-Next, Mamba): what mixes tokens is what holds the sequence-long intermediates
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention", "SelfAttention", "mamba",
                    "mixer", "linear_attn", "temporal_block")
_ATTENTION_CLASS = re.compile(r"(Attention|Mamba\w*Mixer|Mixer$|DeltaNet|ShortConv|MambaLayer)")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "ff", "block_sparse_moe", "intermediate")
_MLP_CLASS = re.compile(r"(MLP|Mlp|FeedForward|FFN|LayerFF|Intermediate|MoE|Moe|Experts)")
_KINDS = {"attention": (_ATTENTION_NAMES, _ATTENTION_CLASS), "mlp": (_MLP_NAMES, _MLP_CLASS)}
_NEITHER = re.compile(r"(Norm|Embedding)")
_HEAD_NAMES = ("lm_head", "head", "output", "embed_out", "classifier")


@dataclass(frozen=True)
class Structure:
    """What discovery found: block names in forward order and the LM head's name."""

    block_lists: tuple  # qualified names of the containers, e.g. ("model.layers",)
    block_names: tuple  # qualified names of every block, in container order
    head_name: Optional[str]

    def blocks(self, model: nn.Module) -> list:
        """``[(name, module), ...]`` for this structure's blocks in ``model``."""
        modules = dict(model.named_modules(remove_duplicate=False))
        return [(name, modules[name]) for name in self.block_names]


def discover(model: nn.Module, blocks: BlockSelector = None) -> Structure:
    """Find the blocks (and LM head) of ``model``.

    Args:
        model: the model.
        blocks: None (automatic discovery: two or more like blocks in a container, or one named like
            a layer; module doc), or an override: a qualified name -- of an ``nn.ModuleList`` or
            ``nn.Sequential`` (``"model.layers"``; ``""`` is the model itself), whose children are
            then the blocks, or of any other module, which is then the one block -- a list of block
            names, or a predicate ``(name, module) -> bool`` selecting blocks.

    Returns:
        A :class:`Structure`: the block containers, the block names in forward order, the head's name.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no blocks found, or ``blocks`` names no module (or an empty container).

    Example::

        remat.discover(model).block_names[:2]   # ('model.layers.0', 'model.layers.1')"""
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat expects a torch.nn.Module, got {type(model).__name__}")
    if blocks is None:
        lists = _outermost(_candidate_lists(model)) or _outermost(_single_layers(model))
        if not lists:
            raise ValueError(_not_found_message(model))
        names = tuple(_join(list_name, child) for list_name, container in lists
                      for child, _ in container.named_children())
        return Structure(tuple(name for name, _ in lists), names, find_head(model))
    return Structure((), _select(model, blocks), find_head(model))


def _select(model: nn.Module, selector: BlockSelector) -> tuple:
    modules = dict(model.named_modules(remove_duplicate=False))
    if isinstance(selector, str):
        if selector not in modules:
            raise ValueError(f"blocks={selector!r} names no module of {type(model).__name__}; "
                             f"containers found: {_container_names(model) or 'none'}")
        container = modules[selector]
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            names = tuple(_join(selector, child) for child, _ in container.named_children())
            if not names:
                raise ValueError(f"blocks={selector!r} is an empty {type(container).__name__}")
            return names
        if not selector:
            raise ValueError(f"blocks='' names the model itself, a {type(model).__name__}, which is not an "
                             "nn.ModuleList/nn.Sequential: remat treats blocks inside a model, not the whole "
                             f"model; containers found: {_container_names(model) or 'none'}")
        return (selector,)
    if callable(selector):
        names = tuple(name for name, module in modules.items() if name and selector(name, module))
    else:
        names = tuple(selector)
        missing = [name for name in names if name not in modules]
        if missing:
            raise ValueError(f"blocks= names not found in the model: {missing[:5]}")
        if "" in names:
            raise ValueError("blocks= lists '' (the model itself): remat treats blocks inside a model; "
                             "name the blocks, or pass blocks='' alone if the model is an "
                             "nn.Sequential/nn.ModuleList of blocks")
    if not names:
        raise ValueError("blocks= selected no module; check the predicate or names against "
                         "[name for name, _ in model.named_modules()]")
    nested = [b for b in names if any(b.startswith(a + ".") for a in names)]
    if nested:
        raise ValueError(f"blocks= selected modules nested in other selected blocks: {nested[:5]}; "
                         "select only the outermost repeated modules")
    return names


def _candidate_lists(model: nn.Module) -> list:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and _rejection(module) is None]


def _single_layers(model: nn.Module) -> list:
    """Lists of one block-like module named like a layer or block (ALBERT's shared layer group):
    what discovery takes where no list holds two."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) == 1
            and _is_block_like(module[0]) and _LAYERISH.search(type(module[0]).__name__)]


def _rejection(container: nn.Module) -> Optional[str]:
    """Why ``container`` is not a block list, or None if it is one."""
    children = list(container.children())
    if len(children) < 2:
        return "only one module" if children else "empty"
    if not all(_is_block_like(c) for c in children):
        plain = sorted({type(c).__name__ for c in children if not _is_block_like(c)})
        return f"holds single layers or modules without parameters ({', '.join(plain[:4])})"
    classes = {type(c) for c in children}
    if len(classes) == 1 or (isinstance(container, nn.ModuleList)
                             and all(_LAYERISH.search(c.__name__) for c in classes)):
        return None
    return "mixed classes"


def _is_block_like(module: nn.Module) -> bool:
    """A module a forward calls, with sub-modules and parameters. Not an ``nn.ModuleList`` or
    ``nn.ModuleDict``: those have no forward (PoolFormer's stages are lists of layers, each called
    by the encoder's loop), so treating one would change nothing; their own layers are the blocks."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    has_children = next(module.children(), None) is not None
    has_params = next(module.parameters(), None) is not None
    return has_children and has_params


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _outermost(lists: list) -> list:
    names = [name for name, _ in lists]
    if "" in names:  # the model is its own block list: every other list lies inside its blocks
        return [(name, m) for name, m in lists if name == ""]
    return [(name, m) for name, m in lists
            if not any(name.startswith(other + ".") for other in names if other != name)]


def _describe(name: str, container: nn.Module) -> str:
    where = f"the model itself ({type(container).__name__})" if not name else \
        f"{name} ({type(container).__name__})"
    classes = sorted({type(c).__name__ for c in container.children()})
    return f"{where}: {len(container)} x {classes}"


def _container_names(model: nn.Module) -> list:
    return [_describe(name, m) for name, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]


def _not_found_message(model: nn.Module) -> str:
    containers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
    found = [f"{_describe(name, m)} -- not taken: {_rejection(m)}" for name, m in containers[:12]]
    if len(containers) > 12:
        found.append(f"... and {len(containers) - 12} more")
    listing = "\n  ".join(found) if found else (
        f"none: {type(model).__name__} holds no nn.ModuleList or nn.Sequential at all")
    single = [name for name, m in containers if len(m) == 1 and _is_block_like(next(m.children()))]
    example = repr(single[0]) if single else repr(containers[0][0]) if containers else "'layers.0'"
    return ("remat could not find repeated blocks in "
            f"{type(model).__name__}: automatic discovery looks for an nn.ModuleList/nn.Sequential "
            "(the model itself included) of two or more same-class modules with parameters. "
            "Containers found:\n  " + listing +
            f"\nName the blocks explicitly (one is enough), e.g. remat.apply(model, 'full', blocks={example}) "
            "for a container's children or a single module, blocks=['down.0', 'up.0'] for a list of "
            "modules, or blocks=lambda name, module: isinstance(module, MyBlock).")


def find_head(model: nn.Module) -> Optional[str]:
    """Qualified name of the LM head (output embedding), or None if there is none."""
    head = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except (AttributeError, NotImplementedError):
            head = None
    if head is not None:
        for name, module in model.named_modules():
            if module is head:
                return name
    for name in _HEAD_NAMES:
        module = getattr(model, name, None)
        if isinstance(module, nn.Linear):
            return name
    return None


def find_submodules(block: nn.Module, kind: str) -> list:
    """``[(relative_name, module)]`` of the block's attention (token mixer) or MLP sub-modules.

    Searches breadth-first and returns every match at the shallowest depth that has one
    (T5's decoder block has self- and cross-attention side by side: both are returned).
    """
    if kind not in ("attention", "mlp"):
        raise ValueError(f"kind must be 'attention' or 'mlp', got {kind!r}")
    level = [("", block)]
    for _ in range(3):
        next_level, matches = [], []
        for prefix, parent in level:
            for child_name, child in parent.named_children():
                full = f"{prefix}{child_name}"
                if _is_kind(child_name, type(child).__name__, kind):
                    matches.append((full, child))
                else:
                    next_level.append((full + ".", child))
        if matches:
            return matches
        level = next_level
    return []


def _is_kind(name: str, cls: str, kind: str) -> bool:
    """Whether a child called ``name`` of class ``cls`` is the block's ``kind`` sub-module.

    The class decides first, the attribute name second. A class named like both kinds is
    attention-like (Qwen2MoeAttention carries "Moe"); a name of one kind on a class of the
    other is the other (Nemotron-H calls every block's one sub-module ``mixer``: a mamba mixer,
    an MLP or an MoE); norms and embeddings are neither."""
    names, own = _KINDS[kind]
    other = _KINDS["mlp" if kind == "attention" else "attention"][1]
    if _NEITHER.search(cls):
        return False
    if own.search(cls):
        return kind == "attention" or not other.search(cls)
    return name in names and not other.search(cls)
