"""The Hugging Face side of the chunked head: what a model's forward does with its labels and
its logits, read from the model, and that loss computed again by the chunked op.

The chunked op (:func:`remat.head.chunked_loss.chunked_cross_entropy`) knows nothing of Hugging
Face; :mod:`remat.head.patching` intercepts the model's ``lm_head`` call and hands the hidden states
it received to :func:`model_loss` here, which reproduces the model's loss semantics and logit
transform and checks the transform on a probe.

Reproduced from the model: label shifting (``ForCausalLMLoss``; ``shift_labels=`` as given),
masked-LM and encoder-decoder labels, ``ignore_index``, the mean or ``sum / num_items_in_batch``,
logit soft-capping and scales (Gemma, Cohere, Granite), an lm_head bias or a ``final_logits_bias``
buffer (BART, Marian, ...), tied embeddings, frozen heads (LoRA) and MoE router auxiliary losses.
The logit transform is *checked*, once per model and dtype: the intercepted ``lm_head`` returns a
small probe tensor (:func:`probe`), and the model's own post-processing of it must equal ours, else
the call raises.

Encoder-decoders (T5, BART, Pegasus, Marian, M2M100, Whisper, ...): the chunked call passes
``labels=None``, so what the forward does with ``labels`` before its decoder runs is done here
instead, read from the forward's statements (:func:`_seq2seq`), each recognised or the model refused
with the statement named (:class:`DecoderInputs`). Their loss must be ``CrossEntropyLoss()`` over
the lm_head's logits and the labels as they are.

Limits: the output embedding must be a plain ``nn.Linear`` (LoRA or quantised ``lm_head`` refused);
the loss must go through ``self.loss_function`` (or ``CrossEntropyLoss()``); a model adding a
logits bias runs eager chunks on CUDA, not the fused kernel. Tolerances and the full list:
``docs/design/treatments.md``.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat import caches
from remat.head.chunked_loss import chunked_cross_entropy, compute_dtype_of, is_fake
from remat.head.transform import Transform, check_transform, read_transform, uncalled_head
from remat.treat.refusals import StepRefusal

_PROBE = (-48.0, -6.0, -1.5, -0.25, 0.0, 0.5, 3.0, 40.0)  # exact in fp16/bf16


@dataclass(frozen=True)
class DecoderInputs:
    """What an encoder-decoder's forward does with ``labels`` before its decoder runs (read by
    :func:`_seq2seq`); the chunked call passes ``labels=None`` and does it in :meth:`prepare`."""

    shift: Optional[tuple] = None
    """``(method, name, config_fields)``: the decoder's ids are ``self.name(labels, *config
    fields)`` (``method``) or ``name(...)`` from the forward's module; None: not built."""
    unless_embeds: bool = False
    """The ids are built only where ``decoder_inputs_embeds`` is None too (M2M100 does not ask)."""
    no_cache: bool = False
    """``use_cache = False`` when labels are given (BART, mBART, Pegasus, Marian)."""
    max_length: Optional[str] = None
    """The attribute that bounds the labels' length (Whisper's ``max_target_positions``)."""

    def prepare(self, lm, arguments, labels):
        """Change the bound ``arguments`` of ``lm``'s forward as its ``labels`` branch would."""
        if self.max_length is not None and labels.shape[1] > getattr(lm, self.max_length):
            raise ValueError(f"labels' sequence length {labels.shape[1]} cannot exceed {type(lm).__name__}."
                             f"{self.max_length} = {getattr(lm, self.max_length)} tokens")
        if self.no_cache:
            arguments["use_cache"] = False
        if self.shift is not None and arguments.get("decoder_input_ids") is None and not (
                self.unless_embeds and arguments.get("decoder_inputs_embeds") is not None):
            method, name, fields = self.shift
            shift = getattr(lm, name) if method else inspect.unwrap(type(lm).forward).__globals__[name]
            arguments["decoder_input_ids"] = shift(labels, *(getattr(lm.config, f) for f in fields))


@dataclass
class HeadState:
    """What the chunked head knows of one model: its loss semantics, and during a call what it captured."""

    signature: Any
    chunk_tokens: Optional[int]
    masked: bool            # masked LM or encoder-decoder: labels are not shifted
    num_items: bool         # the model's loss honours num_items_in_batch / ignore_index kwargs
    aux_coef: bool          # the model adds router_aux_loss_coef * aux_loss when labels are given
    decoder: Optional[DecoderInputs] = None  # an encoder-decoder's labels branch, done by the chunked call
    row_probe: bool = False  # the model adds a logits bias: the probe is one row of vocabulary width
    transform: Optional[Transform] = None  # the logit transform read from the forward (None: not readable)
    verified: set = field(default_factory=set)
    captured: Optional[list] = None  # during a chunked call: where the lm_head's input goes


def check_chunked_head(model: nn.Module, chunk_tokens: Optional[int] = None):
    """Raise the error :func:`~remat.head.patching.enable_chunked_head` would raise, without changing ``model``.

    Args:
        model: the model to check.
        chunk_tokens: rows per chunk, or None (chosen for the vocabulary).

    Returns:
        ``(lm, state)``: the LM module whose forward the head patches, and the state it would run with.

    Raises:
        ValueError: ``chunk_tokens`` is no positive integer, the LM's forward takes no ``labels``, its
            output embedding is not called as a module, or its logits are not ones the head reproduces.
        TypeError: the output embedding is not a plain ``nn.Linear``."""
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
    signature = inspect.signature(type(lm).forward).replace(
        parameters=list(inspect.signature(type(lm).forward).parameters.values())[1:])
    if "labels" not in signature.parameters:
        raise ValueError(f"{type(lm).__name__}.forward has no 'labels' parameter; the chunked head "
                         "replaces the loss computed from labels: use head='plain'")
    masked, num_items, aux, decoder = _loss_semantics(lm, signature)
    uncalled = uncalled_head(lm, head)
    if uncalled:
        raise ValueError(f"{type(lm).__name__}'s output embedding is not called as a module ({uncalled}), and the "
                         "chunked head computes the loss from that call's input: use head='plain' for this model")
    transform = read_transform(lm, _head_path(lm, head).split(".")[0])
    if transform is not None and transform.text and not is_fake(head.weight) and head.weight.device.type != "meta":
        vocab = head.weight.shape[0]
        row = torch.tensor(_PROBE, dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            problem = check_transform(lm, transform, row.repeat(-(-vocab // len(_PROBE)))[:vocab].reshape(1, vocab))
        if problem:
            raise ValueError(f"{type(lm).__name__}'s logits are not ones the chunked head reproduces ({problem}); "
                             "use head='plain' for this model")
    return lm, HeadState(signature=signature, chunk_tokens=chunk_tokens, masked=masked, num_items=num_items,
                          aux_coef=aux, decoder=decoder, row_probe=_logits_bias(lm) is not None, transform=transform)


def _head_path(lm: nn.Module, head: nn.Module) -> str:
    """The output embedding's name in ``lm`` (``lm_head``, ``cls.predictions.decoder``)."""
    return next((name for name, module in lm.named_modules() if module is head), "lm_head") or "lm_head"


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


def _loss_semantics(lm: nn.Module, signature):
    """``(masked, num_items, aux_coef, decoder)`` of ``lm``'s loss, read from its forward; raises
    ValueError naming what the chunked head would not reproduce."""
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
    own_function = "self.loss_function(" in source
    sliced = re.search(r"(\w*logits\w*) = logits\[[^\]]*\]", source)
    if own_function and sliced:  # GIT: the loss of the text rows after the image tokens
        raise ValueError(refuse.format(f"it computes its loss on a slice of the logits, `{sliced.group(0)}`"))
    decoder = None
    if getattr(lm.config, "is_encoder_decoder", False):
        decoder = _seq2seq(lm, source, signature, refuse, cross_entropy=not own_function)
    if own_function:
        from transformers.loss.loss_utils import LOSS_MAPPING
        fn = lm.loss_function
        if fn is LOSS_MAPPING["ForCausalLM"]:
            # labels=None with shift_labels=labels: targets already aligned with the logits (an
            # encoder-decoder's, PP-FormulaNet), the causal loss told not to shift them again
            aligned = re.search(r"\blabels=None\b", _call_text(source, "self.loss_function(")) is not None
            return aligned, True, aux, decoder
        if fn is LOSS_MAPPING["ForMaskedLM"]:
            return True, True, aux, decoder
        raise ValueError(refuse.format(f"loss_function is {getattr(fn, '__name__', fn)}"))
    if decoder is not None:
        return True, False, aux, decoder
    if "ForMaskedLM" in name and "CrossEntropyLoss()" in source:
        return True, False, aux, None
    raise ValueError(refuse.format("its forward does not call self.loss_function"))


def _call_text(source: str, opening: str) -> str:
    """The arguments of the first call that starts with ``opening`` in ``source``, up to its
    matching parenthesis ("" if there is none)."""
    start = source.find(opening)
    if start < 0:
        return ""
    depth, index = 0, start + len(opening) - 1
    for index in range(start + len(opening) - 1, len(source)):
        depth += {"(": 1, ")": -1}.get(source[index], 0)
        if depth == 0:
            break
    return source[start + len(opening):index]


_SHIFT = re.compile(r"decoder_input_ids = (self\.)?(\w+)\(labels((?:, self\.config\.\w+)*)\)")
_CROSS_ENTROPY = re.compile(r"(\w+) = (?:torch\.nn\.|nn\.)?CrossEntropyLoss\((?:ignore_index=-100)?\)")
_LOSS_CALL = re.compile(r"\w+ = (\w+)\((\w+)\.view\(-1, (.+)\), labels\.(?:view|reshape)\(-1\)\)")


def _seq2seq(lm, source, signature, refuse, cross_entropy=True) -> DecoderInputs:
    """How an encoder-decoder's forward uses ``labels``, from its statements: before the
    output embedding's call, what :class:`DecoderInputs` does; after it (``cross_entropy``),
    ``CrossEntropyLoss()`` over that call's logits and the labels unshifted. Any other statement
    that reads ``labels`` or runs under ``if labels ...`` is named in a ValueError."""
    head = lm.get_output_embeddings()
    attribute = next((n for n, m in lm.named_children() if m is head), "lm_head")
    body = [s for s in ast.parse(textwrap.dedent(source)).body[0].body  # docstrings left out
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    at = next((i for i, s in enumerate(body) if f"self.{attribute}(" in ast.unparse(s)), None)
    if at is None or not (isinstance(body[at], ast.Assign) and len(body[at].targets) == 1
                          and isinstance(body[at].targets[0], ast.Name)):
        raise ValueError(refuse.format(f"its forward does not assign self.{attribute}(...) to a name"))
    found = {}
    for conditions, text in _under_labels(body[:at]):
        rest = conditions[1:]
        shift = _SHIFT.fullmatch(text)
        length = re.fullmatch(r"labels\.shape\[1\] > self\.(\w+)", rest[0]) if len(rest) == 1 else None
        if conditions[:1] != ["labels is not None"]:
            raise ValueError(refuse.format(f"before its {attribute} it runs `{_short(text)}` with the labels"))
        if shift and "decoder_input_ids is None" in rest and set(rest) <= {"decoder_input_ids is None",
                                                                           "decoder_inputs_embeds is None"}:
            fields = tuple(f for f in shift[3].split(", self.config.") if f)
            method = bool(shift[1])
            if not (callable(getattr(lm, shift[2], None)) if method else
                    callable(inspect.unwrap(type(lm).forward).__globals__.get(shift[2]))):
                raise ValueError(refuse.format(f"cannot find {shift[2]}, which builds its decoder's inputs"))
            found.update(shift=(method, shift[2], fields), unless_embeds="decoder_inputs_embeds is None" in rest)
        elif text == "use_cache = False" and not rest:
            found["no_cache"] = True
        elif rest == ["use_cache"] and re.fullmatch(r"logger\.warning(_once)?\(.*\)", text):
            pass  # its warning that labels turn the cache off
        elif length and text.startswith("raise "):
            found["max_length"] = length[1]
        else:
            raise ValueError(refuse.format(f"with labels, before its {attribute}, it runs `{_short(text)}`"
                                           + (f" under `if {' and '.join(rest)}`" if rest else "")))
    needed = (("decoder_input_ids",) if "shift" in found else ()) + (("use_cache",) if "no_cache" in found else ())
    for missing in (n for n in needed if n not in signature.parameters):
        raise ValueError(refuse.format(f"its forward has no '{missing}' parameter"))
    if cross_entropy:
        _check_cross_entropy(lm, body[at + 1:], body[at].targets[0].id, head.out_features, refuse)
    return DecoderInputs(**found)


def _check_cross_entropy(lm, statements, logits, vocab, refuse):
    """``statements`` (after the output embedding's call) compute ``CrossEntropyLoss()`` of the
    ``logits`` and the labels, and nothing else with the labels."""
    losses, done = set(), False
    for conditions, text in _under_labels(statements):
        call = _LOSS_CALL.fullmatch(text)
        width = call[3] if call else ""
        known = width in (f"{logits}.size(-1)", f"{logits}.shape[-1]") or (
            width.startswith("self.config.") and getattr(lm.config, width[12:], None) == vocab)
        if conditions != ["labels is not None"]:
            raise ValueError(refuse.format(f"its loss runs `{_short(text)}` under `if {' and '.join(conditions)}`"))
        if re.fullmatch(r"labels = labels\.to\([\w.]+\)", text):
            continue
        if _CROSS_ENTROPY.fullmatch(text):
            losses.add(_CROSS_ENTROPY.fullmatch(text)[1])
        elif call and call[1] in losses and call[2] == logits and known:
            done = True
        else:
            raise ValueError(refuse.format(f"its loss runs `{_short(text)}`"))
    if not done:
        raise ValueError(refuse.format(f"no CrossEntropyLoss() of {logits} and the labels found in its forward"))


def _under_labels(statements):
    """``(conditions, statement)`` for each statement that reads ``labels`` or runs under an ``if``
    that does (``if a and b:`` read as ``if a: if b:``), as ``ast.unparse`` writes them."""
    for statement in statements:
        if re.search(r"\blabels\b", ast.unparse(statement)):
            yield from _leaves([], statement)


def _leaves(conditions, statement):
    if isinstance(statement, ast.If) and not statement.orelse:
        test = statement.test
        parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        for inner in statement.body:
            yield from _leaves(conditions + [ast.unparse(p) for p in parts], inner)
    else:
        yield conditions, ast.unparse(statement)


def _short(text, limit=160):
    """A statement for an error message: one line, at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _logits_bias(lm: nn.Module):
    """The buffer an encoder-decoder adds to its logits (``final_logits_bias``), or None."""
    bias = getattr(lm, "final_logits_bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _logit_transform(lm: nn.Module):
    """The model's post-``lm_head`` logit transform as (key, function or None): its logits bias
    (added as the model adds it: dtype promotion and all), then a soft-cap or scale."""
    key, scalar = _scalar_transform(lm)
    bias = _logits_bias(lm)
    if bias is None:
        return key, scalar

    def biased(z):
        return z + bias.to(z.device)
    return ("bias",) + key, biased if scalar is None else (lambda z: scalar(biased(z)))


def _scalar_transform(lm: nn.Module):
    config = lm.config
    cap = None
    for name in ("final_logit_softcapping", "logits_soft_cap"):  # Gemma 2/3; RecurrentGemma
        for source in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
            cap = getattr(source, name, None) if cap is None else cap
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


_PROBES = caches.register({}, "head.hf_model._PROBES")  # (device, dtype) -> _PROBE as a tensor there, uploaded once (an upload waits for the GPU)


def probe(hidden, vocab, row, dtype):
    """What the intercepted ``lm_head`` returns: ``_PROBE`` per token, or (``row``) one row of
    ``vocab`` values, for a model that adds a [vocab] bias to its logits. Made on the device from
    a copy kept there: no host-to-device copy per step."""
    if is_fake(hidden):
        values = torch.tensor(_PROBE, dtype=dtype, device=hidden.device)
    else:
        key = (hidden.device, dtype)
        if key not in _PROBES:
            _PROBES[key] = torch.tensor(_PROBE, dtype=dtype, device=hidden.device)
        values = _PROBES[key]
    if row:
        return values.repeat(-(-vocab // len(_PROBE)))[:vocab].reshape((1,) * (hidden.dim() - 1) + (vocab,))
    return values.expand(*hidden.shape[:-1], len(_PROBE)).clone()


def model_loss(self, state, out, hidden, head, labels, kwargs):
    """``self``'s loss from the ``hidden`` states its ``head`` received, by the chunked op, in its
    forward's output ``out`` (``loss`` set, ``logits`` dropped); ``kwargs``: the forward's keywords.
    The logit transform is checked on the probe ``out`` carries, once per compute dtype."""
    is_tuple = isinstance(out, tuple)
    probe_out = out[0] if is_tuple else out.logits
    if state.transform is not None:  # as the forward's own statements do it (remat.head.transform)
        key = ("read", state.transform.source)
        transform = functools.partial(state.transform, self) if state.transform.text else None
    else:
        key, transform = _logit_transform(self)
    cd = compute_dtype_of(hidden, head.weight)
    if (cd, key) not in state.verified and not is_fake(hidden):  # fake tensors hold no values
        _verify(self, probe_out, transform, probe(hidden, head.weight.shape[0], state.row_probe, cd))
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


def _verify(lm, probe_out, transform, probe_in):
    """``probe_out``, what ``lm``'s forward made of the ``probe_in`` its ``lm_head`` returned, is
    ``transform(probe_in)``; else a ValueError."""
    expected = probe_in if transform is None else transform(probe_in)
    shape = tuple(probe_in.shape)
    ok = (torch.is_tensor(probe_out) and tuple(probe_out.shape) == shape and torch.allclose(
        probe_out.detach().float(), expected.float().expand(shape), rtol=2 * torch.finfo(probe_in.dtype).eps, atol=0))
    if not ok:
        got = probe_out.detach().reshape(-1)[:len(_PROBE)].tolist() if torch.is_tensor(probe_out) else probe_out
        want = expected.float().reshape(-1)[:len(_PROBE)].tolist()
        raise StepRefusal(
            f"{type(lm).__name__} post-processes its logits in a way the chunked head does not reproduce: "
            f"lm_head outputs {list(_PROBE)} became {got}, expected {want}. "
            "Use head='plain' for this model (and report it: remat should learn the transform).")
