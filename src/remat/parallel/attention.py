"""Attention over a sequence split across a context-parallel group, for any remat treatment.

    with context_parallel(model, group):   # forward AND backward inside
        loss = model(**shard_sequence(batch, group)).loss
        loss.backward()

How: inside the ``with``, ``torch.nn.functional.scaled_dot_product_attention`` is replaced by
:class:`CPAttention` (restored at its end, on an error too), which computes each call over the whole
sequence, the rank's queries against every rank's keys and values:

- ``"ring"`` (NCCL, the default on CUDA): torch's own context parallelism (ring attention through
  the SDPA kernels), its load-balancing flag set to the batch's layout; remat shards the batch
  itself (:mod:`remat.parallel.sequence`) as torch's ``_HeadTailLoadBalancer`` would;
- ``"gather"`` (gloo, the default on the CPU): every rank's keys and values are all-gathered and
  SDPA runs the rank's queries against them under the causal mask of the tokens' global positions
  (:func:`remat.parallel.sequence.positions`): the mathematics of one process; its backward
  (:class:`_GatherKV`) returns each rank the sum over ranks of its own keys' and values' gradients.

Why the function and not a ``TorchFunctionMode``: a recompute in backward must exchange keys and
values again, and torch's checkpoint recomputes outside any function mode entered around the step,
while the replaced function is what it calls. Each call is counted (:attr:`CPAttention.calls`);
a mask or attention dropout cannot be split this way and raises ValueError.

The ``with`` must hold the backward too (a recompute outside it would attend to the rank's piece
only): the gather path raises at its end when a forward with gradients ran and no backward did.

Limits: two layouts; the gather path holds every rank's keys and values at once (it exists so a CPU
checks the mathematics; the planner models the ring); not under ``torch.compile``. Position checks
and what the ring path has run on: ``docs/design/treatments.md``.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from remat.parallel.groups import process_group, rank_and_world
from remat.parallel.sequence import LAYOUT_TAG, check_model, positions

PATHS = ("auto", "ring", "gather")


class _GatherKV(torch.autograd.Function):
    """Every rank's keys and values, concatenated along the sequence (dim 2), in one all-gather;
    backward: each rank gets the sum over ranks of the gradient of its own piece."""

    @staticmethod
    def forward(ctx, key, value, group, rank, world):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        ctx.shapes = (key.shape, value.shape)
        flat = torch.cat([key.reshape(-1), value.reshape(-1)])
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat, group=group)
        n = key.numel()
        keys = torch.cat([p[:n].view(key.shape) for p in parts], dim=2)
        values = torch.cat([p[n:].view(value.shape) for p in parts], dim=2)
        return keys, values

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        group, rank, world = ctx.group, ctx.rank, ctx.world
        (kshape, vshape), s = ctx.shapes, ctx.shapes[0][2]
        if grad_keys is None:
            grad_keys = grad_values.new_zeros(kshape[:2] + (s * world,) + kshape[3:])
        if grad_values is None:
            grad_values = grad_keys.new_zeros(vshape[:2] + (s * world,) + vshape[3:])
        rows = torch.stack([torch.cat([grad_keys[:, :, j * s:(j + 1) * s].reshape(-1),
                                       grad_values[:, :, j * s:(j + 1) * s].reshape(-1)]) for j in range(world)])
        if _nccl(group) and rows.is_cuda:
            mine = torch.empty_like(rows[0])
            dist.reduce_scatter_tensor(mine, rows.reshape(-1), group=group)
        else:  # gloo has no reduce-scatter of tensors
            dist.all_reduce(rows, group=group)
            mine = rows[rank]
        n = kshape.numel()
        return mine[:n].view(kshape), mine[n:].view(vshape), None, None, None


class _Seen(torch.autograd.Function):
    """Identity whose backward tells the context that a backward ran through its attention."""

    @staticmethod
    def forward(ctx, out, state):
        ctx.state = state
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.backward_calls += 1
        return grad, None


class CPAttention:
    """What ``scaled_dot_product_attention`` is while :func:`context_parallel` is open: SDPA over the whole sequence.

    Made by :func:`context_parallel` (see the module doc), not by users. Its counts:

    - ``calls``: SDPA calls it computed (recomputes included);
    - ``forward_calls``: those outside a backward with gradients on;
    - ``backward_calls`` (gather path): backwards that ran through them."""

    def __init__(self, group, rank: int, world: int, path: str, previous, balance: bool = True):
        self.group, self.rank, self.world, self.path, self.balance = group, rank, world, path, balance
        self.previous = previous  # torch's ring dispatch on the ring path, the plain SDPA otherwise
        self.calls = self.forward_calls = self.backward_calls = 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if attn_mask is not None:
            raise ValueError(
                "context parallelism got an attention mask from the model: it computes causal attention over the "
                "whole sequence (SDPA's is_causal) and cannot split a mask. Pass no attention_mask (or one of all "
                "ones), no packed position_ids, and use a model without sliding-window or other masked attention")
        if dropout_p:
            raise ValueError(f"attention dropout ({dropout_p}) is not supported under context parallelism: set the "
                             "config's attention_dropout to 0")
        self.calls += 1
        in_backward = torch._C._current_graph_task_id() != -1
        if torch.is_grad_enabled() and not in_backward:
            self.forward_calls += 1
        if self.path == "ring":
            return self.previous(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                 **({"enable_gqa": enable_gqa} if enable_gqa else {}))
        out = gathered_attention(query, key, value, self.group, self.rank, self.world, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa, sdpa=self.previous, balance=self.balance)
        return _Seen.apply(out, self) if out.requires_grad else out


def gathered_attention(query, key, value, group, rank: int, world: int, *, is_causal: bool, scale=None,
                       enable_gqa: bool = False, sdpa=F.scaled_dot_product_attention, balance: bool = True):
    """The gather path: ``query`` (the rank's ``s`` tokens: its head and tail chunk with
    ``balance``, else contiguous piece ``rank``) against the all-gathered keys and values; causal
    over global positions."""
    keys, values = _GatherKV.apply(key, value, group, rank, world)
    extra = {"enable_gqa": True} if enable_gqa else {}
    if not is_causal:
        return sdpa(query, keys, values, scale=scale, **extra)
    s = query.shape[-2]
    if balance:
        if s % 2:
            raise ValueError(f"context_parallel(balance=True) got {s} tokens on a rank, which cannot be a head and "
                             "a tail chunk of equal length: the batch was cut another way; pass the same balance to "
                             "shard_sequence and context_parallel")
        whole = s * world
        mine = positions(rank, world, whole, device=query.device)
        theirs = torch.cat([positions(r, world, whole, device=query.device) for r in range(world)])
        return sdpa(query, keys, values, attn_mask=mine[:, None] >= theirs[None, :], scale=scale, **extra)
    end = (rank + 1) * s  # later ranks' keys are all masked: not computed
    keys, values = keys[:, :, :end], values[:, :, :end]
    if rank == 0:
        return sdpa(query, keys, values, is_causal=True, scale=scale, **extra)
    mask = torch.ones(s, end, dtype=torch.bool, device=query.device).tril(diagonal=rank * s)
    return sdpa(query, keys, values, attn_mask=mask, scale=scale, **extra)


@contextlib.contextmanager
def context_parallel(model: Optional[nn.Module] = None, group=None, *, attention: str = "auto",
                     balance: bool = True):
    """Run attention over the sequence split across ``group``, forward and backward inside (see the module doc).

    Args:
        model: checked first (:func:`check_model`), so a model whose attention is not SDPA is refused
            before anything runs, and its ``position_ids`` checked against the layout at each forward;
            None: neither.
        group: the CP process group, a 1-D DeviceMesh (``mesh["cp"]``) or None (the default group).
        attention: ``"ring"`` (torch's ring attention; NCCL), ``"gather"`` (all-gathered keys and
            values; any backend) or ``"auto"`` (ring on NCCL with CUDA, gather otherwise).
        balance: how the batch was cut (:func:`remat.parallel.shard_sequence`'s ``balance``):
            head-tail chunks (default) or contiguous pieces.

    Yields:
        The :class:`CPAttention` in place of SDPA (its call counts).

    Raises:
        ValueError: an unknown ``attention``, a model :func:`check_model` refuses, ``position_ids``
            not this rank's, a mask or attention dropout in a call.
        RuntimeError: at the end, where no SDPA ran, or (gather) a forward with gradients ran and no
            backward did inside the ``with``.

    Example::

        with context_parallel(model, group):
            model(**shard_sequence(batch, group)).loss.backward()"""
    if attention not in PATHS:
        raise ValueError(f"attention must be one of {', '.join(PATHS)}, got {attention!r}")
    if model is not None:
        check_model(model)
    pg = process_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    path = attention if attention != "auto" else ("ring" if _nccl(pg) and torch.cuda.is_available() else "gather")
    balance = bool(balance) and world > 1
    ring = _torch_ring(group, pg, world, balance) if path == "ring" else contextlib.nullcontext()
    with ring:
        mode = CPAttention(pg, rank, world, path, F.scaled_dot_product_attention, balance)
        hook = (model.register_forward_pre_hook(functools.partial(_check_positions, mode), with_kwargs=True)
                if model is not None and world > 1 else None)
        F.scaled_dot_product_attention = mode
        try:
            yield mode
        finally:
            F.scaled_dot_product_attention = mode.previous
            if hook is not None:
                hook.remove()
    if mode.forward_calls == 0 and mode.calls == 0 and model is not None and torch.is_grad_enabled():
        raise RuntimeError(
            f"no attention of {type(model).__name__} ran through torch.nn.functional.scaled_dot_product_attention "
            "inside context_parallel: its loss covers each rank's own piece only. Use a model whose attention calls "
            "SDPA (transformers: attn_implementation=\"sdpa\")")
    if path == "gather" and mode.forward_calls and not mode.backward_calls:
        raise RuntimeError(
            "a forward ran under context_parallel with gradients on, but no backward ran through its attention "
            "inside the `with`: call loss.backward() inside it (a treatment that recomputes attention would "
            "otherwise recompute it without the other ranks' keys and values)")


def _check_positions(mode: CPAttention, module, args, kwargs):
    """Forward pre-hook: the ``position_ids`` the model is handed are this rank's under the
    context's layout (see the module doc); ValueError otherwise."""
    ids = kwargs.get("position_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() == 0:
        return None
    want = (mode.rank, mode.world, mode.balance)
    tag = getattr(ids, LAYOUT_TAG, None)
    if tag is not None:
        ok = tuple(tag) == want
    else:  # position_ids made elsewhere: compared by value (one device sync a forward)
        local = ids.shape[-1]
        expected = positions(mode.rank, mode.world, local * mode.world, balance=mode.balance, device=ids.device) \
            if not mode.balance or local % 2 == 0 else None
        ok = expected is not None and bool((ids.reshape(-1, local) == expected).all())
    if not ok:
        how = "head-tail chunks (balance=True)" if mode.balance else "contiguous pieces (balance=False)"
        got = f" (the batch was cut for rank {tag[0]} of {tag[1]}, balance={tag[2]})" if tag is not None else ""
        raise ValueError(
            f"context_parallel splits attention as {how}, rank {mode.rank} of {mode.world}, but the model was handed "
            f"other position_ids{got}: pass the same balance (and group) to shard_sequence and context_parallel")
    return None


@contextlib.contextmanager
def _torch_ring(group, pg, world, balance: bool):
    """torch's context parallelism, dispatching SDPA to ring attention, its load balancing on for
    head-tail chunks and off for contiguous pieces. torch reads ``_cp_options.enable_load_balance``
    twice: when ``context_parallel`` shards its buffers (torch 2.9+ keeps it on only when the
    buffer's length divides into ``2 x world`` chunks: the probe's does) and at every ring step (which
    chunk of a neighbour's keys and values each local chunk needs). The batch is cut already, so
    torch is given a throwaway buffer to shard (the public API needs one to know the sequence's
    length); the flag is put back as it was when the ``with`` ends."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(pg, "cuda")
    probe = torch.empty(1, 2 * world, device=torch.device("cuda", torch.cuda.current_device()))
    before = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = balance
    try:
        with torch_context_parallel(mesh, buffers=[probe], buffer_seq_dims=[1], no_restore_buffers={probe}):
            if _cp_options.enable_load_balance != balance:
                raise RuntimeError(f"torch's context_parallel set its load balancing to "
                                   f"{_cp_options.enable_load_balance}, remat sharded the batch with balance={balance}")
            yield
    finally:
        _cp_options.enable_load_balance = before


@contextlib.contextmanager
def plain_attention():
    """``torch.nn.functional.scaled_dot_product_attention`` as torch defines it, while the ``with`` is open.

    Whatever replaced it (torch's ``context_parallel``, :func:`context_parallel`) is put back when the
    ``with`` ends. For profiling one rank's share inside a CP step (the Hugging Face Trainer's, where
    torch's ring would otherwise run on the profiler's tensors); :mod:`remat.planning.context` adds the
    rest of the sequence's attention to that profile."""
    current = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = current


def torch_balances(length: int, world: int) -> bool:
    """Whether torch's ``context_parallel``, entered now, would cut sequences head-tail.

    For planning a rank that torch shards (the Hugging Face Trainer under accelerate's
    ``ParallelismConfig(cp_size=...)``): its ``_HeadTailLoadBalancer``, remat's ``balance=True``.

    Args:
        length: tokens per sequence.
        world: CP ranks.

    Returns:
        True when torch's ``_cp_options.enable_load_balance`` is on (the default; inside its context,
        what it chose) and ``length`` divides into ``2 x world`` chunks."""
    if world <= 1 or length % (2 * world):
        return False
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:   # a torch without context parallelism shards nothing
        return False
    return bool(_cp_options.enable_load_balance)


def _nccl(group) -> bool:
    """The group's collectives run on NCCL (its backend is ``nccl``, or names it for CUDA tensors:
    ``cpu:gloo,cuda:nccl``)."""
    return "nccl" in str(dist.get_backend(group))


def reduce_gradients(model: nn.Module, group=None) -> None:
    """Sum every parameter's ``.grad`` over the CP ``group``.

    For a model neither FSDP2 nor DDP reduces over the group: each rank's backward gave the gradient
    of its share of the loss, and the whole sequence's gradient is their sum.

    Args:
        model: the model whose gradients to sum (in place).
        group: the CP process group, a 1-D DeviceMesh or None (the default group)."""
    pg = process_group(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=pg)
