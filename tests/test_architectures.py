"""Architectures outside the zoo's usual shape (issue 29): LayerDrop, a layer shared by every depth."""
import copy

import pytest
import torch

import oracle
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


@pytest.mark.parametrize("spec", ["full", "selective", "segments:2", "full+offload"])
def test_state_a_forward_writes_and_reads_is_written_once(spec):
    """I-BERT's activation quantisers assign a new range buffer each forward (a momentum average)
    and quantise with it: a recompute must start from the range the forward started from and leave
    the forward's, or the buffers and the gradients drift (1.3% after one step before this)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "IBertForMaskedLM"):
        pytest.skip("transformers has no I-BERT")
    config = transformers.IBertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.IBertForMaskedLM(config).train()
    reference = copy.deepcopy(model)
    remat.apply(model, spec, offload_options=zoo.INLINE_OFFLOAD)
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    oracle.check(model, reference, ids, steps=2)  # the range buffers compared after each step


def test_a_loss_told_its_labels_are_aligned_is_not_shifted():
    """PP-FormulaNet passes ``labels=None, shift_labels=labels`` to the causal loss (its targets are
    already aligned with the logits): the chunked head must not shift them (it did: the loss was
    5.53 against 5.47, gradients 150% off)."""
    registry_zoo = pytest.importorskip("registry_zoo")
    import registry_cells
    try:
        case = registry_zoo.case("pp_formulanet")
    except (KeyError, zoo.Unavailable) as reason:
        pytest.skip(str(reason))
    cell = registry_cells.run_cell(case, "keep", "chunked")
    assert cell.verdict in ("exact", "rounding"), cell
    assert cell.max_rel is None or cell.max_rel < 1e-5, cell


def test_reversible_layers_are_refused_rather_than_left_untouched():
    """Reformer runs its layers without autograd and recomputes them itself: a treatment would do
    nothing (the zoo sweep saw the same op count as untouched), so it is refused."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "ReformerModelWithLMHead"):
        pytest.skip("transformers has no Reformer")
    config = transformers.ReformerConfig(vocab_size=256, hidden_size=32, num_attention_heads=2,
                                         attention_head_size=16, feed_forward_size=64, axial_pos_embds=False,
                                         attn_layers=["local", "local"], is_decoder=True)
    model = transformers.ReformerModelWithLMHead(config).train()
    with pytest.raises(ValueError, match="reversible layer"):
        remat.apply(model, "full")
    assert not any("_remat_patches" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("spec", ["full", "selective", "segments:2", "attention"])
def test_state_kept_in_plain_attributes_is_restored_for_the_recompute(spec):
    """RecurrentGemma keeps its recurrent and convolution states in plain module attributes, which
    its next call starts from: recomputed, a block began from the forward's final state (a
    CheckpointError on tensor shapes); it must begin from the state its forward began from."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "RecurrentGemmaForCausalLM"):
        pytest.skip("transformers has no RecurrentGemma")
    config = transformers.RecurrentGemmaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                               head_dim=16, lru_width=64)
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    oracle.check(model, reference, ids)


@pytest.mark.parametrize("name", ["longt5", "swinv2", "focalnet", "recurrent_gemma"])
def test_plans_where_the_profile_used_to_crash(name):
    """LongT5's and Swin-V2's blocks write into a kept matmul output in place (selective is left out
    of their profile, not a crash); Swin-V2's and FocalNet's blocks return their output dimensions
    beside the hidden state, which the model reads (the head's stubs hand them back);
    RecurrentGemma's blocks keep their state in attributes (each profiling run starts from the
    state the block had) and it soft-caps its logits under another name than Gemma's (the chunked
    head reproduces it). The plan of the smallest peak is then applied and trained."""
    registry_zoo = pytest.importorskip("registry_zoo")
    import registry_cells
    try:
        case = registry_zoo.case(name)
    except (KeyError, zoo.Unavailable) as reason:
        pytest.skip(str(reason))
    cell = registry_cells.run_plan_cell(case)
    assert cell.verdict in ("exact", "rounding"), cell
