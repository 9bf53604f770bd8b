"""Kernels as a dimension of the plan: a profile measured with several kernels, one choice at a time.

A profile made with ``kernels=("stock", "liger")`` (:func:`remat.profile`) holds each block class
twice: as the model's own modules and with liger-kernel's fused norms, gated MLP and rotary
embedding installed on its blocks (:mod:`remat.treat.kernels`); the extra classes are listed in
:attr:`~remat.planning.costs.Profile.kernel_variants` and no block uses them yet. A *choice* names a
kernel per used block class; :func:`with_kernels` turns the profile into the one whose blocks run
that choice (the unused classes dropped), which the simulator and the solver read as any profile,
and :func:`kernel_choices` lists the choices the planner solves (:func:`remat.plan` keeps the one
whose plan is fastest). The head's kernel is not here: Liger's fused loss is a head mode
(``"liger"``) that the solver chooses among the others.

Why per block class and not per block inside the dynamic programme: blocks of one class cost the
same under either kernel, and the fused kernels keep less and run faster than the stock modules
they replace on every block measured so far, so a plan mixing them within one class buys nothing;
per class, a model's classes (Gemma-2's sliding and global layers, a hybrid's) can still differ,
and the solver's state and tables stay as they are. Past :data:`KERNEL_CHOICES` choices (many
classes) each kernel is taken for every class that has it.

Pure: names and numbers, as the rest of :mod:`remat.planning`.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional

from remat.planning.plans import KERNELS

KERNEL_CHOICES = 16
"""The most per-class kernel choices :func:`kernel_choices` lists; beyond, one kernel for all classes."""


def kernel_options(kernels) -> tuple:
    """``kernels`` as :func:`remat.profile` and :func:`remat.plan` take it, as a tuple of names: None
    (the blocks as they are) is ``()``, a name is one option, a sequence several; ValueError otherwise."""
    if kernels is None:
        return ()
    names = (kernels,) if isinstance(kernels, str) else tuple(kernels) if isinstance(kernels, (tuple, list)) else None
    if not names or any(k not in KERNELS for k in names):
        raise ValueError(f"kernels must be None (the model's modules as they are), one of {', '.join(KERNELS)}, or "
                         f"several of them (kernels=('stock', 'liger'): measured both ways, chosen per block class); "
                         f"got {kernels!r}")
    return tuple(dict.fromkeys(names))


def used_classes(profile) -> list:
    """The block classes some block of ``profile`` uses, in order."""
    return sorted(set(profile.block_class))


def class_kernel(profile, cls: int) -> str:
    """The kernels block class ``cls`` of ``profile`` was measured with (``stock`` unless it says)."""
    return profile.class_kernels[cls] if profile.class_kernels else "stock"


def kernel_choices(profile) -> list:
    """``[{block class: kernel}]``: every choice of a kernel per used class of ``profile`` (the
    measured kernel first, so ties go to it), or one kernel for all classes past
    :data:`KERNEL_CHOICES`; ``[{}]`` for a profile of one kernel per class."""
    if not profile.kernel_variants:
        return [{}]
    used = used_classes(profile)
    options = [sorted(profile.kernel_variants[c], key=lambda k: (k != class_kernel(profile, c), k)) for c in used]
    combos = list(itertools.islice(itertools.product(*options), KERNEL_CHOICES + 1))
    if len(combos) > KERNEL_CHOICES:
        names = sorted({k for own in options for k in own})
        combos = [tuple(k if k in own else own[0] for own in options) for k in names]
    return [dict(zip(used, combo)) for combo in combos]


def with_kernels(profile, choice: dict):
    """``profile`` whose blocks of each class in ``choice`` run its kernel (the variant measured
    for them); the classes no block uses then are dropped, and the result has no variants left."""
    variants = profile.kernel_variants
    if not variants:
        return profile
    target = {}
    for cls in used_classes(profile):
        kernel = choice.get(cls, class_kernel(profile, cls))
        if kernel not in variants[cls]:
            raise ValueError(f"block class {cls} was not profiled with kernels {kernel!r} (profiled: "
                             f"{', '.join(sorted(variants[cls]))})")
        target[cls] = variants[cls][kernel]
    block_class = [target[c] for c in profile.block_class]
    kept = sorted(set(block_class))
    index = {c: i for i, c in enumerate(kept)}
    return replace(profile, classes=tuple(profile.classes[c] for c in kept),
                   tiles=tuple(profile.tiles[c] for c in kept) if profile.tiles else (),
                   class_kernels=tuple(class_kernel(profile, c) for c in kept), kernel_variants=(),
                   block_class=tuple(index[c] for c in block_class))


def block_kernels(profile) -> list:
    """The kernels each block of ``profile`` runs, in block order."""
    return [class_kernel(profile, c) for c in profile.block_class]


def plan_kernels(block_names, kernels) -> Optional[object]:
    """A plan's ``kernels`` for blocks running ``kernels`` (one name per block): None where every
    block is stock, one name where all share it, else a ``{block name: kernel}`` mapping."""
    names = set(kernels)
    if names <= {"stock"}:
        return None
    if len(names) == 1:
        return names.pop()
    return dict(zip(block_names, kernels))
