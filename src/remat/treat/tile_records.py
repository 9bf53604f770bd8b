"""Outputs a model records through forward hooks inside a tiled sub-module (MoE router logits).

Transformers 5 records an MoE's router logits for the auxiliary loss with forward hooks that
append to the model's output collector. Run in chunks, each chunk's hook would record that
chunk's rows, computed without gradient. :class:`Recorded` notes which collector entries the
chunks added; the tiled function returns, per recorded output, the chunks' rows concatenated
(tokens are the leading dimension, as in the untreated call) as outputs of its own, and these
take the place of the chunks' records in the collector. So the auxiliary loss sees the same
tensor, and its gradient reaches the router through the tiled function's backward, which
captures the same outputs of its recompute with hooks of its own (:meth:`Recorded.capture`).

Limits: a recorded output must have the tokens as its leading dimension, the chunks must record
alike, and a transformers whose recording remat cannot follow is refused with the fix.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn


class Recorded:
    """The outputs the model records through forward hooks while one tiled call runs (see the module doc)."""

    def __init__(self, module: nn.Module):
        self.hooked = [m for m in module.modules() if m._forward_hooks]
        self.collector = _collector() if self.hooked else None
        if self.hooked and "transformers.utils.output_capturing" not in sys.modules and any(
                getattr(hook, "__module__", "").startswith("transformers")
                for m in self.hooked for hook in m._forward_hooks.values()):
            raise ValueError(
                f"a tiled {type(module).__name__} holds modules whose outputs this transformers records through "
                "hooks remat cannot follow (MoE router logits for the auxiliary loss); run in chunks they "
                "would be recorded per chunk and without gradient. Set output_router_logits=False, use "
                "'full'/'mlp' for these blocks, or a transformers whose recording remat follows (5.24 is one).")
        self.sources = []     # per record, in call order within a chunk: (module, index in its output)
        self.slots = []       # per record: (list, [positions]) in the collector, one position per chunk

    def run(self, run, chunk, first: bool):
        """``run(chunk)``, noting which of the hooked modules' outputs the collector received."""
        if not self.collector:
            return run(chunk)
        seen, handles = [], [m.register_forward_hook(lambda m, a, o: seen.append((m, o))) for m in self.hooked]
        lengths = {key: len(value) for key, value in self.collector.items() if isinstance(value, list)}
        try:
            out = run(chunk)
        finally:
            for handle in handles:
                handle.remove()
        new = [(key, position) for key, value in self.collector.items() if isinstance(value, list)
               for position in range(lengths.get(key, 0), len(value))]
        if first:
            for key, position in new:
                self.sources.append(_source(seen, self.collector[key][position]))
                self.slots.append((self.collector[key], []))
        if len(new) != len(self.slots):
            raise ValueError("a tiled sub-module's recorded outputs differ from chunk to chunk; use 'full' or "
                             "'mlp' for this block instead of a tiled treatment")
        for (key, position), (_, positions) in zip(new, self.slots):
            positions.append(position)
        return out

    def concatenated(self) -> list:
        return [torch.cat([values[p] for p in positions]) for values, positions in self.slots]

    def hand_back(self, records) -> None:
        for (values, positions), record in zip(self.slots, records):
            values[positions[0]] = record
            for position in reversed(positions[1:]):
                del values[position]

    def capture(self):
        """Hooks that collect, during a recompute, the outputs :meth:`run` saw recorded."""
        found, handles = [], []
        for module in {id(m): m for m, _ in self.sources}.values():
            def hook(m, a, output):
                for source, index in self.sources:
                    if source is m:
                        found.append(output if index is None else output[index])
            handles.append(module.register_forward_hook(hook))
        return found, handles


def _collector():
    capturing = sys.modules.get("transformers.utils.output_capturing")
    active = getattr(capturing, "_active_collector", None)
    return active.get() if active is not None else None


def _source(seen: list, record) -> tuple:
    for module, output in seen:
        if output is record:
            return module, None
        if isinstance(output, (tuple, list)):
            for index, value in enumerate(output):
                if value is record:
                    return module, index
    raise ValueError("a tiled sub-module's output was recorded by a hook remat cannot follow; use 'full' or "
                     "'mlp' for this block instead of a tiled treatment")
