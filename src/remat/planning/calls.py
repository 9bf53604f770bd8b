"""Blocks called more than once a step: the profile as the step runs it, one entry per call.

ALBERT shares one layer group across its layers: ``albert.encoder.albert_layer_groups.0`` is one
module that the encoder calls ``num_hidden_layers`` times a forward (with ``inner_group_num > 1``
the group's layers are the blocks, called in turn; with ``num_hidden_groups > 1`` each group is a
block, called for its share of the layers). remat treats such a module as one block: a treatment
is installed on a module, so it applies to every call, and a plan names it once.
:attr:`Profile.block_calls <remat.planning.costs.Profile.block_calls>` lists the step's calls in
the order its forward makes them, and :func:`unrolled` turns the profile into one whose blocks are
the calls, which the simulator walks as it walks any stack: each call keeps what its treatment
keeps, takes its seconds and hands its own bytes to the offload engine (which opens one record per
call), and each call's input is the previous call's output. So a block called N times keeps N
times, recomputes N times, offloads N times.

One difference from N distinct blocks: the module's parameter gradients exist once. Autograd sums
the calls' contributions into one buffer, made by the first backward (the last call's) and handed
to ``.grad`` after the last; so the call whose backward runs first leaves
:attr:`~remat.planning.costs.BlockCost.grad_bytes` and the others leave that much less. Their
backward peak is the one measured alone, where the new gradients stay to the end (in the step
each is summed into the buffer and freed): conservative by up to one block's gradients (how much
that is on ALBERT: docs/design/planning.md).

Plans stay per module: :func:`per_call` expands one treatment per block into one per call, and the
solver ties every call of a block to one treatment (:func:`pinned`). A treatment per call (every
other call checkpointed) cannot be installed on one module; ``"every:2"`` counts modules, not calls.
The time models of FSDP2 and DDP (:mod:`~remat.planning.sharding`,
:mod:`~remat.planning.replication`) are per module and refuse such a profile
(:func:`refuse_calls`): a plan made for one GPU applies under them, its prediction without the
collectives.
"""
from __future__ import annotations

from dataclasses import replace


def calls(profile) -> tuple:
    """Block indices of the step's calls, in order (each block once, in order, where none repeats)."""
    return tuple(profile.block_calls) or tuple(range(len(profile.block_names)))


def repeated(profile) -> list:
    """Indices of the blocks called more than once a step, in block order."""
    order = calls(profile)
    return [index for index in range(len(profile.block_names)) if order.count(index) > 1]


def unrolled(profile):
    """``profile`` with one block per call (see the module doc): ``name#k`` for the k-th call of a
    block called several times; ``profile`` itself where no block repeats."""
    if not profile.block_calls:
        return profile
    order = calls(profile)
    last = {index: j for j, index in enumerate(order)}   # the call whose backward runs first
    seen, names, classes, block_class, again = {}, [], list(profile.classes), [], {}
    tiles = list(profile.tiles)   # the tiled costs at other chunks, per class, follow the classes
    for j, index in enumerate(order):
        seen[index] = seen.get(index, 0) + 1
        name = profile.block_names[index]
        names.append(name if order.count(index) == 1 else f"{name}#{seen[index]}")
        cls = profile.block_class[index]
        if j != last[index]:  # its gradients go into the buffer the first backward made
            if cls not in again:
                again[cls] = len(classes)
                classes.append({t: replace(c, bwd_end=c.bwd_end - c.grad_bytes)
                                for t, c in profile.classes[cls].items()})
                if tiles:
                    tiles.append({size: {t: replace(c, bwd_end=c.bwd_end - c.grad_bytes) for t, c in costs.items()}
                                  for size, costs in profile.tiles[cls].items()})
            cls = again[cls]
        block_class.append(cls)
    return replace(profile, block_names=tuple(names), block_class=tuple(block_class), classes=tuple(classes),
                   tiles=tuple(tiles), block_calls=())


def per_call(profile, treatments) -> tuple:
    """``(unrolled profile, treatments per call)`` for ``treatments`` given per block of ``profile``."""
    if not profile.block_calls:
        return profile, list(treatments)
    return unrolled(profile), each_call(profile, treatments)


def each_call(profile, values) -> list:
    """``values`` given per block of ``profile`` (treatments, chunk sizes), one per call."""
    values = list(values)
    return [values[index] for index in calls(profile)] if profile.block_calls else values


def per_block(profile, treatments) -> list:
    """The treatment of each block of ``profile`` from ``treatments`` given per call (its first call's)."""
    order = calls(profile)
    return [treatments[order.index(index)] for index in range(len(profile.block_names))]


def pinned(profile, pins: dict):
    """:func:`unrolled` ``profile`` in which every call of block ``b`` can take only ``pins[b]``: the
    solver's view of one choice for the blocks called several times."""
    flat = unrolled(profile)
    classes, block_class, made = list(flat.classes), list(flat.block_class), {}
    tiles = list(flat.tiles)
    for j, index in enumerate(calls(profile)):
        if index in pins:
            pin = pins[index]
            key = (flat.block_class[j], pin)
            if key not in made:
                made[key] = len(classes)
                classes.append({pin: flat.classes[key[0]][pin]})
                if tiles:
                    tiles.append({size: {pin: costs[pin]} for size, costs in flat.tiles[key[0]].items()
                                  if pin in costs})
            block_class[j] = made[key]
    used = sorted(set(block_class))   # only the classes some call has: what profile.treatments() offers
    return replace(flat, classes=tuple(classes[c] for c in used), tiles=tuple(tiles[c] for c in used) if tiles else (),
                   block_class=tuple(used.index(c) for c in block_class))


def refuse_calls(profile, what: str) -> None:
    """ValueError where ``profile`` has a block called several times a step: ``what`` is not modelled."""
    if not profile.block_calls:
        return
    names = [profile.block_names[i] for i in repeated(profile)]
    count = calls(profile).count(repeated(profile)[0])
    raise ValueError(f"{what} is not modelled for a model whose blocks run several times a step ({names[0]} runs "
                     f"{count} times{f', and {len(names) - 1} more blocks repeat' if len(names) > 1 else ''}): "
                     "plan for one GPU (ddp_world=1, fsdp_world=1) and apply that plan, its prediction then "
                     "without the collectives, or apply a treatment by name")

