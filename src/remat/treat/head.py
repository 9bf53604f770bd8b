"""Chunked LM head and loss: the [tokens x vocab] logits never exist in full.

How: the model's forward runs as usual up to its output embedding (``lm_head``); that
one call is intercepted and the hidden states it receives are handed to
:class:`_ChunkedLoss`, which walks them a chunk of ``chunk_tokens`` rows at a time:

    z = h_c @ W^T (+ b)           in the dtype the model's head runs in (autocast included)
    x = transform(z).float()      soft-capping / scaling as the model applies them
    loss += sum over valid rows of logsumexp(x) - x[label]
    g = (softmax(x) - onehot) / N  cast back to the head's dtype, through ``transform``
    grad_h[c] = g @ W;  grad_W += g^T @ h_c (fp32);  grad_b += sum(g)

All gradients are finished inside the forward loop, because the gradient of a
cross-entropy with respect to its logits is known the moment the loss is. Backward only
multiplies the stored ``grad_h`` / ``grad_W`` / ``grad_b`` by the incoming scalar. The
obvious alternative, each chunk's loss under ``torch.utils.checkpoint``, recomputes the
chunk's logits in backward: a second [tokens x hidden x vocab] matmul, measured at 0.75x
(DESIGN.md). Here the head costs the same three matmuls as the plain path.

What is reproduced from the model: label shifting (``ForCausalLMLoss``: labels padded
with ``ignore_index`` and shifted; ``shift_labels=`` used as given), masked-LM labels (no
shift), ``ignore_index``, the mean over non-ignored tokens or ``sum / num_items_in_batch``,
Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``, an lm_head bias, tied embeddings (the gradient for the shared weight
is returned once and autograd adds it to the embedding's), frozen heads (LoRA: no weight
gradient is computed) and MoE router auxiliary losses. The logit transform is *checked*,
once per model and dtype: the intercepted ``lm_head`` returns a small probe tensor and
the model's own post-processing of it must equal ours, else the call raises. Rounding
follows the plain path (logits in the head dtype, then ``.float()``); fp32 matches the
model's loss and gradients within 1e-6 relative (the plain path's own fp32 rounding
noise), bf16 within the plain path's own error against fp64.

Memory, for the planner (pure functions, checked against measured bytes in the tests):
:func:`head_peak_bytes` / :func:`head_kept_bytes` for ``plain`` and ``chunked``, and
:func:`choose_chunk_tokens` for a budget. Chunked, the peak is one chunk's logits
(``(dtype + 4) * chunk * vocab`` bytes) plus the fp32 weight-gradient accumulator
(``4 * vocab * hidden``) plus ``grad_h``; plain, it is ``12 * tokens * vocab``.

Integration: :func:`enable_chunked_head` patches the causal/masked LM module's
``forward`` on the instance (a bound method; :func:`disable_chunked_head` restores it
exactly). A call with ``labels`` while grad is enabled returns the model's usual output
class with ``loss`` set and ``logits=None``; any other call (generation, evaluation,
``torch.no_grad()`` with labels, which the Trainer's eval loop uses to get logits) runs
the original forward untouched. PEFT wrappers are looked through to the model inside.

Limits: the output embedding must be a plain ``nn.Linear`` (LoRA or quantised layers on
``lm_head`` are refused); the model's forward must compute its loss through
``self.loss_function`` (or ``CrossEntropyLoss()`` for masked LMs); fp16 gradients are
scaled by 1/N only in backward, so they do not underflow under a GradScaler. Not
traced by ``torch.compile`` as one graph (the interception is Python-level).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat.treat import patches

_TAG = "head"
_GiB = 2 ** 30
_ROUND = 128            # chunk sizes are multiples of this (tensor-core friendly)
_MAX_CHUNK = 8192       # assumed: beyond this the matmuls gain no speed, only memory
_DEFAULT_LOGIT_BYTES = _GiB  # default chunk: its fp32 logits take about this much
_SCALE_ROWS = 8192      # weight-gradient rows scaled at a time in backward
_PROBE = (-48.0, -6.0, -1.5, -0.25, 0.0, 0.5, 3.0, 40.0)  # exact in fp16/bf16


# ---------------------------------------------------------------- memory model (pure)

def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}[str(dtype)]


def head_peak_bytes(tokens: int, vocab: int, hidden: int, dtype, mode: str = "plain",
                    chunk_tokens: Optional[int] = None, *, weight_grad: bool = True) -> int:
    """Peak working-set bytes of the LM head + loss over its forward and backward.

    Counts what the head allocates beyond its inputs (hidden states, parameters) and
    beyond the weight gradient it hands to autograd: logits, their fp32 copy, softmax,
    logits gradients, the gradient for the hidden states, and (chunked) the fp32
    weight-gradient accumulator. ``plain`` is Hugging Face's ``ForCausalLMLoss`` with the
    model outputs dropped before backward (as the Trainer does; keeping them adds
    ``tokens*vocab*dtype`` bytes). No logit transform (soft-capping adds up to three
    ``chunk*vocab*dtype`` buffers). ``weight_grad=False``: a frozen head (LoRA).
    """
    d = _dtype_bytes(dtype)
    n, v, h = int(tokens), int(vocab), int(hidden)
    if mode == "plain":
        upcast = 4 * n * v if d != 4 else 0
        forward = d * n * v + upcast + 4 * n * v          # logits, .float(), log_softmax
        backward = 12 * n * v                              # saved + grad of log_softmax + grad
        return max(forward, backward)
    if mode != "chunked":
        raise ValueError(f"mode must be 'plain' or 'chunked', got {mode!r}")
    c = min(int(chunk_tokens or default_chunk_tokens(v)), n)
    kept = head_kept_bytes(n, v, h, dtype, "chunked", weight_grad=weight_grad)
    if d == 4:
        loop = 4 * c * v                                   # logits, softmax and grad in place
    else:
        loop = max((d + 4) * c * v, d * c * v + (d * v * h if weight_grad else 0))
    backward = d * n * h + (4 * min(v, _SCALE_ROWS) * h if weight_grad else 0)  # see backward()
    # + shifted labels and their flat copy, per-row vectors; the labels alone in backward
    return kept + max(loop + 16 * n + 48 * c, backward + 8 * n)


def head_kept_bytes(tokens: int, vocab: int, hidden: int, dtype, mode: str = "plain", *,
                    weight_grad: bool = True) -> int:
    """Bytes the head keeps from its forward until its backward (part of the peak)."""
    d = _dtype_bytes(dtype)
    if mode == "plain":
        return 4 * int(tokens) * int(vocab)                # log_softmax output
    if mode != "chunked":
        raise ValueError(f"mode must be 'plain' or 'chunked', got {mode!r}")
    return d * int(tokens) * int(hidden) + (4 * int(vocab) * int(hidden) if weight_grad else 0)


def default_chunk_tokens(vocab: int) -> int:
    """The chunk whose fp32 logits take about 1 GiB: 2048 tokens at a 128k vocabulary."""
    rows = _DEFAULT_LOGIT_BYTES // (4 * max(int(vocab), 1))
    return int(min(_MAX_CHUNK, max(_ROUND, rows // _ROUND * _ROUND)))


def choose_chunk_tokens(tokens: int, vocab: int, hidden: int, dtype, budget_bytes: int, *,
                        weight_grad: bool = True) -> int:
    """The largest chunk (a multiple of 128, at most 8192 or ``tokens``) whose
    :func:`head_peak_bytes` fits ``budget_bytes``; raises ValueError if none does."""
    n = int(tokens)
    if n <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    smallest = min(n, _ROUND)
    need = head_peak_bytes(n, vocab, hidden, dtype, "chunked", smallest, weight_grad=weight_grad)
    if need > budget_bytes:
        raise ValueError(
            f"the chunked head needs at least {need / _GiB:.2f} GiB ({smallest}-token chunks, "
            f"{n} tokens, vocab {vocab}, hidden {hidden}), over the {budget_bytes / _GiB:.2f} GiB "
            "given; raise the budget or shorten the batch")
    best = smallest
    for c in range(_ROUND, min(n, _MAX_CHUNK) + 1, _ROUND):
        if head_peak_bytes(n, vocab, hidden, dtype, "chunked", c, weight_grad=weight_grad) <= budget_bytes:
            best = c
    if n <= _MAX_CHUNK and head_peak_bytes(n, vocab, hidden, dtype, "chunked", n,
                                           weight_grad=weight_grad) <= budget_bytes:
        best = n
    return best


# ---------------------------------------------------------------- the loss function

def chunked_cross_entropy(hidden, weight, bias, targets, *, chunk_tokens=None, ignore_index=-100,
                          num_items_in_batch=None, transform=None, compute_dtype=None):
    """``sum(CE(transform(hidden @ weight.T + bias).float(), targets)) / N``, chunked.

    ``targets`` are already aligned with ``hidden`` rows (shift them first for causal
    LMs). N is ``num_items_in_batch`` if given, else the count of non-ignored targets.
    ``transform`` maps logits to logits in their own dtype (e.g. soft-capping).
    """
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.numel() != hidden2.shape[0]:
        raise ValueError(f"{targets.numel()} targets for {hidden2.shape[0]} hidden-state rows; "
                         "they must match (is logits_to_keep set while training?)")
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    cd = compute_dtype or _compute_dtype(hidden, weight)
    chunk = int(chunk_tokens or default_chunk_tokens(weight.shape[0]))
    if chunk <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    return _ChunkedLoss.apply(hidden2, weight, bias, targets, divisor, chunk, int(ignore_index),
                              transform, cd)


def _compute_dtype(hidden, weight):
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk, ignore_index, transform, cd):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want = want_h or want_w or want_b
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        n, hsize = hidden.shape
        inv = 1.0 / divisor
        # fp16 cannot hold (softmax - onehot) / N for large N: scale by 1/N in backward there.
        pre, post = (torch.ones_like(inv), inv) if cd == torch.float16 else (inv, torch.ones_like(inv))
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            grad_h = torch.empty(n, hsize, dtype=cd, device=h.device) if want_h else None
            acc_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
            acc_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if want_b else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                hc, yc = h[s:s + chunk], targets[s:s + chunk]
                z = F.linear(hc, w, b)
                fused = _fused_rows() if transform is None and want and z.is_cuda else None
                if fused is not None:
                    loss_c, g = fused(z, yc, ignore_index, pre)
                    total += loss_c
                    del z
                elif transform is None:
                    x = z.float()
                    del z
                    total += _rows(x, yc, ignore_index, pre, want)
                    g = x.to(cd) if want else None
                    del x
                else:
                    # through the model's own ops, so rounding and derivative are its own
                    z.requires_grad_(want)
                    with torch.enable_grad():
                        x = transform(z).float()
                    total += _rows(x.detach(), yc, ignore_index, pre, want)
                    g = torch.autograd.grad(x, z, x.detach())[0] if want else None
                    del x, z
                if want_h:
                    torch.mm(g, w, out=grad_h[s:s + chunk])
                if want_w:
                    if cd == torch.float32:
                        acc_w.addmm_(g.t(), hc)
                    else:
                        acc_w.add_(torch.mm(g.t(), hc))
                if want_b:
                    acc_b.add_(g.sum(0, dtype=torch.float32))
                del g
        ctx.save_for_backward(grad_h, acc_w, acc_b, post)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, acc_w, acc_b, post = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_loss.float() * post
        gh = (grad_h * scale).to(h_dtype) if grad_h is not None else None
        gw = _scaled(acc_w, scale, w_dtype) if acc_w is not None else None
        gb = (acc_b * scale).to(b_dtype) if acc_b is not None else None
        return gh, gw, gb, None, None, None, None, None, None


def _rows(x, y, ignore_index, pre, want):
    """Summed loss of one chunk; if ``want``, ``x`` becomes ``(softmax - onehot) * pre``
    in place (rows of ignored targets zero)."""
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    picked = x.gather(1, safe[:, None]).squeeze(1)
    m = x.amax(1, keepdim=True)
    x.sub_(m).exp_()
    s = x.sum(1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    if want:  # one pass: softmax and the 1/N scale together, then the one-hot at the targets
        weight = valid.to(x.dtype) * pre
        x.mul_(weight[:, None] / s)
        x.scatter_add_(1, safe[:, None], -weight[:, None])
    return loss


def _softmax_xent(z, y, ignore_index: int, pre):
    """The loss of one chunk and ``(softmax - onehot) * pre`` in ``z``'s dtype, as one
    function for ``torch.compile`` to fuse: it reads the chunk's logits three times and
    writes the gradient once, where the eager ops of :func:`_rows` materialise the fp32
    logits and pass over them about ten times (measured: the head's elementwise work is
    the difference between the chunked and the plain head's speed).

    The target column is written afterwards from per-row fp32 values (``p_t * w - w``, the
    same fp32 operations as the eager path, rounded once), so no full-size fp32 buffer is
    needed for a scatter."""
    x = z.float()
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    m = x.amax(1, keepdim=True)
    s = torch.exp(x - m).sum(1, keepdim=True)
    picked = x.gather(1, safe[:, None])
    lse = (m + s.log()).squeeze(1)
    loss = torch.where(valid, lse - picked.squeeze(1), torch.zeros_like(lse)).sum()
    weight = (valid.to(torch.float32) * pre)[:, None]
    scale = weight / s
    g = (torch.exp(x - m) * scale).to(z.dtype)
    target = (torch.exp(picked - m) * scale - weight).to(z.dtype)
    return loss, g.scatter(1, safe[:, None], target)


_FUSED = {}


def _fused_rows():
    """The compiled :func:`_softmax_xent` on CUDA, or None (no compiler, or it failed once:
    then the eager path is used for the rest of the process, with one warning)."""
    if "fn" not in _FUSED:
        try:
            compiled = torch.compile(_softmax_xent, dynamic=False, fullgraph=True)
        except Exception as e:  # torch.compile unavailable on this platform
            _fused_failed(e)
        else:
            _FUSED["fn"] = _guarded(compiled)
    return _FUSED.get("fn")


def _guarded(compiled):
    def run(z, y, ignore_index, pre):
        try:
            return compiled(z, y, ignore_index, pre)
        except Exception as e:  # a compile failure (no Triton, old GPU): eager from now on
            _fused_failed(e)
            x = z.float()
            loss = _rows(x, y, ignore_index, pre, True)
            return loss, x.to(z.dtype)
    return run


def _fused_failed(error) -> None:
    import warnings
    _FUSED["fn"] = None
    warnings.warn(f"remat: the fused chunked-loss kernel could not be compiled ({type(error).__name__}: "
                  f"{str(error)[:200]}); using the eager path, which is correct but slower", stacklevel=3)


def _scaled(acc, scale, dtype, rows=_SCALE_ROWS):
    # row blocks: never a second full-size fp32 copy of the weight gradient
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for r in range(0, acc.shape[0], rows):
        out[r:r + rows] = acc[r:r + rows] * scale
    return out


# ---------------------------------------------------------------- model integration

@dataclass
class _HeadState:
    signature: Any
    chunk_tokens: Optional[int]
    masked: bool            # masked LM: labels are not shifted
    num_items: bool         # the model's loss honours num_items_in_batch / ignore_index kwargs
    aux_coef: bool          # the model adds router_aux_loss_coef * aux_loss when labels are given
    verified: set = field(default_factory=set)


def check_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None):
    """Raise the error :func:`enable_chunked_head` would raise, without changing ``model``;
    returns the LM module and the state the head would run with."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens <= 0):
        raise ValueError(f"chunk_tokens must be a positive integer or None (None: chosen for the "
                         f"vocabulary), got {chunk_tokens!r}")
    lm = _find_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(
            f"the chunked head needs {type(lm).__name__}'s output embedding to be a plain torch.nn.Linear, "
            f"got {type(head).__name__} (LoRA/quantisation on lm_head?); leave lm_head out of "
            "target_modules or use head='plain'")
    masked, num_items, aux = _loss_semantics(lm)
    signature = inspect.signature(type(lm).forward).replace(
        parameters=list(inspect.signature(type(lm).forward).parameters.values())[1:])
    if "labels" not in signature.parameters:
        raise ValueError(f"{type(lm).__name__}.forward has no 'labels' parameter; the chunked head "
                         "replaces the loss computed from labels: use head='plain'")
    return lm, _HeadState(signature, chunk_tokens, masked, num_items, aux)


def enable_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None) -> nn.Module:
    """Compute ``model``'s LM loss a chunk of tokens at a time (in place; returns ``model``).

    ``chunk_tokens``: rows per chunk; None picks :func:`default_chunk_tokens` for the vocab
    (the planner passes :func:`choose_chunk_tokens` for a budget). Raises ValueError or
    TypeError for a model whose head or loss this module cannot reproduce exactly, before
    changing anything. The LM's ``forward`` keeps its signature (``inspect.signature``), so
    the Trainer's ``remove_unused_columns`` sees the model's real arguments.
    """
    lm, state = check_chunked_head(model, chunk_tokens)
    disable_chunked_head(lm)
    patches.install(lm, "forward", _chunked_forward, tag=_TAG, state=state)
    return model


def disable_chunked_head(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_chunked_head`; a no-op on a model without it."""
    patches.remove(model, tag=_TAG)
    return model


def _find_lm(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_chunked_head expects a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():  # outermost first; class-level lookup skips PEFT's __getattr__
        get_out = getattr(type(module), "get_output_embeddings", None)
        if callable(get_out) and hasattr(module, "config") and get_out(module) is not None:
            return module
    raise ValueError(
        f"no LM head found in {type(model).__name__}: the chunked head needs a Hugging Face causal "
        "or masked LM (a module whose get_output_embeddings() returns its lm_head); use head='plain'")


def _loss_semantics(lm: nn.Module):
    name = type(lm).__name__
    try:
        source = inspect.getsource(inspect.unwrap(type(lm).forward))
    except (OSError, TypeError):
        raise ValueError(f"cannot read {name}.forward's source to check how it computes its loss; "
                         "the chunked head only reproduces losses it has checked: use head='plain'") from None
    refuse = (f"{name}'s loss is not one the chunked head reproduces exactly ({{}}); "
              "use head='plain' for this model")
    extra = re.findall(r"loss \+= (.*)|loss = loss \+ (.*)", source)
    aux = bool(extra)
    if any("router_aux_loss_coef * aux_loss" not in "".join(e) for e in extra):
        raise ValueError(refuse.format("it adds other terms to the loss"))
    if "self.loss_function(" in source:
        from transformers.loss.loss_utils import LOSS_MAPPING
        fn = lm.loss_function
        if fn is LOSS_MAPPING["ForCausalLM"]:
            return False, True, aux
        if fn is LOSS_MAPPING["ForMaskedLM"]:
            return True, True, aux
        raise ValueError(refuse.format(f"loss_function is {getattr(fn, '__name__', fn)}"))
    if "ForMaskedLM" in name and "CrossEntropyLoss()" in source:
        return True, False, aux
    raise ValueError(refuse.format("its forward does not call self.loss_function"))


def _logit_transform(lm: nn.Module):
    """The model's post-``lm_head`` logit transform as (key, function or None)."""
    config = lm.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None and hasattr(config, "get_text_config"):
        cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        cap = float(cap)
        return ("softcap", cap), lambda z: torch.tanh(z / cap) * cap
    scale = getattr(lm, "logit_scale", getattr(config, "logit_scale", None))
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return ("scale", scale), lambda z: z * scale
    div = getattr(config, "logits_scaling", None)
    if isinstance(div, (int, float)) and not isinstance(div, bool):
        return ("div", div), lambda z: z / div
    return ("identity",), None


def _capture(patch, hidden, *args, **kwargs):
    """Stands in for ``lm_head.forward`` during the model's forward: keeps the hidden states
    and returns a small probe instead of the logits (see :func:`_verify`)."""
    patch.state.append(hidden)
    dtype = _compute_dtype(hidden, patch.module.weight)
    probe = torch.tensor(_PROBE, dtype=dtype, device=hidden.device)
    return probe.expand(*hidden.shape[:-1], len(_PROBE)).clone()


def _chunked_forward(patch, *args, **kwargs):
    self, state = patch.module, patch.state
    bound = state.signature.bind_partial(*args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not torch.is_grad_enabled():
        return patch.call_previous(*args, **kwargs)
    bound.arguments["labels"] = None
    head = self.get_output_embeddings()
    captured = []
    with patches.temporarily(head, "forward", _capture, tag="head-capture", state=captured):
        out = patch.call_previous(*bound.args, **bound.kwargs)
    if len(captured) != 1:
        raise ValueError(f"{type(self).__name__}.forward called its lm_head {len(captured)} times; the "
                         "chunked head handles one call per forward: use head='plain'")
    hidden = captured[0].to(head.weight.device)
    is_tuple = isinstance(out, tuple)
    probe_out = out[0] if is_tuple else out.logits
    key, transform = _logit_transform(self)
    cd = _compute_dtype(hidden, head.weight)
    if (cd, key) not in state.verified and not _is_fake(hidden):  # fake tensors hold no values
        _verify(self, probe_out, transform, cd, hidden)
        state.verified.add((cd, key))

    get = kwargs.get  # loss keywords (Trainer's num_items_in_batch ...) are always passed by name
    ignore = get("ignore_index", -100) if state.num_items else -100
    num_items = get("num_items_in_batch") if state.num_items else None
    shift = get("shift_labels") if state.num_items else None
    if state.masked:
        targets = labels
    elif shift is not None:
        targets = shift
    else:
        targets = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    loss = chunked_cross_entropy(hidden, head.weight, head.bias, targets, chunk_tokens=state.chunk_tokens,
                                 ignore_index=ignore, num_items_in_batch=num_items, transform=transform,
                                 compute_dtype=cd)
    aux = None if is_tuple else out.get("aux_loss")
    if state.aux_coef and aux is not None:
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    if is_tuple:
        return (loss,) + tuple(out[1:])
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _verify(lm, probe_out, transform, cd, hidden):
    probe = torch.tensor(_PROBE, dtype=cd, device=hidden.device)
    expected = probe if transform is None else transform(probe)
    shape = (*hidden.shape[:-1], len(_PROBE))
    ok = (torch.is_tensor(probe_out) and tuple(probe_out.shape) == shape and torch.allclose(
        probe_out.detach().float(), expected.float().expand(shape), rtol=2 * torch.finfo(cd).eps, atol=0))
    if not ok:
        got = probe_out.detach().reshape(-1, len(_PROBE))[0].tolist() if torch.is_tensor(probe_out) else probe_out
        raise ValueError(
            f"{type(lm).__name__} post-processes its logits in a way the chunked head does not reproduce: "
            f"lm_head outputs {list(_PROBE)} became {got}, expected {expected.float().tolist()}. "
            "Use head='plain' for this model (and report it: remat should learn the transform).")
