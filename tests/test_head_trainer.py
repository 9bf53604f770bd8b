"""The treated model keeps ``forward``'s signature, and the Hugging Face Trainer trains it (issue 13).

The Trainer drops dataset columns that ``inspect.signature(model.forward)`` does not name
(``remove_unused_columns=True``, the default) and passes ``num_items_in_batch`` only to a
forward that takes ``**kwargs``: both read the signature of the treated forward.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import remat


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_treated_forward_keeps_the_models_signature():
    model = _tiny_llama()
    before = inspect.signature(model.forward)
    remat.apply(model, "full", head="chunked")
    assert "forward" in model.__dict__  # the treated forward is installed on the instance
    after = inspect.signature(model.forward)
    assert after == before
    assert {"input_ids", "attention_mask", "labels"} <= set(after.parameters)
    assert any(p.kind is p.VAR_KEYWORD for p in after.parameters.values())  # num_items_in_batch goes through
    assert inspect.signature(model.lm_head.forward) == inspect.signature(torch.nn.Linear(2, 2).forward)


def test_trainer_trains_and_evaluates_the_treated_model(tmp_path):
    from transformers import Trainer, TrainingArguments
    model = remat.apply(_tiny_llama(), "full", head="chunked")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        ids = torch.randint(0, 128, (12,), generator=g)
        labels = ids.clone()
        labels[: 4 + i % 3] = -100  # a prompt mask
        rows.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": labels,
                     "text": "unused column the Trainer must drop"})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, report_to="none", use_cpu=True, save_strategy="no",
                             logging_steps=1)
    assert args.remove_unused_columns
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4])
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    # the columns kept and the loss keywords passed were read from the model's real signature
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    assert "text" not in trainer._signature_columns and trainer.model_accepts_loss_kwargs
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert "forward" in model.__dict__  # still treated after training
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
