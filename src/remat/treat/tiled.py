"""Tiling along the sequence: a block's token-wise sub-modules hold one chunk of tokens at a time.

Checkpointing and offload act at block boundaries, so what a block holds *inside itself* while it
runs is the floor of any plan: at 262,144 tokens of an 8B model the MLP's intermediates (three
tensors of sequence x 14,336), the norms' fp32 copies and the projections, tens of GiB. A
token-wise sub-module (an MLP, a norm: every output row depends only on the same input row) can
instead run over the sequence a chunk of rows at a time; then its intermediates exist one chunk
at a time, in forward, in recompute and in backward.

How: each tiled sub-module's ``forward`` (the block's MLPs and its norms; through
:mod:`remat.treat.patches`) calls :class:`_TiledFunction`, an autograd function that

- forward: runs the sub-module on each chunk under ``no_grad`` into one output tensor and saves
  only its input;
- backward: recomputes each chunk with grad and asks autograd for the chunk's input gradient and
  its parameters' gradients (``torch.autograd.grad``), accumulating the weight gradients in fp32
  where a parameter is fp16 or bf16 (in its own dtype otherwise: fp64 stays fp64), and returns them
  as the function's own input gradients.

The parameter gradients go back through the outer graph, so autograd's ``AccumulateGrad`` runs
once per parameter per step, as without tiling: DDP's and FSDP2's gradient hooks, LoRA's frozen
weights (no gradient is computed for them) and gradient accumulation behave as usual. The
obvious alternative (DeepSpeed's TiledMLP, Unsloth) calls ``backward`` per chunk inside the
backward, which accumulates into ``.grad`` once per chunk in the parameter's dtype and fires
DDP's hooks once per chunk.

Randomness: dropout inside a tiled sub-module draws, in the untreated model, one mask over the
whole sequence. :class:`_Replay` (a dispatch mode around the chunks) draws each random op's full
mask once, with the very op and shape the untreated call would use (so the same random numbers),
and hands each chunk its rows; backward's recompute replays the stored masks without drawing. So
a tiled block is exact with dropout on (fp32: within summation-order rounding of the weight
gradients). A random op other than dropout's (``bernoulli``, ``native_dropout``) is refused.

Composition: ``tiled`` leaves the rest of the block as it is (attention's saved tensors are
kept); ``full+tiled`` checkpoints the block, whose recompute then runs the tiled sub-modules
again (their forward, in chunks, saving only their inputs), and ``full+offload+tiled`` also moves
the checkpoint's input to host memory.

Skipped in the recompute: a tiled sub-module's forward inside a checkpoint's recompute only
serves what the recompute saves after it, since its own backward recomputes its chunks from
its input. Where nothing after it saves a tensor (Llama's MLP: only the residual add follows,
which saves nothing), its output is never read, so the recompute saves its input and hands on
zeros instead of running it: the MLP's forward then runs twice a step under ``full+tiled``
(forward, and per chunk in its backward), not three times. Which calls may skip is read once per
checkpointed call from the forward's own autograd graph (:class:`CheckpointedCall`): every node
created after the tiled call on the way to the block's outputs must save no tensor (a
post-MLP norm, Gemma-2's, saves the MLP's output: that MLP is run). Calls recording outputs
for the model (MoE router logits) are always run.

MoE: routing is per token, so an MoE MLP tiles like a dense one. Where transformers records its
router logits for the auxiliary loss (forward hooks into the model's output collector), the
chunks' records are replaced by the tiled function's own outputs, which carry the gradient
(:class:`_Recorded`).

Fake-tensor profiles: on fake tensors every full chunk costs alike and computes nothing, so a
profile that says how to count repeats (:func:`sampled_chunks`) has the tiled function run its
first chunk, one middle chunk counted for all the middle ones, and its last: the same peaks and
roofline seconds for a fraction of the dispatched ops (a 131,072-token block in 2,048-token
chunks runs 3 of its 64).

Compiled: under ``torch.compile`` the tiled call is traced, not a graph break: each chunk runs
under a non-reentrant ``checkpoint`` (:func:`_compiled_chunks`), which dynamo turns into a
checkpoint region of the graph, so the compiled backward recomputes each chunk's intermediates
before its gradient and the forward saves only the input. The eager function's parts that dynamo
cannot trace (a dispatch mode, ``torch.autograd.grad`` inside a backward, the recompute's skip)
are left to eager mode: compiled, dropout draws its masks chunk by chunk (compiled random numbers
differ from eager ones anyway), the chunks' weight gradients are summed as the compiled graph
sums them, and a sub-module whose outputs the model records through hooks (MoE router logits)
runs the eager function, a graph break.

Limits: the sub-module must take one tensor (the hidden states) and return one tensor, and a
recorded output must have the tokens as its leading dimension.
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import inspect
import re
import sys
import textwrap
import weakref
from typing import Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from remat import caches
from remat.treat import patches
from remat.treat.discovery import find_submodules
from remat.treat.refusals import StepRefusal
from remat.treat.segments import autocast_as, autocast_state

_TAG = "tiled"
_NORM_CLASS = re.compile(r"(RMSNorm|RmsNorm|LayerNorm|Layernorm)$")
DEFAULT_TILE_TOKENS = 8192
"""Tokens per chunk where a record names none (the planner's own default,
:data:`remat.planning.plans.DEFAULT_TILE_TOKENS`, is this number: a test holds them equal)."""


def check_tile_tokens(tokens) -> None:
    """A chunk size is a positive integer (or None: :data:`DEFAULT_TILE_TOKENS`)."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0):
        raise ValueError(f"tile_tokens must be a positive integer (tokens per chunk of a tiled sub-module) "
                         f"or None for {DEFAULT_TILE_TOKENS}; got {tokens!r} ({type(tokens).__name__})")


def tiled_targets(block: nn.Module) -> list:
    """``[(relative name, module)]``: the token-wise sub-modules ``tiled`` runs in chunks: the block's
    MLPs (as :func:`~remat.treat.discovery.find_submodules` finds them) and its norms (direct
    children named like ``RMSNorm``/``LayerNorm``; group and batch norms mix tokens and are not)."""
    mlps = find_submodules(block, "mlp")
    norms = [(name, child) for name, child in block.named_children()
             if isinstance(child, nn.LayerNorm) or _NORM_CLASS.search(type(child).__name__)]
    return norms + mlps


def check_tiling(block: nn.Module) -> None:
    """Raise the error :func:`install_tiling` would raise, without changing ``block``: it has no
    token-wise sub-module, or one of them mixes tokens (:func:`_mixes_tokens`)."""
    targets = tiled_targets(block)
    if not targets:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in block.named_children())
        raise ValueError(f"a tiled treatment needs a token-wise sub-module (an MLP or a norm) in "
                         f"{type(block).__name__}, and it has none (children: {children}); use 'full' "
                         "or 'full+offload' for this block")
    for name, target in targets:
        needs = _needs_more_than_hidden(target) or _called_with_more(block, name)
        if needs:
            raise ValueError(f"{type(block).__name__}.{name} ({type(target).__name__}) {needs}, so it cannot be "
                             "tiled. Use 'full', 'mlp' or 'full+offload' for this block.")
        if _mixes_tokens(target) is True:
            raise ValueError(f"{type(block).__name__}.{name} ({type(target).__name__}) is not token-wise: run on "
                             "the tokens in two chunks it gives other outputs than on all of them at once "
                             "(it mixes tokens, or an MoE's routing depends on how many tokens it sees), so it "
                             "cannot be tiled. Use 'full', 'mlp' or 'full+offload' for this block.")


_PROBED = caches.register(weakref.WeakKeyDictionary(), "treat.tiled._PROBED")  # module -> whether it mixes tokens, or why it cannot be probed
_CALLS: dict = caches.register({}, "treat.tiled._CALLS")  # (block class, sub-module name) -> _called_with_more's answer


def _called_with_more(block: nn.Module, name: str) -> Optional[str]:
    """Why ``block``'s forward cannot hand its sub-module ``name`` the hidden states alone, or None: every
    call of ``self.<name>(...)`` in its source passes more (DeepSeek-V4's decoder layer always calls
    ``self.mlp(..., input_ids=input_ids)``, which its MoE's signature leaves optional). Read once per
    block class; where one call passes the hidden states alone, the call made is checked when it runs."""
    key = (type(block), name)
    if key not in _CALLS:
        _CALLS[key] = None
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(block).forward))))
        except (OSError, TypeError, SyntaxError):
            return None
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == name and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
        more = [c for c in calls if len(c.args) + len([k for k in c.keywords if not (
            isinstance(k.value, ast.Constant) and k.value.value is None)]) > 1]
        if calls and len(more) == len(calls):
            _CALLS[key] = (f"is called with more than the hidden states ({type(block).__name__}.forward: "
                           f"`{' '.join(ast.unparse(more[0]).split())}`), and a tiled sub-module runs on chunks of them")
    return _CALLS[key]


def _needs_more_than_hidden(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot run on the hidden states alone, or None: its ``forward`` names another
    required argument (BLOOM's MLP adds the residual, ``forward(hidden_states, residual)``), or it
    raises on a probe of hidden states (:func:`_mixes_tokens`'s: DeepSeek-V4's hash-routed MoE reads
    the ``input_ids`` its block passes). An optional argument the block passes after all is refused at
    the call (:func:`_tiled_forward`)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = ", ".join(p.name + ("" if p.default is p.empty else "=...") for p in parameters
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty for p in parameters[1:]):
        return f"needs more than the hidden states (forward({named})), and a tiled sub-module runs on chunks of them"
    probed = _mixes_tokens(module)
    return probed.replace("{forward}", f"forward({named})") if isinstance(probed, str) else None


def _mixes_tokens(module: nn.Module):
    """Whether ``module`` gives other rows for 8 tokens run at once than run as 3 + 5 (checked once
    per module, on random inputs of its feature size, with its RNG, buffers and grads left alone);
    a string saying why not where it cannot be probed (it raises, returns no tensor, or its width
    cannot be read: :func:`_needs_more_than_hidden` refuses it). Modules on the meta device or with
    fake parameters are taken as token-wise (nothing runs there; the real model is probed when the
    plan is applied)."""
    if module in _PROBED:
        return _PROBED[module]
    param = next(module.parameters(), None)
    features = _features(module)
    if param is None or param.device.type == "meta" or isinstance(param, FakeTensor):
        return False  # nothing to run it on (a fake-tensor profile: the real model is probed when applied)
    if features is None:  # a convolutional MLP on [batch, channels, height, width] (SwiftFormer's) among them
        return ("has no linear layer or hidden size to read its width from, so remat cannot check that it "
                "runs on [..., tokens, features] rows one at a time ({forward})")
    devices = [param.device.index or 0] if param.device.type == "cuda" else []
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        generator = torch.Generator(device=param.device).manual_seed(0)
        probe = torch.randn(1, 8, features, generator=generator, device=param.device).to(param.dtype)
        whole_replay, split_replay = _Replay(8), _Replay(8)
        try:
            with whole_replay.chunk(0, 8):
                whole = module(probe)
            split_replay.drawn = whole_replay.drawn  # the chunks get the same dropout masks
            parts = []
            for start, end in ((0, 3), (3, 8)):
                with split_replay.chunk(start, end):
                    parts.append(module(probe[:, start:end]))
        except Exception as error:  # noqa: BLE001 - the model's own code: any error means "not on hidden states alone"
            _PROBED[module] = (f"cannot run on the hidden states alone ({{forward}}: 8 random tokens of {features} "
                               f"features raised {type(error).__name__} in it), and a tiled sub-module runs on "
                               "chunks of them")
            return _PROBED[module]
        finally:
            for buffer, value in buffers:
                buffer.copy_(value)
    if not all(isinstance(t, torch.Tensor) for t in [whole, *parts]):
        mixes = (f"returns {type(whole).__name__}, not one tensor (an MoE returning its router logits?): its "
                 "chunks' outputs cannot be joined")
    else:
        tolerance = 1e-2 if param.dtype in (torch.float16, torch.bfloat16) else 1e-5
        mixes = not torch.allclose(torch.cat(parts, dim=1).float(), whole.float(), rtol=tolerance, atol=tolerance)
    _PROBED[module] = mixes
    return mixes


def _features(module: nn.Module):
    """The input feature size of a norm or an MLP: a norm's weight length, else the first linear
    layer's input size (``nn.Linear.in_features``; GPT-2's ``Conv1D`` keeps it as ``weight.shape[0]``),
    else a ``hidden_size``/``hidden_dim`` the module or a sub-module keeps."""
    if isinstance(module, nn.LayerNorm) or _NORM_CLASS.search(type(module).__name__):
        weight = getattr(module, "weight", None)
        shape = getattr(module, "normalized_shape", None)
        return shape[-1] if shape else (weight.shape[-1] if isinstance(weight, torch.Tensor) else None)
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return child.in_features
        if type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
            return child.weight.shape[0]
    for child in module.modules():  # experts kept as 3-D parameters (GPT-OSS): the width they were built for
        for name in ("hidden_size", "hidden_dim"):
            width = getattr(child, name, None)
            if isinstance(width, int) and not isinstance(width, bool) and width > 0:
                return width
    return None


def install_tiling(block: nn.Module, tokens: Optional[int]) -> None:
    """Run ``block``'s token-wise sub-modules a chunk of ``tokens`` rows at a time (see the module doc)."""
    check_tile_tokens(tokens)
    check_tiling(block)
    for _, target in tiled_targets(block):
        if patches.patch_of(target, "forward", tag=_TAG) is None:  # shared by two blocks: once
            patches.install(target, "forward", _tiled_forward, tag=_TAG, bound=True,
                            state=tokens or DEFAULT_TILE_TOKENS)


def remove_tiling(block: nn.Module) -> None:
    patches.remove(block, tag=_TAG)


def tile_tokens_of(block: nn.Module) -> Optional[int]:
    """The chunk size ``block``'s tiled sub-modules run with, or None when it is not tiled."""
    found = [p.state for p in patches.patches(block, tag=_TAG)]
    return found[0] if found else None


def _tiled_forward(patch: patches.Patch, *args, **kwargs):
    module = patch.module
    if not torch.is_grad_enabled() or len(args) + len(kwargs) != 1:
        if torch.is_grad_enabled():
            raise StepRefusal(
                f"a tiled {type(module).__name__} must be called with the hidden states alone; it got "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments. Use 'full' or 'mlp' for "
                "this block instead of a tiled treatment.")
        return patch.call_previous(*args, **kwargs)
    hidden = args[0] if args else next(iter(kwargs.values()))
    key = None if args else next(iter(kwargs))
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError(f"a tiled {type(module).__name__} takes a [..., tokens, features] tensor; got "
                         f"{type(hidden).__name__}{getattr(hidden, 'shape', '')}")

    def run(chunk):
        out = patch.call_previous(chunk) if key is None else patch.call_previous(**{key: chunk})
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"a tiled {type(module).__name__} must return one tensor; it returned "
                             f"{type(out).__name__} (an MoE returning router logits?). Use 'full' or 'mlp' "
                             "for this block instead of a tiled treatment.")
        return out
    if torch.compiler.is_compiling() and not any(m._forward_hooks for m in module.modules()):
        return _compiled_chunks(run, patch.state, hidden)
    return _eager_chunks(module, run, patch.state, hidden)


@torch.compiler.disable  # a dispatch mode, hooks and torch.autograd.grad in backward: eager only
def _eager_chunks(module: nn.Module, run, tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """The eager chunk loop (:class:`_TiledFunction`): also the compiled path of a sub-module whose
    outputs the model records through hooks (MoE router logits), a graph break there."""
    params = [p for p in module.parameters() if p.requires_grad]
    recorded = _Recorded(module)
    out, *records = _TiledFunction.apply(run, tokens, recorded, hidden, *params)
    recorded.hand_back(records)
    return out


def _compiled_chunks(run, tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """The chunk loop as dynamo traces it: each chunk of ``tokens`` rows under a non-reentrant
    ``checkpoint`` (a checkpoint region of the graph: its intermediates are recomputed in
    backward, chunk by chunk, and only the input's rows are saved), the chunks' outputs
    concatenated. No Python state is read or written: the sizes are the graph's, the loop unrolls."""
    rows = hidden.reshape(1, -1, hidden.shape[-1])
    pieces = [checkpoint(run, rows[:, start:start + tokens], use_reentrant=False)
              for start in range(0, rows.shape[1], tokens)]
    out = torch.cat(pieces, dim=1)
    return out.view(*hidden.shape[:-1], *out.shape[2:])


class _Recorded:
    """Outputs of sub-modules that the model records through forward hooks while the tiled
    module runs (transformers 5 records an MoE's router logits so for the auxiliary loss).

    Run in chunks, each chunk's hook records that chunk's rows, computed without gradient. The
    tiled function instead returns, per recorded output, the chunks' rows concatenated (tokens
    are the leading dimension, as in the untreated call) as outputs of its own, and these take
    the place of the chunks' records in the model's collector; so the auxiliary loss sees the
    same tensor, and its gradient reaches the router through the tiled function's backward,
    which records the same outputs of its recompute with hooks of its own."""

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


_CALL = contextvars.ContextVar("remat_checkpointed_call", default=None)
_SAMPLED = contextvars.ContextVar("remat_sampled_chunks", default=None)


@contextlib.contextmanager
def sampled_chunks(repeated):
    """Tiled calls inside run three chunks, the middle one under ``repeated(times)`` (a context
    manager under which each op counts ``times`` times), for fake-tensor profiles only: the
    chunks left out produce no values."""
    token = _SAMPLED.set(repeated)
    try:
        yield
    finally:
        _SAMPLED.reset(token)


def _chunk_runs(rows: int, tokens: int, repeated) -> list:
    """``[(start, context)]``: every chunk, each counted once; with ``repeated`` (a fake profile) and
    more than three chunks, the first, the second counted for all the middle ones, and the last."""
    starts = list(range(0, rows, tokens))
    if repeated is None or len(starts) <= 3:
        return [(start, contextlib.nullcontext()) for start in starts]
    return [(starts[0], contextlib.nullcontext()), (starts[1], repeated(len(starts) - 2)),
            (starts[-1], contextlib.nullcontext())]


class CheckpointedCall:
    """A checkpointed block's function as ``checkpoint`` calls it, first in the forward, then in
    each recompute: the tiled sub-modules that run inside it learn in the forward which of their
    outputs the recompute never reads (see the module doc), and skip those in the recompute."""

    def __init__(self, function):
        self.function = function
        self.forwarded = False
        self.calls = []      # the forward's tiled calls in order: _TiledCall
        self.position = 0    # the recompute's tiled calls so far

    def __call__(self, *args):
        token = _CALL.set(self)
        try:
            if self.forwarded:
                self.position = 0
                return self.function(*args)
            out = self.function(*args)
            self.forwarded = True
            _mark_unread(self.calls, out)
            return out
        finally:
            _CALL.reset(token)

    def note(self, node, hidden: torch.Tensor, out: torch.Tensor, records: bool) -> None:
        """The forward ran a tiled call (``node``: its autograd node)."""
        self.calls.append(_TiledCall(node._sequence_nr(), tuple(hidden.shape), tuple(out.shape), out.dtype,
                                     records))

    def stand_in(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """In the recompute: zeros in place of the next tiled call's output where the forward found it
        unread, else None (run it). A recompute that calls other shapes than the forward runs all."""
        position, self.position = self.position, self.position + 1
        if position >= len(self.calls):
            return None
        call = self.calls[position]
        if not call.unread or call.hidden_shape != tuple(hidden.shape):
            return None
        with _disable_current_modes():  # not an op of the checkpoint's (torch >= 2.13 refuses ops its forward did not run)
            return hidden.new_zeros(call.out_shape, dtype=call.out_dtype)


class _TiledCall:
    __slots__ = ("sequence", "hidden_shape", "out_shape", "out_dtype", "records", "unread")

    def __init__(self, sequence, hidden_shape, out_shape, out_dtype, records):
        self.sequence, self.hidden_shape, self.out_shape = sequence, hidden_shape, out_shape
        self.out_dtype, self.records, self.unread = out_dtype, records, False


def _mark_unread(calls: list, outputs) -> None:
    """Mark the tiled calls whose output nothing saved reads: walking back from the block's outputs,
    no node created after the call (autograd numbers nodes in creation order) saves a tensor."""
    if not calls:
        return
    first = min(call.sequence for call in calls)
    stack = [t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, latest = set(), -1  # latest: the newest node that saves a tensor
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < first:
            continue  # a leaf, or made before the block's first tiled call
        if _saves_tensors(node):
            latest = max(latest, node._sequence_nr())
        stack.extend(next_node for next_node, _ in node.next_functions)
    for call in calls:
        call.unread = not call.records and latest <= call.sequence


_SAVES = caches.register({}, "treat.tiled._SAVES")  # built-in node class -> whether it saves tensors


def _saves_tensors(node) -> bool:
    """Whether an autograd node keeps tensors for its backward. A Python function's node is taken to
    (its ``ctx`` may hold tensors outside ``save_for_backward``); a built-in node's class says it
    with ``_raw_saved_*`` attributes (read by name, never unpacked: that would run the recompute)."""
    kind = type(node)
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return True
    if kind not in _SAVES:
        _SAVES[kind] = any(name.startswith("_raw_saved_") for name in dir(node))
    return _SAVES[kind]


class _TiledFunction(torch.autograd.Function):
    """``run`` over chunks of ``tokens`` rows: saves only the input, recomputes per chunk in backward.
    Returns the output and the recorded outputs (:class:`_Recorded`), concatenated over chunks;
    in a recompute that never reads the output, zeros (:class:`CheckpointedCall`)."""

    @staticmethod
    def forward(ctx, run, tokens, recorded, hidden, *params):
        call = _CALL.get()
        stand_in = call.stand_in(hidden) if call is not None and call.forwarded else None
        if stand_in is not None:
            ctx.save_for_backward(hidden)  # what the recompute is for; the output is not read
            return (stand_in,)
        rows = hidden.reshape(1, -1, hidden.shape[-1])
        ctx.run, ctx.tokens, ctx.params, ctx.recorded = run, tokens, params, recorded
        ctx.autocast = autocast_state(hidden.device.type)
        ctx.replay = _Replay(rows.shape[1])
        ctx.save_for_backward(hidden)
        out = None
        ctx.repeated = None if recorded.hooked else _SAMPLED.get()  # records need every chunk's rows
        for start, counted in _chunk_runs(rows.shape[1], tokens, ctx.repeated):
            with counted:
                with ctx.replay.chunk(start, min(start + tokens, rows.shape[1])):
                    piece = recorded.run(run, rows[:, start:start + tokens], first=start == 0)
                if out is None:  # made in the output's own shape: a view would refuse in-place
                    # writes after the function (Falcon adds the attention output into its MLP's)
                    out = piece.new_empty(*hidden.shape[:-1], *piece.shape[2:])
                out.view(1, rows.shape[1], *piece.shape[2:])[:, start:start + tokens] = piece
                del piece
        if call is not None and not call.forwarded:
            call.note(ctx, hidden, out, records=bool(recorded.hooked))
        return (out, *recorded.concatenated())

    @staticmethod
    def backward(ctx, grad, *record_grads):
        hidden, = ctx.saved_tensors
        rows = hidden.detach().reshape(1, -1, hidden.shape[-1])
        grad_rows = grad.reshape(1, rows.shape[1], -1)
        wants_input = ctx.needs_input_grad[3]
        params = [p for p, wanted in zip(ctx.params, ctx.needs_input_grad[4:]) if wanted]
        # fp16/bf16 weights sum their chunks' gradients in fp32; fp32 and fp64 in their own dtype
        sums = [torch.zeros_like(p, dtype=torch.float32) if p.dtype in (torch.float16, torch.bfloat16) else None
                for p in params]
        grads = [None] * len(params)
        grad_input = torch.empty_like(rows) if wants_input else None
        offsets = [0] * len(record_grads)  # the recorded outputs' rows consumed so far
        with torch.enable_grad(), autocast_as(ctx.autocast):
            for start, counted in _chunk_runs(rows.shape[1], ctx.tokens, ctx.repeated):
                with counted:  # a fake profile's middle chunk counts for all the middle ones
                    end = min(start + ctx.tokens, rows.shape[1])
                    piece = rows[:, start:end].detach().requires_grad_(wants_input)
                    found, handles = ctx.recorded.capture()
                    try:
                        with ctx.replay.chunk(start, end):
                            outputs = [ctx.run(piece)]
                    finally:
                        for handle in handles:
                            handle.remove()
                    grad_outputs = [grad_rows[:, start:end]]
                    for index, (record, g) in enumerate(zip(found, record_grads)):
                        if g is not None:
                            outputs.append(record)
                            grad_outputs.append(g[offsets[index]:offsets[index] + record.shape[0]])
                        offsets[index] += record.shape[0]
                    inputs = ([piece] if wants_input else []) + params
                    found = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
                    if wants_input:
                        grad_input[:, start:end] = found[0]
                        found = found[1:]
                    for index, g in enumerate(found):
                        if g is None:
                            continue
                        if sums[index] is not None:
                            sums[index].add_(g)
                        elif grads[index] is None:
                            grads[index] = g
                        else:
                            grads[index].add_(g)
                    del outputs, found, piece
        grads = [s.to(p.dtype) if s is not None else g for s, g, p in zip(sums, grads, params)]
        wanted = iter(grads)
        param_grads = [next(wanted) if flag else None for flag in ctx.needs_input_grad[4:]]
        ctx.replay = ctx.recorded = None
        return (None, None, None, grad_input.view_as(hidden) if wants_input else None, *param_grads)


class _Replay(TorchDispatchMode):
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
