"""The two meters a profile reads: live bytes and seconds per phase, fake or on a GPU.

How: a meter hands out *marks* at phase boundaries (``begin`` then ``mark`` per phase,
``finish`` to turn raw marks into (now, peak, seconds) tuples), so one profiling run
serves both devices.

- Fake (CPU-only) runs: :class:`_Tracker` is a ``TorchDispatchMode`` that counts every new
  storage once (rounded to the allocator's granularity) and frees it through a weak
  reference when it dies, so views and in-place results cost nothing, as on a GPU. Each
  op that makes a kernel is priced by a roofline (:func:`_op_seconds`): FLOPs from
  ``torch.utils.flop_counter``'s formulas over the matmul rate, or bytes read and written
  over HBM bandwidth, whichever is larger, plus a launch cost.
- CUDA runs: :class:`_CudaMeter` reads the caching allocator's ``memory_allocated`` and
  ``max_memory_allocated`` and records CUDA events, synchronising only in ``finish``, so
  runs can be queued back to back as a step queues them (:func:`_chain`).

Why not ``torch.cuda.memory._record_memory_history``: it needs a GPU and a trace per run;
the tracker works on fake tensors with no memory and no weights.

Limits: the roofline knows FLOPs only where ``flop_counter`` has a formula, and attention's
from its shapes (:func:`_attention_seconds`); everything else is priced by bytes moved. Its
efficiencies were calibrated once against H100 anchors on the bench model; attention runs at
the rates measured per head dimension (:attr:`Rates.attention`).
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import weakref
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat import caches
from remat.planning.costs import Rates

# Roofline efficiencies and launch cost, calibrated once against the H100 anchors
# (eager 0.355 s, full checkpointing 0.434 s on the bench model).
MATMUL_EFFICIENCY = 0.9
ATTENTION_EFFICIENCY = 0.45
HBM_EFFICIENCY = 0.75
LAUNCH_S = 4e-6
_ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
METADATA_QUERIES = frozenset({torch.ops.prim.device.default, torch.ops.aten.size.default, torch.ops.aten.stride.default,
                              torch.ops.aten.storage_offset.default})
"""Ops that read a tensor's metadata and make nothing. Under a Python dispatch mode each ``tensor.device``
dispatches ``prim.device`` (the autograd engine asks it of every tensor in backward): two thirds of a
fake profile's dispatches, which the fake profile's modes pass straight on."""


class _Tracker(TorchDispatchMode):
    """Live storage bytes and roofline seconds of every op run under it."""

    def __init__(self, rates: Rates):
        super().__init__()
        self.rates = rates
        self.live = {}
        self.current = 0
        self.peak = 0
        self.seconds = 0.0
        self.weight = 1  # how many times each op's seconds count: see repeated()
        self.ran = set()  # every op but views and metadata queries, since the meter's last begin()

    @contextlib.contextmanager
    def repeated(self, times: int):
        """Each op run inside counts ``times`` times in the seconds (not in memory): it stands for
        identical runs left out (:func:`remat.treat.tiled.sampled_chunks`)."""
        was, self.weight = self.weight, self.weight * times
        try:
            yield
        finally:
            self.weight = was

    def _free(self, key, size, _ref):
        if self.live.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in METADATA_QUERIES or (_is_view(func) and _views_of_first(args, out)):
            return out  # no new storage, no kernel
        self.ran.add(func)
        inputs = tensors_of((args, kwargs))
        seen = {id(t.untyped_storage()) for t in inputs}
        moved = sum(t.numel() * t.element_size() for t in inputs)
        kernel = _is_mutable(func)
        g = self.rates.granularity
        for t in tensors_of(out):
            storage = t.untyped_storage()
            key = id(storage)
            if key in seen:
                continue  # a view or an in-place result: no new memory
            kernel = True
            moved += t.numel() * t.element_size()
            if key not in self.live:
                size = -(-storage.nbytes() // g) * g
                self.live[key] = weakref.ref(storage, partial(self._free, key, size))
                self.current += size
        self.peak = max(self.peak, self.current)
        if kernel:
            self.seconds += self.weight * _op_seconds(func, args, kwargs, out, moved, self.rates)
        return out


def tensors_of(value) -> list:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dicts), in the order
    ``torch.utils._pytree.tree_flatten`` lists them: what an aten op takes and returns holds no
    other container, and this walk costs a tenth of the general one, on every op of a fake profile."""
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    if isinstance(value, (tuple, list, dict)):
        _collect(value.values() if isinstance(value, dict) else value, found)
    return found


def _collect(items, found: list) -> None:
    """The tensors among ``items`` and the containers they hold, appended to ``found`` in order (a call
    per container, not per element: an op's arguments hold lists of sizes)."""
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            _collect(item, found)
        elif isinstance(item, dict):
            _collect(item.values(), found)


_MUTABLE = caches.register({}, "profiling._meters._MUTABLE")
_FORMULAS = caches.register({}, "profiling._meters._FORMULAS")


_VIEWS = caches.register({}, "profiling._meters._VIEWS")


def _is_view(func) -> bool:
    """Whether ``func`` only makes views of its inputs (every return aliases one, none written): it
    allocates nothing and runs no kernel. Read once per op."""
    view = _VIEWS.get(func)
    if view is None:
        schema = func._schema
        view = _VIEWS[func] = bool(schema.returns) and not schema.is_mutable and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    return view


def _views_of_first(args, out) -> bool:
    """Whether every tensor ``out`` holds shares the storage of the op's first argument (a view of a
    tensor the fake mode had to convert first, a real constant, is a new fake storage: counted)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    base = id(args[0].untyped_storage())
    return all(id(t.untyped_storage()) == base for t in tensors_of(out))


def _is_mutable(func) -> bool:
    """Whether ``func`` writes an input (its schema says so), read once per op."""
    mutable = _MUTABLE.get(func)
    if mutable is None:
        mutable = _MUTABLE[func] = bool(func._schema.is_mutable)
    return mutable


def _formula(func):
    """``(attention, flop formula or None)`` of ``func``, looked up once per op."""
    known = _FORMULAS.get(func)
    if known is None:
        from torch.utils.flop_counter import flop_registry
        known = _FORMULAS[func] = (any(a in func.__name__ for a in _ATTENTION_OPS),
                                   flop_registry.get(func._overloadpacket))
    return known


def _op_seconds(func, args, kwargs, out, moved, rates) -> float:
    attention, formula = _formula(func)
    if attention:
        return _attention_seconds(func, args, kwargs, moved, rates)
    flops = 0.0
    if formula is not None:
        try:
            flops = float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments: bytes only
            flops = 0.0
    rate = (rates.fp32_flops if _dtype(args) == torch.float32 else rates.matmul_flops) * MATMUL_EFFICIENCY
    return max(flops / rate, moved / (rates.hbm_Bps * HBM_EFFICIENCY)) + LAUNCH_S


def _attention_seconds(func, args, kwargs, moved, rates) -> float:
    """A fused attention kernel (flash, memory-efficient, CPU flash; forward or backward) by its
    FLOPs from the shapes: ``2 * batch * heads * q_len * k_len * (qk_dim + v_dim)`` forward, 2.5
    times that backward (the scores recomputed, four products), halved where causal; at the
    rate :class:`Rates` measured for the head dimension, else a fraction of the matmul rate.
    Counted here from the shapes rather than by ``torch.utils.flop_counter``, so that every
    attention overload (flash, efficient, cuDNN, CPU flash; their backward ops) is priced alike
    whatever formulas a torch release registers for it."""
    backward = "backward" in func.__name__
    values = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    query, key, value = (values.get(n) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (query, key, value)):
        return moved / (rates.hbm_Bps * HBM_EFFICIENCY) + LAUNCH_S
    batch, heads, q_len, qk_dim = query.shape[0], query.shape[-3], query.shape[-2], query.shape[-1]
    k_len, v_dim = key.shape[-2], value.shape[-1]
    flops = 2.0 * batch * heads * q_len * k_len * (qk_dim + v_dim) * (2.5 if backward else 1.0)
    if values.get("is_causal") is True:
        flops *= 0.5
    rate = rates.attention_flops(qk_dim, backward)
    if rate is None:
        base = rates.fp32_flops if query.dtype == torch.float32 else rates.matmul_flops
        rate = base * ATTENTION_EFFICIENCY
    return max(flops / rate, moved / (rates.hbm_Bps * HBM_EFFICIENCY)) + LAUNCH_S


def _dtype(args):
    first = tensors_of(args)
    return first[0].dtype if first else torch.float32


class _TrackerMeter:
    """Marks on a :class:`_Tracker`: (current, peak, seconds) since the last mark."""

    def __init__(self, tracker: _Tracker):
        self.t = tracker
        self._seconds = tracker.seconds

    def zero(self):
        pass  # nothing is queued on a fake device

    def begin(self):
        self.t.peak = self.t.current
        self._base = self.t.current
        # each run's seconds summed from zero: a reading does not depend on how many runs came before
        self.t.seconds = self._seconds = 0.0
        self.t.ran = set()

    def ops_run(self) -> frozenset:
        """The ops (views and metadata queries aside) run since the last :meth:`begin`."""
        return frozenset(self.t.ran)

    def mark(self):
        reading = (self.t.current - self._base, self.t.peak - self._base, self.t.seconds - self._seconds)
        self.t.peak = self.t.current
        self._seconds = self.t.seconds
        return reading

    def finish(self, marks):
        return marks


class _CudaMeter:
    """Marks from the CUDA caching allocator's statistics and CUDA events."""

    def ops_run(self) -> None:
        """Not known: the ops a run dispatched are not watched on a GPU (see :meth:`_TrackerMeter.ops_run`)."""
        return None

    def zero(self):
        torch.cuda.synchronize()

    def begin(self):
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._last = torch.cuda.Event(enable_timing=True)
        self._last.record()

    def mark(self):
        now = torch.cuda.memory_allocated() - self._base
        peak = torch.cuda.max_memory_allocated() - self._base
        torch.cuda.reset_peak_memory_stats()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        start, self._last = self._last, event
        return now, peak, (start, event)

    def finish(self, marks):
        torch.cuda.synchronize()
        return [(now, peak, a.elapsed_time(b) / 1e3) for now, peak, (a, b) in marks]


def _chain(meter, run, repeats):
    """``run()`` once to warm up, then ``repeats + 1`` times back to back (no synchronisation
    between them, the garbage collector held off); the first of those is dropped. Returns the
    marks (now, peak, seconds) per phase: bytes from the last run, seconds the median; a fake
    run (``repeats`` 1) is its own.
    ``run`` returns (raw marks, extras...); the warm-up's extras are returned with the marks.
    """
    meter.zero()
    first = run()
    extras = tuple(first[1:])
    if repeats <= 1:
        return (meter.finish(first[0]),) + extras
    meter.finish(first[0])
    meter.zero()
    with _gc_paused():
        raw = [run()[0] for _ in range(repeats + 1)]
    timed = [meter.finish(r) for r in raw][1:]
    marks = [(now, peak, statistics.median(t[k][2] for t in timed)) for k, (now, peak, _) in enumerate(timed[-1])]
    return (marks,) + extras


@contextlib.contextmanager
def _gc_paused():
    """Python's garbage collector off for the ``with`` block (the young generations collected first),
    then as it was.

    A collection inside a timed run reads as a slow, host-bound phase, and its frees as the run's
    own (profile readings are medians of steady runs, as a step's median is; marks are differences
    of live bytes). Garbage left from before the block stays alive all through it, so it never
    reads as a free between two marks; the collection first keeps what piles up between runs small,
    and only the young generations are collected (the garbage of the runs just before): a full
    collection costs a tenth of a second or more once transformers is imported, once per run."""
    was = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
