"""The KV cache a treated block gets under ``torch.compile``: a new empty cache of the caller's layout.

A view (:mod:`remat.treat.cache_views`) copies layers as the block reads them, which would break
dynamo's graph at every checkpoint; compiled, a treated block gets instead a new empty cache laid out
as the caller's (:func:`own_cache`), at its forward and at every recompute, built from the constructor
arguments each layer keeps (read once per call, before the checkpoint: :func:`_cache_layout`). That is
exact where the caller's cache is empty at the block, which is every training forward that builds its
own cache; the treated blocks' keys and values are kept out of the model's cache, as in eager mode.
Here too: the cache classes of the installed transformers (:func:`cache_types`) and the one warning
that the model's cache lacks the treated blocks (:func:`warn_cache_once`).
"""
from __future__ import annotations

import inspect
import sys
import warnings
from typing import NamedTuple, Optional

import torch

from remat import caches

def own_cache(forward, args: tuple, kwargs: dict):
    """``(forward, args, kwargs)`` in which each KV cache argument is a new empty cache of its layout,
    at the forward and at every recompute (the compiled path, module docstring). Any argument that *is*
    a Hugging Face ``Cache``, whatever its keyword is called in the installed transformers, is replaced."""
    kinds = cache_types()
    keys = [k for k, v in kwargs.items() if isinstance(v, kinds)]
    slots = [i for i, v in enumerate(args) if isinstance(v, kinds)]
    if not keys and not slots:
        return forward, args, kwargs
    if not torch.compiler.is_compiling():
        warn_cache_once()
    # the layouts, read here, outside the checkpoint: the body that builds the empty caches only
    # builds (see _cache_layout); and only the caches' layouts: a segment must not keep its later
    # blocks' inputs, nor the caller's cache, through this closure
    layouts = {**{i: _cache_layout(args[i]) for i in slots}, **{k: _cache_layout(kwargs[k]) for k in keys}}

    def with_new_caches(*call_args, **call_kwargs):
        call_args = tuple(_build_empty(layouts[i]) if i in slots else v for i, v in enumerate(call_args))
        call_kwargs.update({k: _build_empty(layouts[k]) for k in keys})
        return forward(*call_args, **call_kwargs)
    args = tuple(None if i in slots else v for i, v in enumerate(args))
    kwargs = {k: (None if k in keys else v) for k, v in kwargs.items()}
    return with_new_caches, args, kwargs


def has_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a transformers ``Cache`` is among the arguments."""
    kinds = cache_types()
    return bool(kinds) and any(isinstance(v, kinds) for v in (*args, *kwargs.values()))


class _CacheLayout(NamedTuple):
    """What :func:`_build_empty` needs to build a new, empty cache laid out as one given: its class,
    the layouts of an encoder-decoder cache's two parts (None for others), and each layer's class and
    constructor arguments (None: the cache fills its layers lazily)."""
    kind: type
    parts: Optional[tuple]
    layers: Optional[tuple]


def _cache_layout(cache) -> Optional[_CacheLayout]:
    """How to build a new, empty cache laid out as ``cache`` is; None where a layer's constructor
    arguments cannot be read back.

    The layout matters: hybrid models (Jamba, Bamba, Falcon-H1, LFM2, Zamba2, Qwen3-Next) build
    ``DynamicCache(config=...)``, one layer object per layer type (a linear-attention layer for
    a state-space mixer, a sliding-window layer, ...), and their mixers read their own layer's
    kind; a bare ``type(cache)()`` fills lazily with plain key/value layers, on which a mamba
    mixer's ``get_conv_state`` fails. So each layer is rebuilt empty as its own class, from the
    constructor arguments it keeps as attributes of the same name (``sliding_window``,
    ``number_of_states``, ``max_cache_len``). An encoder-decoder cache is rebuilt from its two
    parts.

    Read once per call of the block, before its checkpoint; the forward and each recompute then
    build from it. Reading fills a module dict on a class's first read, and under
    ``torch.compile`` a dict written inside a checkpoint's body is a side effect dynamo refuses
    there: it broke the graph at every checkpoint, and the block ran eager."""
    parts = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    if all(part is not None for part in parts):
        part_layouts = tuple(_cache_layout(part) for part in parts)
        return None if None in part_layouts else _CacheLayout(type(cache), part_layouts, None)
    layers = getattr(cache, "layers", None)
    if not (isinstance(layers, list) and layers and getattr(cache, "layer_class_to_replicate", None) is None):
        return _CacheLayout(type(cache), None, None)
    # transformers >= 5: built from a config, every layer of its own kind
    arguments = [_layer_arguments(layer) for layer in layers]
    if None in arguments:
        return None
    return _CacheLayout(type(cache), None, tuple((type(layer), a) for layer, a in zip(layers, arguments)))


def _build_empty(layout: Optional[_CacheLayout]):
    """A new, empty cache built from :func:`_cache_layout`'s ``layout``, or None where none can be
    built (the block then runs without a cache, as with ``use_cache=False``): a layout that could not
    be read, or a class that cannot be built without arguments (transformers 4.x's hybrid caches,
    which its models never build in a training forward anyway)."""
    if layout is None:
        return None
    try:
        if layout.parts is not None:
            empty = [_build_empty(part) for part in layout.parts]
            return layout.kind(*empty) if None not in empty else None
        fresh = layout.kind()
        if layout.layers is not None:
            fresh.layers = [kind(**arguments) for kind, arguments in layout.layers]
            fresh.layer_class_to_replicate = None
        return fresh
    except (TypeError, ValueError):
        return None


def _layer_arguments(layer) -> Optional[dict]:
    """The arguments ``layer`` was built with, read back from its attributes of the same names, or
    None if a required one cannot be found."""
    parameters = _constructor_parameters(type(layer))
    if parameters is None:
        return None
    arguments = {}
    for name, required in parameters:
        if hasattr(layer, name):
            arguments[name] = getattr(layer, name)
        elif required:
            return None
    return arguments


_CONSTRUCTOR_PARAMETERS: dict = caches.register({}, "treat.cache_layout._CONSTRUCTOR_PARAMETERS")


def _constructor_parameters(kind: type) -> Optional[tuple]:
    """``(name, required)`` of each argument ``kind.__init__`` takes by name (None: its signature
    cannot be read). Read once per class: each forward and recompute of a treated block rebuilds
    every layer of the model's cache, so ``inspect.signature`` per layer and call cost host time in
    the square of the number of layers a step. Kept in a plain dict, not ``functools.lru_cache``,
    which dynamo warns of (and traces through) in every compiled model with a cache."""
    if kind not in _CONSTRUCTOR_PARAMETERS:
        try:
            parameters = inspect.signature(kind.__init__).parameters.values()
        except (TypeError, ValueError):
            _CONSTRUCTOR_PARAMETERS[kind] = None
        else:
            _CONSTRUCTOR_PARAMETERS[kind] = tuple((p.name, p.default is p.empty) for p in parameters
                                                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return _CONSTRUCTOR_PARAMETERS[kind]


def cache_types() -> tuple:
    """``(transformers' Cache,)`` once transformers' cache module is imported (any model with one imports
    it), else ``()``: remat never imports transformers itself."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # imported by any HF model that has one
    cache = getattr(cache_utils, "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


_WARNED = set()


def warn_cache_once() -> None:
    """Say once per process that the cache a model returns from a training forward lacks the treated blocks
    (eager mode: where the cache was passed in holding tokens, so the caller may read the one returned)."""
    if "cache" not in _WARNED:
        _WARNED.add("cache")
        warnings.warn("remat: a KV cache reached a treated block in a training forward; remat keeps what the "
                      "block adds to it in a copy of its own (a recompute must not append to yours), so the "
                      "cache the model returns lacks the treated blocks. Pass use_cache=False when training to "
                      "silence this.", stacklevel=5)
