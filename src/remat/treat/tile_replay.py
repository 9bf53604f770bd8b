"""Dropout inside a tiled sub-module, drawn as the untreated call draws it: exact under tiling.

In the untreated model, dropout inside a token-wise sub-module draws one mask over the whole
sequence. Run a chunk at a time, each chunk would draw its own, smaller mask: other random
numbers than the untreated model's. :class:`Replay`, a dispatch mode around the chunks, instead
draws each random op's full mask once, at the op's first chunk, with the very op and shape the
untreated call would use (so the same random numbers), and hands each chunk its rows; the
backward's recompute replays the stored masks without drawing. So a tiled block is exact with
dropout on.

Limits: only dropout's ops (``bernoulli_``, ``native_dropout``) are replayed; any other random
op inside a tiled sub-module is refused, and so is a draw over a tensor that is not a whole
number of rows of its chunk. Eager only: under ``torch.compile`` the chunks draw their own masks.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Replay(TorchDispatchMode):
    """Random ops inside a tiled sub-module, drawn once over the whole sequence as the untreated
    call draws them, handed out a chunk of rows at a time, and replayed in backward's recompute."""

    _DROPOUT = ("bernoulli_", "native_dropout")

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows
        self.drawn = []        # per random op, in call order: the full-sequence draw
        self.start = self.end = 0
        self.index = 0

    def chunk(self, start: int, end: int):
        self.start, self.end, self.index = start, end, 0
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in self._DROPOUT:
            raise ValueError(f"a tiled sub-module draws random numbers with {func}; only dropout's draws can be "
                             "tiled exactly. Use 'full' or 'mlp' for this block instead of a tiled treatment.")
        target = args[0]
        if target.numel() % (self.end - self.start):
            raise ValueError(f"a tiled sub-module draws random numbers ({func}) over a tensor of shape "
                             f"{tuple(target.shape)} that is not a whole number of rows of its chunk")
        width = target.numel() // (self.end - self.start)
        if self.index == len(self.drawn):  # first chunk of this op: the whole sequence's draw
            full = target.new_empty(self.rows * width)
            if name == "native_dropout":
                self.drawn.append(func(full, *args[1:], **kwargs)[1])
            else:
                self.drawn.append(func(full, *args[1:], **kwargs))
        whole = self.drawn[self.index]
        self.index += 1
        part = whole[self.start * width:self.end * width].view(target.shape)
        if name == "native_dropout":
            p = args[1]
            scale = 1.0 / (1.0 - p) if p < 1 else 0.0
            return torch.ops.aten.native_dropout_backward(target, part, scale), part
        return target.copy_(part)
