"""TRL's ``SFTTrainer`` with its default ``SFTConfig`` (gradient checkpointing on, bf16 on,
TRL's fused LM head added after ``Trainer.__init__``) and remat in one line.

- The callback takes Hugging Face checkpointing over and plans the blocks with remat's plain
  head mode, leaving TRL's fused head as it is: the per-step losses equal the same run with
  TRL's defaults (Hugging Face checkpointing of every block), exactly.
- remat's chunked head applied before the trainer was built would never be called under TRL's
  fused head (it calls the backbone itself): the callback takes it off and says so, and
  ``remat doctor`` names the problem for a run without the callback.
"""
import warnings

import pytest
import torch

import remat
from remat.api import current_plan

trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl)")
datasets = pytest.importorskip("datasets")
from test_integrations_hf import STEPS, VOCAB, _real, tiny_llama, with_lora  # noqa: E402


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _data():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB - 2, (15,), generator=g).tolist() for _ in range(12)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def sft(model, tmp_path, callbacks=(), **config):
    """Three SFT steps with the default SFTConfig; per-step losses and the trainer."""
    from trl import SFTConfig, SFTTrainer
    losses = []

    def keep_loss(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled() and _real(getattr(output, "loss", None)):
            losses.append(output.loss.detach().float().clone())
    handle = model.register_forward_hook(keep_loss, with_kwargs=True)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, report_to="none", use_cpu=True, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=model, args=args, train_dataset=_data(), processing_class=_tokenizer(),
                             callbacks=list(callbacks))
        trainer.train()
    handle.remove()
    return torch.stack(losses), trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return sft(tiny_llama(), tmp_path_factory.mktemp("sft-ref"))[0]


def test_sft_default_config_with_callback_matches_trl_defaults(reference, tmp_path):
    from remat.head import find_trl_head
    from remat.integrations.hf import RematCallback
    said = []
    model = tiny_llama()
    callback = RematCallback(spec="full", say=said.append)
    losses, trainer = sft(model, tmp_path, callbacks=[callback])
    assert torch.equal(losses, reference)
    assert callback.took_over and callback.trl_head and find_trl_head(model) is model
    assert current_plan(model).head == "plain" and set(current_plan(model).blocks.values()) == {"full"}
    assert any("TRL's fused LM head" in m for m in said)


def test_sft_chunked_head_applied_before_is_taken_off_not_silently_bypassed(tmp_path, monkeypatch):
    from remat.integrations.hf import RematCallback
    from remat.head import hf_model as head_module
    calls = []
    original = head_module.chunked_cross_entropy

    def counted(hidden, *args, **kwargs):
        if _real(hidden):   # not the planner's profiling run (fake tensors)
            calls.append(1)
        return original(hidden, *args, **kwargs)
    monkeypatch.setattr(head_module, "chunked_cross_entropy", counted)
    said = []
    model = tiny_llama()
    remat.apply(model, "full", head="chunked")
    losses, _ = sft(model, tmp_path, callbacks=[RematCallback(say=said.append, budget="1GB")])
    assert len(losses) == STEPS and torch.isfinite(losses).all()
    assert calls == []                                          # TRL's head computed the loss ...
    assert any("taken off" in m for m in said)                  # ... and the user was told
    assert current_plan(model).head == "plain"


def test_sft_lora_with_budget(tmp_path):
    from remat.integrations.hf import RematCallback
    model = with_lora(tiny_llama())
    callback = RematCallback(budget="1GB", say=lambda m: None)
    losses, _ = sft(model, tmp_path, callbacks=[callback])
    assert len(losses) == STEPS and torch.isfinite(losses).all()
    assert callback.replans >= 1 and current_plan(model).head == "plain"


def test_doctor_names_a_chunked_head_trl_bypasses(tmp_path):
    from remat.diagnosis import doctor
    from trl.trainer.utils import add_fused_lm_head
    model = tiny_llama().train()
    model.config.use_cache = False
    remat.apply(model, "full", head="chunked")
    add_fused_lm_head(model)
    findings = doctor(model)
    assert [f.check for f in findings] == ["head-bypassed"]
    assert "TRL" in findings[0].what
