"""The registry zoo's fast subset (issue 29): one model type per head family, built from the registry.

``make zoo`` (``benchmarks/zoo_sweep.py``) runs every model type transformers maps to a training
head through every treatment; this runs the same builders and checks on one type of each family
that ``tests/zoo.py`` does not hand-write, so that the generic shrinker (:mod:`registry_configs`)
and the batch builders (:mod:`registry_zoo`) are tested on every ``make test``: a treatment with
the plain head is bitwise exact, with the chunked head within fp32 rounding (or refused where
the model has no LM head), and the plan of the smallest peak applies and trains exactly.
"""
import pytest
import torch

import registry_cells as cells
import registry_configs as rc
import registry_zoo as rz
import zoo

# one per family, none of them in tests/zoo.py: MoE causal LM (dense first layer, then MoE),
# masked LM whose embeddings are narrower than its layers, encoder-decoder with sinusoidal
# positions, CNN classifier of stages, a Qwen-style VLM (flattened patches, M-RoPE) and a
# LLaVA-style one (image tokens counted from its own vision tower)
FAST = {"deepseek_v3": "causal_lm", "electra": "masked_lm", "pegasus": "seq2seq",
        "convnext": "image_classification", "qwen2_vl": "vlm", "llava": "vlm"}


def _case(model_type):
    case = rz.case(model_type)
    try:
        rz.check_built(case)
    except rz.NotBuilt as reason:
        pytest.fail(f"{model_type} no longer builds: {reason}")
    return case


def test_registry_maps_every_head_family():
    entries = rz.registry()
    assert {entry.head for entry in entries.values()} == {head for head, _ in rz.HEAD_ORDER}
    for model_type, head in FAST.items():
        assert entries[model_type].head == head, model_type
    assert entries["bert"].head == "masked_lm" and entries["gemma3"].head == "vlm"  # the preferred head


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_shrunk_model_is_tiny(model_type):
    model = zoo.build(_case(model_type))
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    config = model.config
    assert all(getattr(node, "vocab_size", 0) in (0, None) or node.vocab_size <= rc.VOCAB for node in rc._tree(config))
    assert all(i < rc.VOCAB for i in rc.special_ids(config) if i >= 0)


def test_layer_kinds_survive_shrinking():
    from transformers import AutoConfig
    gemma = AutoConfig.for_model("gemma3_text")  # five sliding layers, then a full one
    rc.shrink(gemma)
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.num_hidden_layers == 2
    jamba = AutoConfig.for_model("jamba")  # attention every 8th layer, experts every 2nd
    rc.shrink(jamba)
    kinds = {(jamba.layers_block_type[i], jamba.layers_num_experts[i]) for i in range(jamba.num_hidden_layers)}
    assert {kind for kind, _ in kinds} == {"mamba", "attention"} and {n > 1 for _, n in kinds} == {True, False}
    qwen = AutoConfig.for_model("qwen2_vl")  # M-RoPE sections sum to half the shrunk head
    rc.shrink(qwen)
    assert sum(qwen.text_config.rope_parameters["mrope_section"]) == rc.HEAD_DIM // 2


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_treatment_exact_and_chunked_head_within_rounding(model_type):
    case = _case(model_type)
    head = cells.run_cell(case, "keep", "chunked")
    if FAST[model_type] == "image_classification":
        assert head.verdict == "refused" and "no LM head" in head.detail
    else:
        assert head.verdict in ("exact", "rounding"), head
        assert head.max_rel <= cells.ROUNDING
    for spec in ("full", "offload"):
        plain = cells.run_cell(case, spec, "plain")
        assert plain.verdict == "exact", plain
        chunked = cells.run_cell(case, spec, "chunked")
        assert chunked.verdict == ("refused" if head.verdict == "refused" else chunked.verdict), chunked
        assert chunked.verdict in ("exact", "rounding", "refused"), chunked


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_tiled_within_rounding_and_run_in_chunks(model_type):
    """``full+tiled`` in chunks of 3 tokens: within fp32 rounding of the untouched model (its weight
    gradients are summed over chunks), every tiled sub-module run a chunk at a time (the cell's
    mechanism check), or refused in one line where a block has nothing token-wise (a CNN's stages)."""
    cell = cells.run_cell(_case(model_type), "full+tiled", "plain")
    if FAST[model_type] == "image_classification":
        assert cell.verdict == "refused" and "token-wise" in cell.detail, cell
    else:
        assert cell.verdict in ("exact", "rounding") and cell.max_rel <= cells.ROUNDING, cell


def test_a_tiled_cell_fails_when_nothing_is_cut_into_chunks(monkeypatch):
    """The mechanism check can fail: with chunks as long as the sequence, the tiled sub-modules run
    whole and the cell is a FAIL, although its gradients are right."""
    monkeypatch.setattr(cells, "TILE_TOKENS", 10_000)
    cell = cells.run_cell(_case("deepseek_v3"), "tiled", "plain")
    assert cell.verdict == "FAIL" and "did not run its sub-modules in chunks" in cell.detail, cell


def test_a_cell_beyond_fp32_rounding_is_judged_in_float64(monkeypatch):
    """With the fp32 bounds at 0, a tiled cell is run again in float64 and called rounding there (its
    differences fall to ~1e-15); with the float64 bound at 0 as well, the same cell is a FAIL."""
    case = _case("electra")
    monkeypatch.setattr(cells, "ROUNDING", 0.0)
    monkeypatch.setattr(cells, "ROUNDING_LATER", 0.0)
    cell = cells.run_cell(case, "tiled", "plain")
    assert cell.verdict == "rounding" and "in float64" in cell.detail, cell
    monkeypatch.setattr(cells, "FLOAT64_ROUNDING", 0.0)
    assert cells.run_cell(case, "tiled", "plain").verdict == "FAIL"


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_vl"])
def test_smallest_plan_applies_and_trains(model_type):
    cell = cells.run_plan_cell(_case(model_type))
    assert cell.verdict in ("exact", "rounding"), cell


def test_a_refusal_is_one_line_a_failure_is_not_a_refusal():
    case = rz.case("convnext")
    cell = cells.run_cell(case, "attention", "plain")  # a CNN's stages have no attention
    assert cell.verdict == "refused" and "\n" not in cell.detail and cell.detail.startswith("ValueError")
    broken = zoo.Case("broken", case.build, case.batch, lambda model, batch: torch.zeros(()))
    assert cells.run_cell(broken, "full", "plain").verdict == "FAIL"  # a loss with no graph: backward fails
