"""Architectures outside the zoo's usual shape (issue 29): LayerDrop, a layer shared by every depth."""
import copy

import pytest
import torch

import remat
import zoo


def _m2m100():
    transformers = pytest.importorskip("transformers")
    config = transformers.M2M100Config(vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, pad_token_id=1, decoder_start_token_id=2)
    assert config.encoder_layerdrop > 0 and config.decoder_layerdrop > 0  # the defaults: LayerDrop on
    torch.manual_seed(0)
    return transformers.M2M100ForConditionalGeneration(config).train()


def test_layer_drop_plans_with_every_layer_running():
    """M2M100 draws ``torch.rand([])`` per layer to drop it: a fake-tensor profile takes the draw as
    1.0 (no layer dropped, the step that needs the most memory), says so, and plans every block."""
    model = _m2m100()
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    plan = remat.plan(model, {"input_ids": ids, "labels": ids[:, :7]}, budget="1GiB")
    assert len(plan.blocks) == 4
    assert "layer drop: every layer runs" in str(plan.notes.get("ran_for_real"))
