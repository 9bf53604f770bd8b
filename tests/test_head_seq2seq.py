"""The chunked head on encoder-decoder LMs (issue 29): every family against an untouched copy.

Each model is built from its config class with the defaults (``use_cache`` on, tied
embeddings, T5's output scaling, M2M100's LayerDrop), only sizes shrunk and dropout on; the
same seed runs before each forward, so dropout and LayerDrop draw the same masks in both
copies. Gradient errors are norm-wise relative per parameter; key-projection biases against
the whole gradient's norm (their exact gradient is zero: see tests/test_head.py).

That the chunked path ran is checked at the level of its mechanism: no op makes a tensor
with more than ``CHUNK`` rows of vocabulary width (:class:`_VocabRows`), where the plain path
makes the [tokens x vocab] logits. A head that silently fell back to the plain path fails it.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch.nn import CrossEntropyLoss
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import remat
from remat.planning.solver import NoPlanFits, solve

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import Seq2SeqLMOutput  # noqa: E402  (after the skip)
from transformers.models.bart.modeling_bart import shift_tokens_right  # noqa: E402

FP32_TOL = 1e-6
VOCAB = 256
DROPOUT = 0.1
CHUNK = 4       # 2 x 9 label tokens: five chunks, the last one short
LABELS = 9

_BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64)
_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
           decoder_start_token_id=0)  # T5Config's default is None; every released T5 config says 0
FAMILIES = {
    "t5": ("T5ForConditionalGeneration", "T5Config", _T5),
    "mt5": ("MT5ForConditionalGeneration", "MT5Config", _T5),
    "bart": ("BartForConditionalGeneration", "BartConfig", _BART),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", _BART),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", _BART),
    "marian": ("MarianMTModel", "MarianConfig", _BART),
    "m2m100": ("M2M100ForConditionalGeneration", "M2M100Config", _BART),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(_BART, max_source_positions=8, max_target_positions=32)),
}


def _build(family, vocab=VOCAB):
    model_class, config_class, sizes = FAMILIES[family]
    config = getattr(transformers, config_class)(vocab_size=vocab, **sizes)
    for key, value in config.to_dict().items():  # every dropout on; LayerDrop as the config has it
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, DROPOUT)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= vocab:  # defaults beyond the tiny vocabulary
            setattr(config, key, 1)
    torch.manual_seed(0)
    return getattr(transformers, model_class)._from_config(config).train()


def _batch(model, family, labels=LABELS, batch=2):
    generator = torch.Generator().manual_seed(1)
    targets = torch.randint(3, VOCAB, (batch, labels), generator=generator)
    targets[0, -3:] = -100  # the shorter target, padded as DataCollatorForSeq2Seq pads it
    if family == "whisper":  # log-mel frames: twice the encoder's positions (its convolution has stride 2)
        frames = 2 * model.config.max_source_positions
        features = torch.randn(batch, model.config.num_mel_bins, frames, generator=generator)
        return {"input_features": features.requires_grad_(), "labels": targets}
    ids = torch.randint(3, VOCAB, (batch, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": targets}


def _step(model, batch, seed=3):
    """One training forward/backward: (loss, {name: grad}, output); the input features'
    gradient (Whisper) under 'input_features'."""
    model.zero_grad(set_to_none=True)
    batch = {k: v.detach().requires_grad_() if k == "input_features" else v for k, v in batch.items()}
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    if "input_features" in batch:
        grads["input_features"] = batch["input_features"].grad.double()
    return out.loss.detach().double(), grads, out


def _errors(ours, ref):
    """The loss's relative error and each gradient's (see the module doc)."""
    (loss, grads, _), (ref_loss, ref_grads, _) = ours, ref
    assert grads.keys() == ref_grads.keys()
    total = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    errors = {name: ((grads[name] - g).norm() / (total if "k_proj.bias" in name else g.norm())).item()
              for name, g in ref_grads.items()}
    return ((loss - ref_loss).abs() / ref_loss.abs()).item(), errors


def _assert_close(ours, ref, tol=FP32_TOL):
    loss_error, errors = _errors(ours, ref)
    assert loss_error < tol
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, (worst, errors[worst])


class _VocabRows(TorchDispatchMode):
    """The most rows of vocabulary width (last dimension ``vocab``) in any tensor an op makes
    (views, such as the head weight's transpose, make none): the plain head's logits have one
    per label token, the chunked head's at most a chunk."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in ([] if func.is_view else tree_flatten(out)[0]):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[-1] == self.vocab:
                self.rows = max(self.rows, value.numel() // self.vocab)
        return out


def _vocab_rows(model, batch):
    with _VocabRows(VOCAB) as rows:
        _step(model, batch)
    return rows.rows


@pytest.mark.parametrize("family, spec", [(f, "keep") for f in sorted(FAMILIES)] + [("bart", "full"), ("t5", "full")])
def test_fp32_loss_and_every_gradient_match_the_model(family, spec):
    reference = _build(family)
    model = remat.apply(copy.deepcopy(reference), spec, head="chunked", chunk_tokens=CHUNK)
    batch = _batch(model, family)
    ours = _step(model, batch)
    _assert_close(ours, _step(reference, batch))
    assert ours[2].logits is None
    assert ours[2].encoder_last_hidden_state is not None  # the rest of the output is the model's
    tokens = batch["labels"].numel()
    assert _vocab_rows(reference, batch) >= tokens  # the check sees the plain path's logits
    assert _vocab_rows(model, batch) <= CHUNK       # and the chunked head never makes them


def test_decoder_inputs_given_and_num_items_in_batch_as_the_model_takes_them():
    """A DataCollatorForSeq2Seq batch carries decoder_input_ids (not shifted again); the Trainer
    passes num_items_in_batch, which these models' loss ignores (a mean): so does ours."""
    for family in ("bart", "t5"):
        reference = _build(family)
        model = remat.apply(copy.deepcopy(reference), "keep", head="chunked", chunk_tokens=CHUNK)
        batch = _batch(model, family)
        given = dict(batch, decoder_input_ids=reference.prepare_decoder_input_ids_from_labels(labels=batch["labels"]))
        _assert_close(_step(model, given), _step(reference, given))
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(reference.forward).parameters.values()):
            counted = dict(batch, num_items_in_batch=torch.tensor(5))  # the Trainer's test for passing it
            _assert_close(_step(model, counted), _step(reference, counted))


def test_bart_turns_the_cache_off_under_labels_as_the_model_does():
    reference = _build("bart")
    model = remat.apply(copy.deepcopy(reference), "keep", head="chunked", chunk_tokens=CHUNK)
    batch = dict(_batch(model, "bart"), use_cache=True)
    ours, ref = _step(model, batch), _step(reference, batch)
    _assert_close(ours, ref)
    for out in (ref[2], ours[2]):  # the field is "cache" in transformers 5, "past_key_values" in 4
        assert out.get("cache") is None and out.get("past_key_values") is None


def test_other_calls_are_untouched():
    reference = _build("pegasus")
    model = remat.apply(copy.deepcopy(reference), "keep", head="chunked", chunk_tokens=CHUNK)
    batch = _batch(model, "pegasus")
    with torch.no_grad():  # evaluation with labels keeps its logits (the Trainer's eval loop)
        torch.manual_seed(0)
        out = model(**batch)
        torch.manual_seed(0)
        ref = reference(**batch)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    remat.remove(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_whisper_labels_longer_than_the_decoder_are_refused_as_the_model_refuses_them():
    model = remat.apply(_build("whisper"), "keep", head="chunked", chunk_tokens=CHUNK)
    batch = _batch(model, "whisper", labels=model.config.max_target_positions + 1)
    with pytest.raises(ValueError, match="max_target_positions"):
        model(**batch)


def _smoothed_forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, labels=None, **kwargs):
    if labels is not None and decoder_input_ids is None:
        decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
    outputs = self.model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, **kwargs)
    lm_logits = self.lm_head(outputs[0]) + self.final_logits_bias
    loss = None
    if labels is not None:
        loss_fct = CrossEntropyLoss(label_smoothing=0.1)
        loss = loss_fct(lm_logits.view(-1, self.config.vocab_size), labels.view(-1))
    return Seq2SeqLMOutput(loss=loss, logits=lm_logits)


def _masked_decoder_forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, labels=None,
                            **kwargs):
    if labels is not None:
        decoder_input_ids = labels.masked_fill(labels == -100, self.config.pad_token_id)
    outputs = self.model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, **kwargs)
    lm_logits = self.lm_head(outputs[0])
    loss = None
    if labels is not None:
        loss = CrossEntropyLoss()(lm_logits.view(-1, self.config.vocab_size), labels.view(-1))
    return Seq2SeqLMOutput(loss=loss, logits=lm_logits)


def test_refusals_name_what_in_the_loss_differs():
    for forward, named in ((_smoothed_forward, r"its loss runs `loss_fct = CrossEntropyLoss\(label_smoothing=0.1\)`"),
                           (_masked_decoder_forward, r"before its lm_head, it runs `decoder_input_ids = labels")):
        variant = type("Variant", (transformers.BartForConditionalGeneration,), {"forward": forward})
        torch.manual_seed(0)
        model = variant(_build("bart").config)
        with pytest.raises(ValueError, match=named) as refused:
            remat.apply(model, "keep", head="chunked")
        assert "Variant's loss is not one the chunked head reproduces exactly" in str(refused.value)
        assert "head='plain'" in str(refused.value)
        assert "forward" not in model.__dict__  # refused before anything was changed


def test_the_logit_transform_is_read_from_the_forward():
    """BART adds its ``final_logits_bias`` in its forward, and never reads a config's ``logits_scaling``
    (Granite's divisor): the chunked head reproduces the bias and ignores the field, as the forward does."""
    from remat.head import check_chunked_head
    model = _build("bart")
    model.config.logits_scaling = 4.0
    _, state = check_chunked_head(model)
    assert state.transform.text == "lm_logits = lm_logits + self.final_logits_bias.to(lm_logits.device)"


def test_plan_chooses_the_chunked_head_where_only_it_fits():
    """Planned with fake tensors (CPU) on a batch whose logits set the floor, as a real
    vocabulary's do (4 x 64 label tokens at a 4096 vocabulary): chunking lowers it. T5, because
    BART's LayerDrop reads tensor values before transformers 5.24, which fake tensors refuse."""
    model = _build("t5", vocab=4096)
    batch = _batch(model, "t5", labels=64, batch=4)
    prof = remat.profile(model, batch)
    assert {h.mode for h in prof.heads} == {"plain", "chunked"}, prof.notes
    floors = {}
    for head in ("plain", "chunked"):
        with pytest.raises(NoPlanFits) as none:
            solve(prof, 1, heads=[head])
        floors[head] = none.value.smallest_peak
    assert floors["chunked"] < floors["plain"]
    plan = remat.plan(model, batch, budget=floors["chunked"], profiled=prof)
    assert plan.head == "chunked"
    reference = copy.deepcopy(model)
    remat.apply(model, plan)
    _assert_close(_step(model, batch), _step(reference, batch))
