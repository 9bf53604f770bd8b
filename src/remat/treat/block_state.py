"""What a treated block is handed, kept as the untouched block sees it: in its forward and in every recompute.

A checkpointed block runs twice, in the forward and again in backward; the recompute must be handed
the values its forward was handed, and the forward must leave behind what the untouched block
leaves. Python objects reaching a block through its arguments break both unless looked after.
:func:`guarded` (a :class:`BlockCall` per call of a treated block, eager mode) looks after them;
nothing here copies a block's activations.

- KV caches (transformers' ``Cache``): the block gets a view (:mod:`remat.treat.cache_views`) that
  reads the caller's layers as its forward read them; what it adds is withheld in a training
  forward (so its keys and values are not kept alive for the step) and written back in an eval
  forward with gradients or for a model that reads its own cache in training (:func:`cache_reader`:
  PI0). A read of withheld keys and values is refused from inside the step
  (:mod:`remat.treat.refusals`).
- Tensors inside the arguments (tuples, lists, dicts, to :data:`_DEPTH` levels): their versions are
  recorded at the call; a tensor the model writes into after the block returned (xLSTM's recurrent
  state) is copied for the recompute, and which paths need copies is learned (:class:`InputLedger`).
  A changed tensor with no copy is refused in backward, the argument named.
- Mutable containers (Gemma-3n's shared key/value dict): the forward gets the caller's object, a
  recompute a copy of its contents, so it reads what the forward read and writes nothing seen.

Why not the obvious alternatives: dropping the cache (``use_cache=False``) changes some models'
arithmetic and breaks models that read it; handing the caller's cache lets a recompute append
twice; copying every argument at every call would double what ``full`` keeps.

Under ``torch.compile`` a treated block gets a new empty cache of the caller's layout
(:mod:`remat.treat.cache_layout`) and tensors inside arguments are left to the graph. Limits
(tensors inside other objects are not watched, transformers 4.x caches, ...):
``docs/design/treatments.md``.
"""
from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import weakref
from collections import UserDict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from remat import caches
from remat.treat.cache_layout import cache_types, warn_cache_once
from remat.treat.cache_views import CacheView, viewable
from remat.treat.refusals import StepRefusal

_DEPTH = 3          # container levels walked below an argument
_MOST_TENSORS = 64  # tensors watched per call: beyond this an argument is a data structure, not state


@dataclass
class InputLedger:
    """Per treated block (in its ``TreatmentState``), learned over its calls: which paths into its
    arguments (``("arg", 1, 0)``: the first element of its second positional argument) hold a tensor
    the model writes into after the call (``mutated``: copied at every call) or never has (``clean``)."""

    clean: set = field(default_factory=set)
    mutated: set = field(default_factory=set)


def guarded(forward, args: tuple, kwargs: dict, ledger: "InputLedger", *, write_back: bool, name: str):
    """``(function, args, kwargs)`` to checkpoint in place of ``forward(*args, **kwargs)``, a treated
    block's call (eager mode): ``function``'s first call is the forward, handed views of the caller's
    KV caches; every later one is a recompute, handed what the forward was handed (module docstring).
    ``args`` and ``kwargs`` are the call's with each cache replaced by None: the checkpoint must not
    keep the caller's cache alive. Called outside any checkpoint's modes (the copies made here must
    not be recorded). ``write_back``: the caches' changes go back into the caller's (else withheld);
    ``name`` names the block in errors.

    Example::

        function, args, kwargs = guarded(block_forward, args, kwargs, InputLedger(), write_back=False,
                                         name="LlamaDecoderLayer")
        out = checkpoint(lambda *a: function(*a, **kwargs), *args, use_reentrant=False)
    """
    call = BlockCall(args, kwargs, ledger, write_back=write_back, name=name)
    args = tuple(None if ("arg", i) in call.views else v for i, v in enumerate(args))
    kwargs = {k: (None if ("kw", k) in call.views else v) for k, v in kwargs.items()}
    return call.wrap(forward), args, kwargs


def _holds_tokens(cache) -> bool:
    """Whether ``cache`` held tokens when handed to a block (one the caller passed in, not one the model
    built for this forward, empty so far; a cache type without a length counts as holding none)."""
    try:
        return int(cache.get_seq_length()) > 0
    except Exception:  # noqa: BLE001 - a hybrid's state layers may have no length to give
        return False


class BlockCall:
    """One call of a treated block (:func:`guarded`): what it was handed, read at the call (its caches'
    views, the tensors and containers inside its arguments), and :meth:`wrap`, the function the
    checkpoint runs. It holds no tensor argument itself (those are the checkpoint's inputs, and a
    segment must not keep its later blocks' inputs alive)."""

    def __init__(self, args: tuple, kwargs: dict, ledger: InputLedger, *, write_back: bool, name: str):
        self.name = name
        self.ledger = ledger
        self.write_back = write_back
        self.calls = 0
        kinds = cache_types()
        self.views = {}       # argument key -> CacheView
        self.watched = []     # _Watched, one per tensor inside an argument
        self.snapshots = {}   # id(container) -> its contents at the call
        self.direct = []      # (key, weak reference, version) of each tensor argument
        self.containers = {}  # argument key -> the container given (the recompute rebuilds it)
        held = False          # a cache passed in with tokens: the caller may read the one returned
        for key, value in _arguments(args, kwargs):
            if isinstance(value, torch.Tensor):
                self.direct.append((key, weakref.ref(value), value._version))
            elif kinds and isinstance(value, kinds) and viewable(value):
                self.views[key] = CacheView(value, name)
                held = held or _holds_tokens(value)
            elif isinstance(value, (tuple, list, MutableMapping)):
                if self._walk(value, key, 0):
                    self.containers[key] = value
        if held and not write_back and not torch.compiler.is_compiling():
            warn_cache_once()

    def _walk(self, value, path, depth) -> bool:
        """Record the tensors and the copyable containers inside ``value``; whether there is any."""
        if isinstance(value, torch.Tensor):
            if len(self.watched) < _MOST_TENSORS:
                self.watched.append(_Watched.of(value, path, self.ledger))
            return True
        if depth > _DEPTH or not isinstance(value, (tuple, list, MutableMapping)):
            return False
        items = list(value.items()) if isinstance(value, MutableMapping) else list(enumerate(value))
        copyable = type(value) in (list, dict) or isinstance(value, UserDict)
        if copyable:
            self.snapshots[id(value)] = items
        found = copyable
        for index, item in items:
            found = self._walk(item, path + (index,), depth + 1) or found
        return found

    def wrap(self, forward):
        """``forward`` as the checkpoint calls it: the forward with the views, each recompute with the
        arguments as the forward was handed them."""
        def run(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                for (kind, key), view in self.views.items():
                    if kind == "arg":
                        args = args[:key] + (view.forward_cache(),) + args[key + 1:]
                    else:
                        kwargs[key] = view.forward_cache()
                out = forward(*args, **kwargs)
                for view in self.views.values():
                    view.after_forward(self.write_back)
                self._check_during_forward()
                return out
            args, kwargs = self._recompute_arguments(args, kwargs)
            return forward(*args, **kwargs)
        return run

    def _check_during_forward(self) -> None:
        """A tensor inside an argument that the block itself wrote in place: its recompute needs the
        copy, which exists only where the path was not known clean."""
        for watched in self.watched:
            if watched.tensor._version != watched.version and watched.copy is None:
                raise _written_error(self.name, watched.path, "during its forward")

    def _recompute_arguments(self, args, kwargs):
        for key, ref, version in self.direct:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise _written_error(self.name, key, "after the block returned")
        swaps = {}
        for watched in self.watched:
            changed = watched.tensor._version != watched.version
            if changed and watched.copy is None:
                raise _written_error(self.name, watched.path, "after the block returned")
            if changed:
                swaps[watched.path] = watched.copy
                self.ledger.mutated.add(watched.path)
                self.ledger.clean.discard(watched.path)
            elif watched.copy is not None and watched.path not in self.ledger.mutated:
                self.ledger.clean.add(watched.path)
        args = list(args)
        for (kind, key), value in self.containers.items():
            rebuilt = self._rebuild(value, (kind, key), swaps)
            if kind == "arg":
                args[key] = rebuilt
            else:
                kwargs[key] = rebuilt
        for (kind, key), view in self.views.items():
            if kind == "arg":
                args[key] = view.recompute_cache()
            else:
                kwargs[key] = view.recompute_cache()
        return tuple(args), kwargs

    def _rebuild(self, value, path, swaps):
        """``value`` as it was at the call: a mutable container as a new one of its contents then, a
        tuple rebuilt where something inside it is; a tensor that changed since, its copy."""
        if isinstance(value, torch.Tensor):
            return swaps.get(path, value)
        items = self.snapshots.get(id(value))
        if isinstance(value, tuple):
            rebuilt = [self._rebuild(item, path + (i,), swaps) for i, item in enumerate(value)]
            if all(a is b for a, b in zip(rebuilt, value)):
                return value
            return type(value)._make(rebuilt) if hasattr(type(value), "_make") else type(value)(rebuilt)
        if items is None:  # not copied at the call (deeper than walked, or a mapping of its own kind)
            if any(p[:len(path)] == path for p in swaps):
                raise _written_error(self.name, path, "after the block returned")
            return value
        if isinstance(value, list):
            return [self._rebuild(item, path + (i,), swaps) for i, item in items]
        rebuilt = {k: self._rebuild(item, path + (k,), swaps) for k, item in items}
        if type(value) is dict:
            return rebuilt
        fresh = copy.copy(value)  # a UserDict: a new one of the same class
        fresh.data = rebuilt
        return fresh


def _arguments(args, kwargs):
    yield from ((("arg", i), v) for i, v in enumerate(args))
    yield from ((("kw", k), v) for k, v in kwargs.items())


def _written_error(name: str, path, when: str) -> ValueError:
    where = _describe(path)
    kind = StepRefusal if when == "during its forward" else ValueError  # a recompute's cannot take remat off
    return kind(
        f"{name} (treated by remat) was handed a tensor ({where}) that the model wrote in place {when}: "
        "its recompute would see other values than its forward saw, and its gradients would be wrong, so remat "
        "stops here. Give this block the treatment 'keep' (or 'offload', which recomputes nothing); for a "
        "recurrent model's state, pass use_cache=False when training.")


def _describe(path) -> str:
    kind, key, *rest = path
    head = f"argument {key}" if kind == "arg" else f"argument {key!r}"
    return head + "".join(f"[{r!r}]" for r in rest)


# ----------------------------------------------------------------------------- tensors inside arguments

_COPIES: dict = caches.register({}, "treat.block_state._COPIES")  # id(tensor) -> (weak tensor, version, weak copy): one copy per tensor and version


class _Watched(NamedTuple):
    path: tuple
    tensor: torch.Tensor
    version: int
    copy: Optional[torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor, path: tuple, ledger: InputLedger) -> "_Watched":
        wanted = path in ledger.mutated or (path not in ledger.clean and not tensor.requires_grad
                                            and not isinstance(tensor, nn.Parameter))
        return cls(path, tensor, tensor._version, _copy_of(tensor) if wanted else None)


def _copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` as it is now, shared by every block handed the same tensor at this version."""
    held = _COPIES.get(id(tensor))
    if held is not None and held[0]() is tensor and held[1] == tensor._version and held[2]() is not None:
        return held[2]()
    with _disable_current_modes(), torch.no_grad():
        made = tensor.detach().clone()
    if len(_COPIES) > 256:
        for key in [k for k, (t, _, c) in _COPIES.items() if t() is None or c() is None]:
            del _COPIES[key]
    _COPIES[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(made))
    return made


# ----------------------------------------------------------------------------- models that read their cache

_READERS: dict = caches.register({}, "treat.block_state._READERS")  # class -> the call in its forward that asks for a cache, or ""


def cache_reader(model: nn.Module) -> Optional[str]:
    """Where ``model`` reads its own KV cache inside a training forward, or None: a ``forward`` among
    its modules' classes that calls a sub-module with ``use_cache=True`` written out (PI0 asks its
    vision-language model for the prefix cache its action expert attends to), read from the source
    once per class. :func:`remat.apply` has such a model's treated blocks write their keys and
    values back into the model's cache (module docstring)."""
    for module in model.modules():
        kind = type(module)
        if kind not in _READERS:
            _READERS[kind] = _forced_cache_call(kind)
        if _READERS[kind]:
            return _READERS[kind]
    return None


def _forced_cache_call(kind: type) -> str:
    forward = kind.__dict__.get("forward")
    if forward is None or kind.__module__.startswith(("torch.", "remat.")):
        return ""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(
                k.arg == "use_cache" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords):
            return f"{kind.__name__}.forward calls {ast.unparse(node.func)}(..., use_cache=True)"
    return ""


__all__ = ["BlockCall", "InputLedger", "cache_reader", "guarded"]
