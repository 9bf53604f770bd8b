"""Find a model's repeated blocks, their attention/MLP sub-modules and its LM head.

How: a *block list* is an ``nn.ModuleList`` or ``nn.Sequential`` holding two or more
non-leaf modules that carry parameters and are all of one class (a ModuleList of mixed
classes is accepted when every class is named like a layer or block, as in hybrid
models). Of all such lists, only the outermost are kept: the experts list inside a
Mixtral layer is not a block list, because it lives inside one. This needs no
per-model code and covers decoder-only LMs (``model.layers``, ``transformer.h``,
``gpt_neox.layers``), encoders (``encoder.layer``), encoder-decoders (two lists),
vision transformers, PEFT wrappers (the lists are found wherever they are nested)
and plain ``nn.Module`` stacks.

The obvious alternative, a table of known attribute paths per architecture, breaks on
every new model family; the structural rule breaks only on models without repeated
blocks, and then the error lists what was found and how to pass ``blocks=``.

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
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention", "SelfAttention")
_ATTENTION_CLASS = re.compile(r"Attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "ff", "block_sparse_moe", "intermediate")
_MLP_CLASS = re.compile(r"(MLP|Mlp|FeedForward|FFN|LayerFF|Intermediate|MoE|Moe)")
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

    ``blocks`` overrides discovery: a qualified container name (``"model.layers"``), a
    list of block names, or a predicate ``(name, module) -> bool`` selecting blocks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat expects a torch.nn.Module, got {type(model).__name__}")
    if blocks is None:
        lists = _outermost(_candidate_lists(model))
        if not lists:
            raise ValueError(_not_found_message(model))
        names = tuple(f"{list_name}.{child}" for list_name, container in lists
                      for child, _ in container.named_children())
        return Structure(tuple(name for name, _ in lists), names, find_head(model))
    return Structure((), _select(model, blocks), find_head(model))


def _select(model: nn.Module, selector: BlockSelector) -> tuple:
    modules = dict(model.named_modules(remove_duplicate=False))
    if isinstance(selector, str):
        container = modules.get(selector)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"blocks={selector!r} is not an nn.ModuleList/nn.Sequential in this "
                             f"model; containers found: {_container_names(model) or 'none'}")
        return tuple(f"{selector}.{child}" for child, _ in container.named_children())
    if callable(selector):
        names = tuple(name for name, module in modules.items() if name and selector(name, module))
    else:
        names = tuple(selector)
        missing = [name for name in names if name not in modules]
        if missing:
            raise ValueError(f"blocks= names not found in the model: {missing[:5]}")
    if not names:
        raise ValueError("blocks= selected no module; check the predicate or names against "
                         "[name for name, _ in model.named_modules()]")
    nested = [b for b in names if any(b.startswith(a + ".") for a in names)]
    if nested:
        raise ValueError(f"blocks= selected modules nested in other selected blocks: {nested[:5]}; "
                         "select only the outermost repeated modules")
    return names


def _candidate_lists(model: nn.Module) -> list:
    found = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or not all(_is_block_like(c) for c in children):
            continue
        classes = {type(c) for c in children}
        if len(classes) == 1 or (isinstance(module, nn.ModuleList)
                                 and all(_LAYERISH.search(c.__name__) for c in classes)):
            found.append((name, module))
    return found


def _is_block_like(module: nn.Module) -> bool:
    has_children = next(module.children(), None) is not None
    has_params = next(module.parameters(), None) is not None
    return has_children and has_params


def _outermost(lists: list) -> list:
    names = [name for name, _ in lists]
    return [(name, m) for name, m in lists
            if not any(name.startswith(other + ".") for other in names if other != name)]


def _container_names(model: nn.Module) -> list:
    return [f"{name} ({type(m).__name__}, {len(m)} x {sorted({type(c).__name__ for c in m})})"
            for name, m in model.named_modules()
            if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]


def _not_found_message(model: nn.Module) -> str:
    found = _container_names(model)
    listing = "\n  ".join(found[:12]) if found else "no nn.ModuleList or nn.Sequential at all"
    return ("remat could not find repeated blocks in "
            f"{type(model).__name__}: it looks for an nn.ModuleList/nn.Sequential of two or more "
            "same-class modules with parameters. Containers found:\n  " + listing +
            "\nPass them explicitly, e.g. remat.apply(model, 'full', blocks='model.layers') or "
            "blocks=lambda name, module: isinstance(module, MyBlock).")


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
    """``[(relative_name, module)]`` of the block's attention or MLP sub-modules.

    Searches breadth-first and returns every match at the shallowest depth that has one
    (T5's decoder block has self- and cross-attention side by side: both are returned).
    """
    if kind not in ("attention", "mlp"):
        raise ValueError(f"kind must be 'attention' or 'mlp', got {kind!r}")
    names, pattern = (_ATTENTION_NAMES, _ATTENTION_CLASS) if kind == "attention" else (_MLP_NAMES, _MLP_CLASS)
    level = [("", block)]
    for _ in range(3):
        next_level, matches = [], []
        for prefix, parent in level:
            for child_name, child in parent.named_children():
                full = f"{prefix}{child_name}"
                if child_name in names or pattern.search(type(child).__name__):
                    matches.append((full, child))
                else:
                    next_level.append((full + ".", child))
        if matches:
            return matches
        level = next_level
    return []

