"""remat's Axolotl plugin: the YAML of docs/integrations.md trains a tiny Llama through Axolotl on the
CPU, with Axolotl's checkpointing, offload and tiled MLP taken over and remat's plan applied.

Runs where Axolotl imports, else skips: ``make test-axolotl`` (CI runs it) installs Axolotl 0.21 and what
its training path imports beside the venv (``tests/requirements-axolotl.txt``, ``--no-deps
--ignore-requires-python``: 0.21 asks for Python >= 3.12 and pins transformers 5.20; it trains on 3.11
and the venv's transformers). The model,
its tokenizer (a word-level ``tokenizers`` vocabulary) and the data are made here: nothing is
downloaded. Axolotl's telemetry is switched off (``AXOLOTL_DO_NOT_TRACK``).
"""
import json
import os
import re

import pytest
import torch

axolotl = pytest.importorskip("axolotl.integrations.base", reason="axolotl is not installed")
yaml = pytest.importorskip("yaml")

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "integrations.md")


def _doc_yaml() -> dict:
    with open(DOC) as f:
        section = f.read().split("\n## Axolotl\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    return yaml.safe_load(blocks[0])


def _tiny_llama(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(60)]
    vocabulary = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    vocabulary.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocabulary, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, attention_dropout=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _config(tmp_path, **extra) -> str:
    _tiny_llama(tmp_path / "model")
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"text": " ".join(f"w{(7 * i + j) % 60}" for j in range(40))}) + "\n")
    cfg = dict(base_model=str(tmp_path / "model"), datasets=[dict(path=str(tmp_path / "data.jsonl"),
                                                                   type="completion", ds_type="json")],
               sequence_len=32, micro_batch_size=2, gradient_accumulation_steps=1, max_steps=2,
               learning_rate=1e-4, optimizer="adamw_torch", lr_scheduler="constant",
               output_dir=str(tmp_path / "out"), val_set_size=0, save_strategy="no", bf16=False, fp16=False,
               dataset_prepared_path=str(tmp_path / "prepared"))
    cfg.update(_doc_yaml(), **extra)
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train(path):
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.train import train
    PluginManager.get_instance().plugins.clear()   # a singleton: an earlier test's plugins stay registered
    cfg = load_cfg(path)
    model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
    plugin = next(p for p in PluginManager.get_instance().plugins.values() if type(p).__name__ == "RematPlugin")
    return cfg, model, trainer, plugin


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("AXOLOTL_DO_NOT_TRACK", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


def test_the_docs_yaml_trains_with_remat_planning(tmp_path, capsys):
    import remat
    cfg, model, trainer, plugin = _train(_config(tmp_path))
    assert plugin.took_over == {"gradient_checkpointing": True, "activation_offloading": True}
    assert not cfg.gradient_checkpointing and not cfg.activation_offloading
    assert not trainer.args.gradient_checkpointing and not getattr(trainer.args, "activation_offloading", False)
    plan = remat.current_plan(model)
    assert plan is not None and plan.notes["batch"] == 2     # planned from Axolotl's first batch
    assert trainer.state.global_step == 2
    assert not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    assert "taken over" in capsys.readouterr().err


def test_a_fixed_spec_and_tiled_mlp_taken_over(tmp_path):
    import remat
    from remat.treat.treatments import treatment_of
    path = _config(tmp_path, remat_spec="full", tiled_mlp=True, tiled_mlp_num_shards=2)
    text = open(path).read().replace("remat_budget: 40GiB\n", "")
    open(path, "w").write(text)
    cfg, model, trainer, plugin = _train(path)
    assert {"tiled_mlp", "tiled_mlp_num_shards", "gradient_checkpointing"} <= set(plugin.took_over)
    assert {treatment_of(block) for block in model.model.layers} == {"full"}
    assert remat.current_plan(model).summary().startswith("2x full")


def test_bad_keys_fail_before_a_model_is_loaded():
    from remat.integrations.axolotl import RematPlugin
    with pytest.raises(ValueError, match="remat_budget and remat_spec"):
        RematPlugin().register({"remat_budget": "1GiB", "remat_spec": "full"})
    with pytest.raises(ValueError, match="budget"):
        RematPlugin().register({"remat_budget": "lots"})
    with pytest.raises(ValueError, match="remat_head"):
        RematPlugin().register({"remat_head": "fused"})
