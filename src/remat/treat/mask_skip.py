"""Under ``torch.compile``, skip the attention mask where eager mode skips it.

Why: before every forward, transformers decides whether SDPA can run with ``attn_mask=None``
(``is_causal=True`` for a decoder) instead of a materialised ``[batch, 1, q, kv]`` mask
(``masking_utils._ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa``). Eager mode
skips it for an ordinary training batch; while dynamo traces, the same functions answer "do not
skip" on the versions we run (and the packed-sequence check adds a mask), so a compiled model runs
a masked, non-causal kernel over every query-key pair: slower than eager attention
(``benchmarks/results/issue11/README.md``).

What: :func:`hold` (called by :func:`remat.apply` unless ``mask_skip=False``, and by compiled
profiles) wraps those two and ``find_packed_sequence_indices``, each only where this torch and
transformers need it: dynamo is asked once per function (:func:`needed`, a tiny ``fullgraph``
compile) what it answers for an unpadded batch; where none needs it, nothing is wrapped. The
wrappers answer as eager mode does only inside the forward of a model that holds them (a per-model
patch, tag ``mask-skip``, sets :class:`_Running`), and only where that needs no tensor's values: no
padding mask, no local-attention window reaching the key length, a Python-int query offset, a query
of one token or as long as the keys. ``is_causal=True`` with no mask computes what the causal mask
computes, so the compiled model attends as the eager one does.

Undo: ``remat.remove`` (:func:`release`) takes the model's patches off; a model deleted without it
is released by its finalizer; transformers' functions are put back when the last holder goes.
Under ``torch.export`` the wrapper defers to transformers (an exported graph must not hard-code
``is_causal``); a torch that cannot tell export from compile (2.6) gets nothing wrapped.

Limits: module state in ``transformers.masking_utils`` while a model holds it; a model compiled
from inside (``model.model.compile()``) keeps transformers' answer; a batch with any
``attention_mask`` tensor still builds the mask. Details: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from remat import caches
from remat.treat import patches

_holders: dict = {}    # id(model) -> weakref.finalize of a model that holds the wrappers
_originals: dict = {}  # function name in masking_utils -> (transformers' own function, remat's wrapper)
_NEEDED: dict = caches.register({}, "treat.mask_skip._NEEDED")  # id(a masking_utils function) -> (the function, whether dynamo answers otherwise than eager)
_DEFER = object()      # a decision's "ask transformers"
PATCH_TAG = "mask-skip"


class _Running(threading.local):
    """Set while a held model's forward runs (traced by dynamo as part of it), read by the wrappers.

    ``held``: inside a held model's forward; ``generated``: inside its base model's forward, which
    made its own position ids (the caller passed none). Per thread: a held model's forward in one
    thread leaves another thread's compile with transformers' own answer. Not a ``ContextVar``
    (tiled.py's choice, outside any traced code): dynamo cannot trace ``ContextVar.get``/``set``
    (torch 2.13: "Unsupported method call", a graph break in the model's forward), while it traces
    a ``threading.local``'s attributes as it does any object's. Set in each thread's instance
    (never read from the class), so that what dynamo guards on exists before the forward sets it."""

    def __init__(self):
        self.held = False
        self.generated = False


_RUNNING = _Running()


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
    return None if _RUNNING.generated else _DEFER


# masking_utils function -> (decision, parameters it must have, one of which it must have)
_DECISIONS = {
    "_ignore_causal_mask_sdpa": (_causal_skip, {"padding_mask", "kv_length"}, {"q_length", "query_length"}),
    "_ignore_bidirectional_mask_sdpa": (_bidirectional_skip, {"padding_mask", "kv_length"}, set()),
    "find_packed_sequence_indices": (_no_packing, {"position_ids"}, set()),
}
# an unpadded batch of 16 tokens, as :func:`needed` asks each function about it
_UNPADDED = {"padding_mask": None, "q_length": 16, "query_length": 16, "kv_length": 16, "q_offset": 0,
             "kv_offset": 0, "local_attention_size": None}


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
        # a pass-through outside a held model's forward, and once unwrapped under another's wrapper
        if _RUNNING.held and _originals and compiling_not_exporting():
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


def _asks_unpadded(name: str, original: Callable) -> Callable:
    """``(position ids) -> whether original skips the mask`` for an unpadded batch of 16 tokens."""
    if name == "find_packed_sequence_indices":
        return lambda positions: original(position_ids=positions) is None
    parameters = inspect.signature(original).parameters
    kwargs = {k: v for k, v in _UNPADDED.items() if k in parameters}
    return lambda positions: original(**kwargs) is True


def needed(name: str, original: Callable) -> bool:
    """Whether ``original`` (``masking_utils.<name>``) answers otherwise under ``torch.compile``
    than in eager mode for an unpadded batch: what the wrapper is for. Asked once per function
    (a ``fullgraph`` compile of a private function with the eager backend, its graph dropped
    after, the answer kept); True where dynamo cannot trace the question (wrapped, as before; asked
    again at the next :func:`hold`)."""
    known = _NEEDED.get(id(original))
    if known is not None and known[0] is original:
        return known[1]
    ask = _asks_unpadded(name, original)
    positions = torch.arange(16)[None]

    def compiled_answer(x):
        return x + (1 if ask(x) else 0)
    try:
        eager = ask(positions)
        traced = bool(torch.compile(compiled_answer, backend="eager", fullgraph=True)(positions)[0, 0] == 1)
    except Exception:  # noqa: BLE001 -- the question cannot be traced here: wrap, and ask again next time
        return True
    finally:
        _reset_code(compiled_answer.__code__)  # remat's own function: none of the user's graphs
    _NEEDED[id(original)] = (original, traced != eager)
    return traced != eager


def _reset_code(code) -> None:
    try:
        from torch._C._dynamo.eval_frame import reset_code
    except ImportError:  # a torch without it keeps one small graph of remat's
        return
    reset_code(code)


def wrapped() -> list:
    """Names of the transformers functions wrapped now."""
    return sorted(_originals)


def hold(model: nn.Module, block_names: Optional[list] = None) -> bool:
    """Wrap transformers' mask decisions that this torch needs wrapped while ``model`` lives (or until
    :func:`release`), and patch its ``forward`` so that they act inside it (module docstring).
    Returns whether anything is wrapped."""
    module = _masking_utils()
    if module is None or not hasattr(torch.compiler, "_is_exporting_flag"):
        return False
    wanted = []
    for name, (decide, required, one_of) in _DECISIONS.items():
        original = getattr(module, name, None)
        if name in _originals and _calls(original, _originals[name][1]):
            wanted.append(name)
        elif original is not None and _knows(original, required, one_of) and needed(name, original):
            wanted.append(name)
            _originals[name] = (original, _wrapper(original, decide))
            setattr(module, name, _originals[name][1])
    if not wanted:
        return False
    key = id(model)
    if key not in _holders or _holders[key].peek() is None or _holders[key].peek()[0] is not model:
        _holders[key] = weakref.finalize(model, _forget, key)
    _mark_forwards(model, block_names)
    return True


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


def _mark_forwards(model: nn.Module, block_names: Optional[list]) -> None:
    """The patches that set :class:`_Running`: on ``model`` (held) and on its base model (where it
    makes its own position ids); one patch where they are the same module."""
    base = _base_model(model, block_names)
    targets = [(model, None)] if base is not model else []
    if base is not None:
        names = [n for n in inspect.signature(type(base).forward).parameters][1:]
        targets.append((base, names.index("position_ids")))
    for module, position_index in targets:
        if patches.patch_of(module, "forward", PATCH_TAG) is None:
            patches.install(module, "forward", _note_running, tag=PATCH_TAG, state=position_index)


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


def _note_running(patch, *args, **kwargs):
    """A held model's ``forward`` (``state`` None) or its base model's (``state``: where its
    ``position_ids`` argument sits): :class:`_Running` says so while it runs."""
    index = patch.state
    held, generated = _RUNNING.held, _RUNNING.generated
    _RUNNING.held = True
    if index is not None:
        given = kwargs.get("position_ids", args[index] if len(args) > index else None)
        _RUNNING.generated = given is None
    try:
        return patch.call_previous(*args, **kwargs)
    finally:
        _RUNNING.held, _RUNNING.generated = held, generated


def release(model: nn.Module) -> None:
    """``model`` no longer holds the wrappers (its patches come off now); transformers' functions
    come back when no model does."""
    patches.remove(model, PATCH_TAG)
    finalizer = _holders.get(id(model))
    if finalizer is not None and finalizer.peek() is not None and finalizer.peek()[0] is model:
        finalizer.detach()
        _forget(id(model))


def _forget(key: int) -> None:
    """The model of ``id`` ``key`` is released (or collected): unwrap if no model holds the wrappers."""
    _holders.pop(key, None)
    if _holders or not _originals:
        return
    module = _masking_utils()
    for name, (original, wrapper) in _originals.items():
        if getattr(module, name, None) is wrapper:  # another library's wrapper on top of remat's stays
            setattr(module, name, original)
    _originals.clear()
