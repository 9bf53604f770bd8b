"""remat inside the Hugging Face Trainer (issue 13): three steps through ``Trainer`` with its
default arguments give the same losses and parameters as the same run with Hugging Face's
non-reentrant checkpointing.

Exact (``torch.equal``) for the plain head: the treatments recompute the same ops in the
same order. The chunked head computes the same fp32 loss a chunk of tokens at a time, in
another order of summation: losses and parameters within 1e-5 relative (the head's own
fp32 rounding, see remat.head) for the loss of each of three AdamW steps. Parameters
are compared only for the plain head: Adam divides each gradient entry by its own running
magnitude, so an entry whose gradient is ~0 turns a 1e-8 difference into a step of up to the
learning rate; the per-step losses are what the two heads must agree on.

The model is a tiny Llama with the config's defaults (``use_cache`` stays True, as
``from_pretrained`` gives it); the Trainer runs on the CPU with only the arguments a test
needs (output folder, steps, batch size, seed, no reporting or saving).
"""
import warnings

import pytest
import torch

import remat
from remat.api import current_plan
from versions import TRANSFORMERS_4

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, STEPS, BATCH = 16, 128, 3, 2


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def with_lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))


class TokenData(torch.utils.data.Dataset):
    """Random token rows of ``lengths`` (cycled), labels = input_ids."""

    def __init__(self, count=12, lengths=(SEQ,), seed=3):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g) for i in range(count)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def training_args(tmp_path, **extra):
    from transformers import TrainingArguments
    values = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                  report_to="none", use_cpu=True, seed=7, learning_rate=1e-2, save_strategy="no")
    return TrainingArguments(**{**values, **extra})


def _real(loss):
    """A loss of a real step (the planner's profiling runs the model on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return loss is not None and not isinstance(loss, FakeTensor)


HF_CHECKPOINTING = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})


def train(model, tmp_path, callbacks=(), trainer_class=None, data=None, seen=None, **extra):
    """Three steps; returns (per-step training losses, trained parameters, trainer).
    ``seen`` gets each training forward's input_ids size."""
    from transformers import Trainer
    losses = []

    def keep_loss(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled() and _real(getattr(output, "loss", None)):
            losses.append(output.loss.detach().clone())
            if seen is not None:
                seen.append(kwargs["input_ids"].numel())
    handle = model.register_forward_hook(keep_loss, with_kwargs=True)
    if TRANSFORMERS_4 and hasattr(model, "peft_config"):
        # 4.x's Trainer cannot read the labels' name through a PeftModel's forward(*args, **kwargs):
        # without it, evaluate() computes no loss
        extra.setdefault("label_names", ["labels"])
    trainer = (trainer_class or Trainer)(model=model, args=training_args(tmp_path, **extra),
                                         train_dataset=data or TokenData(), eval_dataset=TokenData(count=4, seed=9),
                                         callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    handle.remove()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses), params, trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Hugging Face non-reentrant checkpointing: plain model and LoRA model."""
    out = {}
    for lora in (False, True):
        model = tiny_llama()
        if lora:
            model = with_lora(model)
        losses, params, _ = train(model, tmp_path_factory.mktemp("ref"), **HF_CHECKPOINTING)
        out[lora] = (losses, params)
    return out


def _check(got, want, exact):
    losses, params = got
    ref_losses, ref_params = want
    assert len(losses) == STEPS
    assert params.keys() == ref_params.keys()
    if exact:
        assert torch.equal(losses, ref_losses), (losses, ref_losses)
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
    else:  # chunked head: another order of summation in fp32 (module docstring)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["full-model", "lora"])
@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_callback_matches_hf_checkpointing(reference, tmp_path, lora, head):
    from remat.integrations.hf import RematCallback
    model = tiny_llama()
    if lora:
        model = with_lora(model)
    callback = RematCallback(spec="full", head=head, say=lambda m: None)
    losses, params, trainer = train(model, tmp_path, callbacks=[callback])
    assert current_plan(model).head == head
    assert set(current_plan(model).blocks.values()) == {"full"}
    _check((losses, params), reference[lora], exact=head == "plain")
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    predictions = trainer.predict(TokenData(count=2, seed=11))
    assert predictions.predictions.shape[-1] == VOCAB  # eval keeps the logits, chunked head or not


@pytest.mark.parametrize("lora", [False, True], ids=["full-model", "lora"])
@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_manual_apply_before_trainer_matches_hf_checkpointing(reference, tmp_path, lora, head):
    model = tiny_llama()
    if lora:
        model = with_lora(model)
    remat.apply(model, "full", head=head)
    losses, params, trainer = train(model, tmp_path)
    _check((losses, params), reference[lora], exact=head == "plain")
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))


def test_callback_takes_over_hf_checkpointing(reference, tmp_path):
    """gradient_checkpointing=True in TrainingArguments: remat's plan instead, one message."""
    from remat.integrations.hf import RematCallback
    said = []
    model = tiny_llama()
    callback = RematCallback(spec="full", say=said.append)
    losses, params, trainer = train(model, tmp_path, callbacks=[callback], **HF_CHECKPOINTING)
    _check((losses, params), reference[False], exact=True)
    assert callback.took_over and not trainer.args.gradient_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    take_over = [m for m in said if "taken over" in m]
    assert len(take_over) == 1 and "gradient_checkpointing" in take_over[0] and \
        "activation_checkpointing" in take_over[0]


def test_callback_added_after_init_takes_over_at_train_begin(reference, tmp_path):
    """add_callback after the Trainer is built: on_init_end never ran, train() switched Hugging
    Face checkpointing on; the callback switches it off before the first step."""
    from transformers import Trainer

    from remat.integrations.hf import RematCallback
    said = []
    model = tiny_llama()
    trainer = Trainer(model=model, args=training_args(tmp_path, **HF_CHECKPOINTING), train_dataset=TokenData())
    callback = RematCallback(spec="full", say=said.append)
    trainer.add_callback(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert callback.took_over and current_plan(model) is not None
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    params = {n: p.detach() for n, p in model.named_parameters()}
    for name, p in reference[False][1].items():
        assert torch.equal(params[name], p), name


def test_callback_plans_from_the_first_real_batch_and_replans_on_a_longer_one(tmp_path):
    """budget on the CPU: planned inside the first training forward, from the batch the
    Trainer collated; a longer batch later is planned before it runs; the RNG and data order
    are those of the run without remat (no batch is drawn from the loader)."""
    from remat.integrations.hf import RematCallback
    said = []
    model = tiny_llama()
    # batch size 1 and rows of 8 then 16 tokens: the third step is the first longer batch
    data = TokenData(count=6, lengths=(8, 8, 16), seed=4)
    callback, seen = RematCallback(budget="1GB", say=said.append), []
    train(model, tmp_path, callbacks=[callback], data=data, seen=seen, per_device_train_batch_size=1)
    longest_so_far = [n for i, n in enumerate(seen) if n > max(seen[:i], default=0)]
    planned = [m for m in said if m.startswith("remat: planned")]
    assert callback.replans == len(planned) == len(longest_so_far)
    assert callback.planned_tokens == max(seen)
    assert current_plan(model) == callback.plan and current_plan(model).notes["budget_bytes"] == 10**9
    assert not remat.treat.patches.patches(model, tag="hf-callback")  # watcher gone after train()


def test_watcher_replans_only_on_longer_batches():
    from types import SimpleNamespace

    from remat.integrations.hf import RematCallback
    model = tiny_llama().train()
    callback = RematCallback(budget="1GB", say=lambda m: None)
    args = SimpleNamespace(optim="adamw_torch", gradient_checkpointing=False, activation_checkpointing=False)
    callback.on_train_begin(args, None, None, model=model)
    for length in (8, 8, 12, 4, 12, 16):
        ids = torch.randint(0, VOCAB, (2, length))
        model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (2, 32)))   # evaluation: never planned
    assert callback.replans == 3 and callback.planned_tokens == 32
    callback.on_train_end(args, None, None)
    assert current_plan(model) is not None and not remat.treat.patches.patches(model, tag="hf-callback")


def test_callback_refuses_a_cpu_model_without_budget_or_spec(tmp_path):
    from types import SimpleNamespace

    from remat.integrations.hf import RematCallback
    with pytest.raises(ValueError, match="budget='24GiB'"):
        RematCallback().on_train_begin(SimpleNamespace(optim="adamw_torch"), None, None, model=tiny_llama())
    with pytest.raises(ValueError, match="not both"):
        RematCallback(budget="1GiB", spec="full")


def _batch_for_docs():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))
    return {"input_ids": ids, "labels": ids.clone()}


def test_without_full_attention_masks_drops_only_masks_of_all_ones(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
    from remat.integrations.hf import RematCallback, without_full_attention_masks

    def with_masks(pad_first=0):
        rows = TokenData(count=4).rows
        masks = [torch.ones_like(r) for r in rows]
        masks[0][:pad_first] = 0
        return [{"input_ids": r, "attention_mask": m, "labels": r.clone()} for r, m in zip(rows, masks)]
    collate = without_full_attention_masks(default_data_collator)
    assert "attention_mask" not in collate(with_masks())
    padded = collate(with_masks(pad_first=3))
    assert padded["attention_mask"][0, :3].tolist() == [0, 0, 0] and padded["attention_mask"][1].all()
    with pytest.raises(TypeError, match="wraps a collator"):
        without_full_attention_masks("not a collator")

    class Rows(torch.utils.data.Dataset):
        rows = with_masks()

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    def losses(collator):
        seen, logged = [], []
        model = tiny_llama()
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("attention_mask" in kwargs),
                                        with_kwargs=True)

        class Log(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    logged.append(logs["loss"])
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                 logging_steps=1, report_to="none", use_cpu=True, save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=collator,
                          callbacks=[RematCallback(spec="full", say=lambda m: None), Log()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        return seen, logged
    seen_plain, plain = losses(default_data_collator)
    seen_wrapped, wrapped = losses(collate)
    assert all(seen_plain) and not any(seen_wrapped) and len(plain) == 2
    assert wrapped == plain   # an all-ones mask masks nothing: the same losses
