"""A Plan: which treatment each block gets, and how the LM head computes its loss.

A plan is plain data. It can be written to JSON, read back, diffed, checked into a
training repository and applied without profiling again. The planner's predictions
(peak, step time, budget) ride along in ``notes`` so that ``remat doctor``/``bench`` can
put measurement beside prediction.

Short string specs are turned into plans here too (:func:`resolve`), against a model's discovered
blocks: ``"full"``, ``"selective"``, ``"every:2"`` (``full`` on blocks 0, 2, 4 ...), ``"first:8"``,
either with another treatment (``"every:2:offload"``), and ``"segments:K"`` /
``"segments:sqrt"`` (K consecutive blocks checkpointed as one unit, ``checkpoint_sequential``'s
semantics, K counting blocks per segment, never across two block lists; each block's treatment is
``"segment:<i>"``, so the grouping survives JSON). Specs count blocks, which are modules: a block
called several times a step gets its treatment at every call (:mod:`remat.planning.calls`).

Fields beside ``blocks``: ``head`` (``plain``, ``chunked``, ``liger``) and its ``chunk_tokens``;
``tile_tokens``, one size or a ``{block name: size}`` mapping (default
:data:`DEFAULT_TILE_TOKENS`); ``kernels``, ``stock`` or ``liger``, one name or a per-block mapping.

Why so strict on input: a plan read from JSON is checked field by field (:meth:`Plan.load`,
:meth:`Plan.from_dict`) and a wrong field is a ValueError naming the file, the field, what it must
be and what it was; ``chunk_tokens=None`` is the only way to ask for the default chunk. What a plan
was made for (model class, dtype, batch, optimizer, GPU, compile mode, versions:
:func:`made_for_notes`) rides in ``notes`` and reads back as :attr:`Plan.made_for`, so
:func:`remat.apply` can refuse a plan made for another model and ``remat doctor`` can say what
differs.

Limits: plans written before a field existed (``tile_tokens`` an integer or absent, no ``kernels``,
no made-for notes) load as they are, applied by name as any hand-made plan (docs/design/planning.md).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Optional, Union

PLAN_VERSION = 1


@dataclass(frozen=True)
class Treatment:
    """The decisions one treatment name stands for: a row of :data:`TABLE`, built by keyword.

    The fields are independent mechanisms :mod:`remat.treat` composes; a treatment is a choice of
    each. ``Treatment()`` is ``keep``: the block runs as it is."""

    checkpoint: bool = False
    """Its forward runs under a non-reentrant checkpoint: its inputs are kept, the rest recomputed in backward."""
    submodule: Optional[str] = None
    """The checkpoint wraps each sub-module of this kind (``attention``, ``mlp``), not the whole block."""
    keeps: Optional[str] = None
    """An op-level policy of the checkpoint, the ops whose outputs it keeps (the rest is recomputed):
    ``matmuls`` (``selective``: matmuls and attention kernels) or ``attention`` (attention kernels only)."""
    offload: bool = False
    """Its saved tensors go to the host (the offload engine): with ``checkpoint``, the checkpoint's inputs."""
    tiled: bool = False
    """Its token-wise sub-modules run a chunk of tokens at a time."""


TABLE = MappingProxyType({
    "keep": Treatment(),
    "full": Treatment(checkpoint=True),
    "selective": Treatment(checkpoint=True, keeps="matmuls"),
    "attention": Treatment(checkpoint=True, submodule="attention"),
    "mlp": Treatment(checkpoint=True, submodule="mlp"),
    "offload": Treatment(offload=True),
    "full+offload": Treatment(checkpoint=True, offload=True),
    "tiled": Treatment(tiled=True),
    "full+tiled": Treatment(checkpoint=True, tiled=True),
    "full+offload+tiled": Treatment(checkpoint=True, offload=True, tiled=True),
    "attn-saved": Treatment(checkpoint=True, keeps="attention"),
    "attn-saved+offload": Treatment(checkpoint=True, keeps="attention", offload=True),
    "attn-saved+tiled": Treatment(checkpoint=True, keeps="attention", tiled=True),
    "attn-saved+offload+tiled": Treatment(checkpoint=True, keeps="attention", offload=True, tiled=True),
})
"""Every treatment a plan may name (beside ``"segment:<i>"``), and what it decides. A new treatment
whose mechanisms exist is one entry here: the lists below, the records :mod:`remat.treat` applies
and the profile's measured and derived treatments (:mod:`remat.planning.costs`) follow from it."""
TREATMENTS = tuple(TABLE)
OFFLOADING_TREATMENTS = tuple(name for name, t in TABLE.items() if t.offload)
TILED_TREATMENTS = tuple(name for name, t in TABLE.items() if t.tiled)
ATTENTION_SAVED = tuple(name for name, t in TABLE.items() if t.keeps == "attention")
"""The treatments that keep only the attention kernel's output (an op-level policy, as ``selective``)."""
HEAD_MODES = ("plain", "chunked", "liger")
KERNELS = ("stock", "liger")
"""The kernels a plan may name per block: the model's own modules, or liger-kernel's fused ops."""
DEFAULT_TILE_TOKENS = 8192
"""Tokens per chunk of a tiled block whose plan names no size (``tile_tokens`` None, or a mapping
without the block): what :mod:`remat.treat.tiled` runs (its own constant of the same value: treat
asks planning nothing; a test holds them equal) and what a profile's ``classes`` measure."""
_FIELDS = ("version", "blocks", "head", "chunk_tokens", "tile_tokens", "notes", "kernels")
_SEGMENT = re.compile(r"segment:(0|[1-9][0-9]*)")


def segment_of(treatment) -> Optional[int]:
    """The segment number of a ``"segment:<i>"`` treatment, else None."""
    found = _SEGMENT.fullmatch(treatment) if isinstance(treatment, str) else None
    return int(found.group(1)) if found else None


def variant(treatment: str, **decisions) -> Optional[str]:
    """The name of the treatment that is ``treatment`` with ``decisions`` (fields of :class:`Treatment`)
    changed, or None where :data:`TABLE` has none: ``variant("full+offload", offload=False)`` is ``"full"``."""
    wanted = replace(TABLE[treatment], **decisions)
    return next((name for name, t in TABLE.items() if t == wanted), None)


def is_treatment(value) -> bool:
    """A block treatment a plan may name: one of TREATMENTS or ``"segment:<i>"``."""
    return value in TREATMENTS or segment_of(value) is not None


@dataclass(frozen=True)
class Plan:
    """A treatment per block and the head mode: plain, frozen data that :func:`remat.apply` installs.

    Args:
        blocks: ``{block name: treatment}`` (one of :data:`TREATMENTS` or ``"segment:<i>"``); blocks
            not named keep everything.
        head: one of :data:`HEAD_MODES` (``"plain"``, ``"chunked"``, ``"liger"``).
        chunk_tokens: tokens per chunk of the ``chunked`` head; None: chosen at apply time.
        notes: what the planner predicted and what the plan was made for (:attr:`made_for`).
        tile_tokens: tokens per chunk of the tiled blocks' token-wise sub-modules: one size, a
            ``{block name: size}`` mapping over tiled blocks (:meth:`tile_of`), or None for
            :data:`DEFAULT_TILE_TOKENS`.
        kernels: one of :data:`KERNELS` for every block, a ``{block name: kernel}`` mapping
            (:meth:`kernel_of`), or None for the model's own modules.

    Raises:
        TypeError: ``blocks`` or ``notes`` not a mapping, a block name not a string.
        ValueError: an unknown treatment or head, a ``chunk_tokens`` that is not a positive integer
            (``0``, ``False``, ``2.5``), a bad ``tile_tokens`` or ``kernels``.

    Example:
        >>> plan = Plan({"model.layers.0": "full", "model.layers.1": "selective"}, head="chunked")
        >>> plan.save("plan.json")                                      # doctest: +SKIP
        >>> remat.apply(model, Plan.load("plan.json"))                  # doctest: +SKIP
    """

    blocks: Mapping[str, str]
    head: str = "plain"
    chunk_tokens: Optional[int] = None
    notes: Mapping[str, object] = field(default_factory=dict)
    tile_tokens: Union[None, int, Mapping[str, int]] = None
    kernels: Union[None, str, Mapping[str, str]] = None

    def __post_init__(self):
        if not isinstance(self.blocks, Mapping):
            raise TypeError(f"'blocks' must be a mapping of block name to treatment, such as "
                            f"{{\"model.layers.0\": \"full\"}}; got a {type(self.blocks).__name__}")
        bad_names = [name for name in self.blocks if not isinstance(name, str)]
        if bad_names:
            raise TypeError(f"'blocks' must be keyed by block names (strings); got {bad_names[:3]!r}")
        bad = {name: t for name, t in self.blocks.items() if not is_treatment(t)}
        if bad:
            raise ValueError(f"unknown treatments in plan: {bad}; each value of 'blocks' must be a treatment "
                             f"name (a string), one of {', '.join(TREATMENTS)}, or 'segment:<i>' (i >= 0)")
        if self.head not in HEAD_MODES:
            raise ValueError(f"'head' must be a head mode (a string), one of {', '.join(HEAD_MODES)}; "
                             f"got {self.head!r} ({type(self.head).__name__})")
        c = self.chunk_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Integral) or c <= 0):
            # 0, False or 2.5 are mistakes, not a request for the default: None asks for that
            raise ValueError(f"'chunk_tokens' must be a positive integer, or None to choose it for the "
                             f"vocabulary at apply time; got {c!r} ({type(c).__name__})")
        t = _checked_tiles(self.tile_tokens, self.blocks)
        k = _checked_kernels(self.kernels, self.blocks)
        if not isinstance(self.notes, Mapping):
            raise TypeError(f"'notes' must be a mapping; got a {type(self.notes).__name__}")
        object.__setattr__(self, "chunk_tokens", None if c is None else int(c))
        object.__setattr__(self, "tile_tokens", t)
        object.__setattr__(self, "kernels", k)
        object.__setattr__(self, "blocks", MappingProxyType(dict(self.blocks)))
        object.__setattr__(self, "notes", MappingProxyType(dict(self.notes)))

    def __reduce__(self):  # mapping proxies don't pickle; a plan copies as its dict
        return (Plan.from_dict, (self.to_dict(),))

    def tile_of(self, name: str) -> Optional[int]:
        """Tokens per chunk of block ``name``'s tiled sub-modules: its own size in a mapping, the plan's
        one size, or None (the default, :data:`DEFAULT_TILE_TOKENS`); None for a block not tiled."""
        if self.blocks.get(name) not in TILED_TREATMENTS:
            return None
        t = self.tile_tokens
        return t.get(name) if isinstance(t, Mapping) else t

    def kernel_of(self, name: str) -> str:
        """The kernels block ``name`` runs with: its own in a mapping, the plan's one name, else ``stock``."""
        k = self.kernels
        return k.get(name, "stock") if isinstance(k, Mapping) else (k or "stock")

    def to_dict(self) -> dict:
        data = {"version": PLAN_VERSION, "blocks": dict(self.blocks), "head": self.head,
                "chunk_tokens": self.chunk_tokens, "notes": dict(self.notes)}
        if self.tile_tokens is not None:
            t = self.tile_tokens
            data["tile_tokens"] = dict(t) if isinstance(t, Mapping) else t
        if self.kernels is not None:
            k = self.kernels
            data["kernels"] = dict(k) if isinstance(k, Mapping) else k
        return data

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "plan") -> "Plan":
        """A plan from its :meth:`to_dict` form; ValueError naming ``source`` and the field if wrong."""
        if not isinstance(data, Mapping) or "blocks" not in data:
            raise ValueError(f"{source} is not a remat plan: expected a JSON object with 'version' and "
                             f"'blocks', got {_describe(data)}; write plans with Plan.save or `remat plan --out`")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise ValueError(f"{source}: plan version {version!r} is not supported by this remat "
                             f"(reads version {PLAN_VERSION}); re-create it with `remat plan`")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{source}: unknown fields {unknown}; a plan has {', '.join(_FIELDS)}")
        notes = data.get("notes")
        try:
            return cls(data["blocks"], data.get("head", "plain"), data.get("chunk_tokens"),
                       {} if notes is None else notes, data.get("tile_tokens"), data.get("kernels"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)  # never leave a half-written plan where a good one was

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON ({e}); expected a plan written by "
                                 "Plan.save or `remat plan --out`") from None
        return cls.from_dict(data, source=path)

    @property
    def made_for(self) -> dict:
        """What this plan was made for, as far as it says: ``model`` (class name), ``blocks`` (how
        many; a solved plan names every block of its model), ``dtype``, ``batch``, ``seq``,
        ``optimizer``, ``gpu`` (the rates that timed it), ``compile`` (None, ``"model"`` or
        ``"blocks"``) and ``versions``. A spec or a hand-made plan says nothing: ``{}``."""
        notes = self.notes
        if not is_solved(self):
            return {}
        made = {key: notes[key] for key in _MADE_FOR if key in notes}
        made["blocks"] = len(self.blocks)
        made["compile"] = (notes.get("compile_scope") or "model") if notes.get("compile") else None
        return made

    def summary(self) -> str:
        counts = {}
        for t in self.blocks.values():
            t = "segment" if segment_of(t) is not None else t
            counts[t] = counts.get(t, 0) + 1
        parts = [f"{n}x {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        segments = {segment_of(t) for t in self.blocks.values()} - {None}
        if segments:
            parts = [p + f" (in {len(segments)} segments)" if p.endswith(" segment") else p for p in parts]
        head = self.head + (f"({self.chunk_tokens})" if self.head == "chunked" and self.chunk_tokens else "")
        return f"{', '.join(parts) or 'no blocks'}; head {head}{self._tiles_summary()}{self._kernels_summary()}"

    def _kernels_summary(self) -> str:
        """``"; Liger kernels"``, ``"; Liger kernels on 12 of 16 blocks"``, or empty (stock modules)."""
        liger = sum(self.kernel_of(name) == "liger" for name in self.blocks)
        if not liger:
            return ""
        return "; Liger kernels" + ("" if liger == len(self.blocks) else f" on {liger} of {len(self.blocks)} blocks")

    def _tiles_summary(self) -> str:
        """``"; tiles of 4096 tokens"``, or each size with its blocks where they differ
        (``"; tiles of 8192 tokens (30 blocks), 2048 (2 blocks)"``); empty where nothing is tiled
        or no size is named."""
        tiled = [name for name, t in self.blocks.items() if t in TILED_TREATMENTS]
        sizes = [self.tile_of(name) for name in tiled]
        if not any(sizes):
            return ""
        if len(set(sizes)) == 1:
            return f"; tiles of {sizes[0]} tokens"
        counts = {}
        for size in sizes:
            key = size or DEFAULT_TILE_TOKENS
            counts[key] = counts.get(key, 0) + 1
        parts = [f"{size} ({n} block{'s' * (n != 1)})" for size, n in sorted(counts.items(), reverse=True)]
        return f"; tiles of {parts[0].replace(' ', ' tokens ', 1)}" + "".join(f", {p}" for p in parts[1:])


_MADE_FOR = ("model", "dtype", "batch", "seq", "optimizer", "gpu", "versions")


def is_solved(plan: Plan) -> bool:
    """Whether ``plan`` came from the solver and says for which model (its prediction and the model's
    class are in its notes), so names every block of that model; a spec resolved over a model's
    blocks, a hand-made plan or a plan file from before these notes is not held to that."""
    return "predicted_peak_bytes" in plan.notes and "model" in plan.notes


def versions() -> dict:
    """The versions of torch, transformers and remat this process runs, for those imported (read
    from the loaded modules: planning imports neither)."""
    found = {}
    for name in ("torch", "transformers", "remat"):
        version = getattr(sys.modules.get(name), "__version__", None)
        if version is not None:
            found[name] = str(version)
    return found


def made_for_notes(*, model: str, dtype: str) -> dict:
    """The notes the solver adds beside ``gpu``/``batch``/``seq``/``optimizer`` so that a plan knows
    the model it was made for (see :attr:`Plan.made_for`)."""
    return {"model": model, "dtype": dtype, "versions": versions()}


def _renamed(plan: Plan, block_names: list, strict: bool = True) -> Plan:
    """``plan`` over ``block_names``: as it is when it names them, else with each name mapped to
    the one block name that ends with ``"." + name`` or is such a suffix of it. That makes a
    plan portable between a base model and its PEFT wrapper (``model.layers.0`` and
    ``base_model.model.model.layers.0``); a name that maps to no block or to several, or two
    names to one block, is refused. ``strict``: a solved plan (:func:`is_solved`) must also cover
    every block of the model, one for one (a plan for 4 blocks on a model of 8 is refused, naming
    the first block it lacks); not strict, the blocks it does not name keep everything."""
    if all(name in block_names for name in plan.blocks):
        renamed = plan
    else:
        mapping = {}
        for name in plan.blocks:
            found = [n for n in block_names if n == name or n.endswith("." + name) or name.endswith("." + n)]
            if len(found) != 1:
                raise ValueError(f"plan names a block this model does not have: {name!r} matches "
                                 f"{len(found) or 'no'} block(s) (model blocks: {block_names[:3]} ...); was it "
                                 f"made for another model?{_made_for_text(plan)} Plan this model with remat.plan")
            mapping[name] = found[0]
        if len(set(mapping.values())) != len(mapping):
            raise ValueError("two of the plan's blocks map to one block of this model (names are ambiguous); "
                             f"was it made for another model?{_made_for_text(plan)}")
        tiles, kernels = plan.tile_tokens, plan.kernels
        if isinstance(tiles, Mapping):
            tiles = {mapping[k]: v for k, v in tiles.items()}
        if isinstance(kernels, Mapping):
            kernels = {mapping[k]: v for k, v in kernels.items()}
        renamed = Plan(blocks={mapping[k]: v for k, v in plan.blocks.items()}, head=plan.head,
                       chunk_tokens=plan.chunk_tokens, notes=plan.notes, tile_tokens=tiles, kernels=kernels)
    if strict and is_solved(plan) and len(renamed.blocks) != len(block_names):
        missing = next(n for n in block_names if n not in renamed.blocks)
        raise ValueError(
            f"the plan does not match this model's blocks: it treats {len(plan.blocks)} blocks, this model has "
            f"{len(block_names)}, and the first it does not name is {missing!r}.{_made_for_text(plan)} Plan this "
            "model with remat.plan(model, batch, budget), or pass strict=False to apply the blocks the plan names "
            "and keep the rest")
    return renamed


def _made_for_text(plan: Plan) -> str:
    made = plan.made_for
    if not made:
        return ""
    shape = f", batch {made['batch']} x {made['seq']}" if "batch" in made and "seq" in made else ""
    return f" It was made for {made.get('model', 'a model')} with {made['blocks']} blocks{shape}."


def resolve(spec, block_names, *, strict: bool = True) -> Plan:
    """Turn a spec (string, Plan or mapping) into a Plan over ``block_names``. ``strict``: a
    solved plan must cover these blocks one for one (see :func:`_renamed`)."""
    block_names = list(block_names)
    if isinstance(spec, Plan):
        return _check_segments(_renamed(spec, block_names, strict), block_names)
    if isinstance(spec, Mapping):
        return resolve(Plan(dict(spec)), block_names)
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a treatment name, 'every:N', 'first:N', 'segments:K' or a remat.Plan; "
                        f"got {type(spec).__name__}")
    if spec in TREATMENTS:
        return Plan({name: spec for name in block_names})
    kind, _, rest = spec.partition(":")
    count, _, treatment = rest.partition(":")
    if kind == "segments":
        return _segments(spec, count, treatment, block_names)
    treatment = treatment or "full"
    grammar = (f"expected one of {', '.join(TREATMENTS)}, 'every:N[:treatment]' or 'first:N[:treatment]' with "
               "N >= 1, or 'segments:K' / 'segments:sqrt'")
    if kind not in ("every", "first"):
        raise ValueError(f"cannot read spec {spec!r}: {kind!r} is neither a treatment nor 'every'/'first'/"
                         f"'segments'; {grammar}")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"cannot read spec {spec!r}: N must be a whole number >= 1, got {count!r}; {grammar}")
    if treatment not in TREATMENTS:
        raise ValueError(f"cannot read spec {spec!r}: unknown treatment {treatment!r}; {grammar}")
    n = int(count)
    if kind == "first" and n > len(block_names):
        span = f" ({block_names[0]} .. {block_names[-1]})" if block_names else ""
        every = f"first:{len(block_names)}" + (f":{treatment}" if ":" in rest else "")
        raise ValueError(f"cannot apply spec {spec!r}: it asks for the first {n} blocks, but the model has "
                         f"{len(block_names)}{span}; pass {every!r} or {treatment!r} to treat every block, "
                         "or a smaller N")
    chosen = block_names[::n] if kind == "every" else block_names[:n]
    return Plan({name: (treatment if name in chosen else "keep") for name in block_names})


def _segments(spec: str, count: str, extra: str, block_names: list) -> Plan:
    """``segments:K`` / ``segments:sqrt``: runs of K consecutive blocks of one list, numbered in order."""
    grammar = ("expected 'segments:K' (K blocks per segment, a whole number >= 1) or 'segments:sqrt' "
               "(K = round(sqrt(blocks in the list)))")
    if extra:
        raise ValueError(f"cannot read spec {spec!r}: a segment is recomputed whole, it takes no treatment "
                         f"({extra!r}); {grammar}")
    if count != "sqrt" and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"cannot read spec {spec!r}: K must be a whole number >= 1 or 'sqrt', got {count!r}; "
                         f"{grammar}")
    lists = {}  # blocks by the container they are in ("model.layers" -> [...]), in order
    for name in block_names:
        lists.setdefault(name.rpartition(".")[0], []).append(name)
    blocks, number = {}, 0
    for names in lists.values():
        size = max(1, round(math.sqrt(len(names)))) if count == "sqrt" else int(count)
        for start in range(0, len(names), size):
            blocks.update({name: f"segment:{number}" for name in names[start:start + size]})
            number += 1
    return Plan({name: blocks[name] for name in block_names})


def _check_segments(plan: Plan, block_names: list) -> Plan:
    """``plan``, if each of its segments is a run of consecutive blocks; else a ValueError."""
    where = {}
    for index, name in enumerate(block_names):
        number = segment_of(plan.blocks.get(name))
        if number is not None:
            where.setdefault(number, []).append(index)
    for number, indices in where.items():
        if indices != list(range(indices[0], indices[0] + len(indices))):
            names = [block_names[i] for i in indices]
            raise ValueError(f"segment {number} must be consecutive blocks (it is recomputed as one unit, each "
                             f"block from the output of the one before); the plan gives it {names}. Number "
                             "each run of consecutive blocks on its own, or use the 'segments:K' spec.")
    return plan


def _checked_tiles(tiles, blocks: Mapping):
    """``tiles`` (a plan's ``tile_tokens``) as the plan holds it: None, an int, or a read-only
    ``{block name: int}`` over blocks the plan tiles; a ValueError that says what is wrong otherwise."""
    if tiles is None:
        return None
    what = ("'tile_tokens' must be a positive integer (tokens per chunk of the tiled blocks' token-wise "
            "sub-modules), a mapping of tiled block names to such integers, or None for the default "
            f"{DEFAULT_TILE_TOKENS}")
    if isinstance(tiles, Mapping):
        bad = {k: v for k, v in tiles.items() if not _positive_int(v)}
        if bad or not all(isinstance(k, str) for k in tiles):
            raise ValueError(f"{what}; got the mapping {dict(tiles)!r}, whose entries {bad or dict(tiles)!r} are not "
                             "block name -> positive integer")
        untiled_names = [k for k in tiles if blocks.get(k) not in TILED_TREATMENTS]
        if untiled_names:
            raise ValueError(f"'tile_tokens' names blocks the plan does not tile: {untiled_names[:3]} (treatments: "
                             f"{[blocks.get(k, 'not in the plan') for k in untiled_names[:3]]}); name only blocks "
                             f"whose treatment is one of {', '.join(TILED_TREATMENTS)}")
        return MappingProxyType({k: int(v) for k, v in tiles.items()})
    if not _positive_int(tiles):
        raise ValueError(f"{what}; got {tiles!r} ({type(tiles).__name__})")
    return int(tiles)


def _checked_kernels(kernels, blocks: Mapping):
    """``kernels`` (a plan's) as the plan holds it: None, one of :data:`KERNELS`, or a read-only
    ``{block name: kernel}`` over the plan's blocks; a ValueError that says what is wrong otherwise."""
    if kernels is None:
        return None
    what = (f"'kernels' must be one of {', '.join(KERNELS)} (for every block), a mapping of the plan's block names "
            "to those, or None for the model's own modules")
    if isinstance(kernels, Mapping):
        bad = {k: v for k, v in kernels.items() if not isinstance(k, str) or v not in KERNELS}
        if bad:
            raise ValueError(f"{what}; got the mapping entries {bad!r}")
        unknown = [k for k in kernels if k not in blocks]
        if unknown:
            raise ValueError(f"'kernels' names blocks the plan does not have: {unknown[:3]}; name only blocks of "
                             "'blocks'")
        return MappingProxyType(dict(kernels))
    if kernels not in KERNELS:
        raise ValueError(f"{what}; got {kernels!r} ({type(kernels).__name__})")
    return kernels


def _positive_int(value) -> bool:
    """A positive whole number: not a bool, a float (2.5, 2.0) or a string."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value > 0


def _describe(value) -> str:
    return "an object without 'blocks'" if isinstance(value, Mapping) else f"a JSON {type(value).__name__}"
