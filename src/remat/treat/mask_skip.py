"""Under ``torch.compile``, skip the attention mask where eager mode skips it.

Why: before every forward, transformers decides whether SDPA can run with ``attn_mask=None``
(``is_causal=True`` for a decoder, no mask for an encoder) instead of a materialised
``[batch, 1, q, kv]`` mask (``masking_utils._ignore_causal_mask_sdpa`` and
``_ignore_bidirectional_mask_sdpa``). In eager mode an ordinary training batch (no padding
mask, queries as long as the keys) skips the mask. While dynamo traces, the same functions
answer "do not skip" on the versions we run: transformers 5.17 refuses whenever it is tracing,
and 5.24 asks ``torch.compiler.is_exporting()``, which dynamo folds to True under plain
``torch.compile`` before torch 2.14 (pytorch#176347). With ``use_cache`` off, the
packed-sequence check on the position ids cannot read them under compile either and adds a
packed-sequence mask. So a compiled model builds the full mask and SDPA runs a masked, non-causal kernel over every
query-key pair: on the bench model the compiled step's attention took three times its eager
time, more than inductor's fusions saved (``benchmarks/results/issue11/README.md``).

What: :func:`hold` (called by :func:`remat.apply` and by ``remat.profile(..., compile=True)``)
wraps those two and ``find_packed_sequence_indices`` in ``transformers.masking_utils`` while
at least one held model is alive and has not been given back by :func:`release`
(``remat.remove``). The wrappers
answer as eager mode does only where that needs no tensor's values: dynamo is compiling and
not exporting, there is no padding mask, no local-attention window reaches the key length,
the query offset is a Python int, and (causal) the query is one token or as long as the keys;
the packed-sequence check answers "not packed" when the base model made the position ids
itself (the caller passed none: a per-model patch of the base model's ``forward``, tag
``mask-skip``, notes it). Every other call, and every call outside dynamo, goes to
transformers' own function. ``is_causal=True`` with no mask computes what the causal mask
computes (SDPA's own causal kernel, the one eager mode runs): the compiled model then
attends as the eager one does, rather than differently.

Export: ``torch.export`` sets ``torch.compiler._is_exporting_flag`` (a module global that
dynamo reads as a value, unlike the function it folds), and the wrapper defers to
transformers then: an exported graph must not hard-code ``is_causal``. A torch without that
flag (2.6) cannot tell export from compile, so there nothing is wrapped.

Limits: process-wide, since transformers' functions are module state: while one model holds
the wrapper, any model compiled in the process gets it. A function that replaced remat's
wrapper meanwhile (not one that wraps it) is wrapped at the next :func:`hold`. A batch with an
``attention_mask`` tensor, even all ones, still builds the mask under compile (skipping it
needs the mask's values: a graph break): pass no ``attention_mask`` for unpadded batches. Without
``transformers.masking_utils`` (transformers < 4.53, whose training-mode rule already skips
under compile when there is no mask) or with a signature this module does not know,
nothing is wrapped.
"""
from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from remat.treat import patches

_holders: dict = {}    # id(model) -> weakref to a model that holds the wrappers
_originals: dict = {}  # function name in masking_utils -> (transformers' own function, remat's wrapper)
_DEFER = object()      # a decision's "ask transformers"
PATCH_TAG = "mask-skip"


class _Positions:
    """Whether the running forward of a held model's base model made its own position ids
    (the caller passed none): set by :func:`_note_generated_positions`, read while dynamo traces."""
    generated = False


def _causal_skip(arguments: dict):
    query = arguments.get("q_length", arguments.get("query_length"))
    kv_length = arguments["kv_length"]
    window = arguments.get("local_attention_size")
    if (arguments.get("padding_mask") is None and not isinstance(arguments.get("q_offset", 0), torch.Tensor)
            and (window is None or kv_length < window) and (query == 1 or query == kv_length)):
        return True
    return _DEFER


def _bidirectional_skip(arguments: dict):
    window = arguments.get("local_attention_size")
    if arguments.get("padding_mask") is None and (window is None or arguments["kv_length"] < window):
        return True
    return _DEFER


def _no_packing(arguments: dict):
    return None if _Positions.generated else _DEFER


# masking_utils function -> (decision, parameters it must have, one of which it must have)
_DECISIONS = {
    "_ignore_causal_mask_sdpa": (_causal_skip, {"padding_mask", "kv_length"}, {"q_length", "query_length"}),
    "_ignore_bidirectional_mask_sdpa": (_bidirectional_skip, {"padding_mask", "kv_length"}, set()),
    "find_packed_sequence_indices": (_no_packing, {"position_ids"}, set()),
}


def compiling_not_exporting() -> bool:
    """True while dynamo traces for ``torch.compile`` (not ``torch.export``)."""
    return torch.compiler.is_compiling() and not torch.compiler._is_exporting_flag


def _masking_utils():
    # only where the model's code imported it: a model that does not use it needs no wrapper
    return sys.modules.get("transformers.masking_utils")


def _wrapper(original: Callable, decide: Callable) -> Callable:
    names = tuple(inspect.signature(original).parameters)

    @functools.wraps(original)
    def as_in_eager(*args, **kwargs):
        if _originals and compiling_not_exporting():  # a pass-through once unwrapped under another's wrapper
            arguments = dict(zip(names, args))
            arguments.update(kwargs)
            decided = decide(arguments)
            if decided is not _DEFER:
                return decided
        return original(*args, **kwargs)
    return as_in_eager


def _knows(original: Callable, required: set, one_of: set) -> bool:
    names = set(inspect.signature(original).parameters)
    return required <= names and (not one_of or bool(one_of & names))


def wrapped() -> list:
    """Names of the transformers functions wrapped now."""
    return sorted(_originals)


def hold(model: nn.Module, block_names: Optional[list] = None) -> bool:
    """Wrap transformers' mask decisions while ``model`` lives (or until :func:`release`), and
    mark the position ids its base model makes itself. Returns whether anything is wrapped."""
    module = _masking_utils()
    if module is None or not hasattr(torch.compiler, "_is_exporting_flag"):
        return False
    key = id(model)
    if key not in _holders or _holders[key]() is not model:
        _holders[key] = weakref.ref(model, _unwrap_if_unheld)
    for name, (decide, required, one_of) in _DECISIONS.items():
        original = getattr(module, name, None)
        if name in _originals and _calls(original, _originals[name][1]):
            continue
        if original is None or not _knows(original, required, one_of):
            continue
        _originals[name] = (original, _wrapper(original, decide))
        setattr(module, name, _originals[name][1])
    base = _base_model(model, block_names)
    if base is not None and patches.patch_of(base, "forward", PATCH_TAG) is None:
        names = [n for n in inspect.signature(type(base).forward).parameters][1:]
        patches.install(base, "forward", _note_generated_positions, tag=PATCH_TAG, state=names.index("position_ids"))
    return bool(_originals)


def _calls(function: Callable, wrapper: Callable) -> bool:
    """Whether ``function`` is ``wrapper`` or wraps it (``functools.wraps``'s ``__wrapped__``
    chain): False where something replaced remat's wrapper while a model held it, and the
    next :func:`hold` wraps the replacement."""
    seen = set()
    while function is not None and id(function) not in seen:
        if function is wrapper:
            return True
        seen.add(id(function))
        function = getattr(function, "__wrapped__", None)
    return False


def _base_model(model: nn.Module, block_names: Optional[list] = None):
    """The innermost module above the first decoder block whose forward takes ``position_ids``
    (``LlamaModel`` under ``LlamaForCausalLM``, under PEFT's wrappers): where a caller's missing
    position ids become the model's own ``arange``."""
    from remat.treat.discovery import discover
    if not block_names:
        try:
            block_names = discover(model).block_names
        except ValueError:  # no blocks: nothing of remat's runs in it
            return None
    parts = block_names[0].split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        forward = getattr(type(owner), "forward", None)
        if forward is not None and "position_ids" in inspect.signature(forward).parameters:
            return owner
    return None


def _note_generated_positions(patch, *args, **kwargs):
    index = patch.state
    given = kwargs.get("position_ids", args[index] if len(args) > index else None)
    outer = _Positions.generated
    _Positions.generated = given is None
    try:
        return patch.call_previous(*args, **kwargs)
    finally:
        _Positions.generated = outer


def release(model: nn.Module) -> None:
    """``model`` no longer holds the wrappers; transformers' functions come back when no model does."""
    ref = _holders.get(id(model))
    if ref is not None and ref() is model:
        del _holders[id(model)]
    patches.remove(model, PATCH_TAG)
    _unwrap_if_unheld()


def _unwrap_if_unheld(_dead: Optional[weakref.ref] = None) -> None:
    for key, ref in list(_holders.items()):
        if ref() is None:
            del _holders[key]
    if _holders or not _originals:
        return
    module = _masking_utils()
    for name, (original, wrapper) in _originals.items():
        if getattr(module, name, None) is wrapper:  # another library's wrapper on top of remat's stays
            setattr(module, name, original)
    _originals.clear()
