"""remat.planning.records: a plan resolved once into per-block records, and treat/ reading only their fields."""
import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import remat
from remat.planning.costs import DERIVED, MEASURED_TREATMENTS
from remat.planning.plans import OFFLOADING_TREATMENTS, TABLE, TILED_TREATMENTS, TREATMENTS, Plan, resolve, variant
from remat.planning.records import BlockRecord, block_record, block_records

SRC = Path(__file__).resolve().parent.parent / "src" / "remat"


def test_each_decision_in_a_treatment_name_is_a_field():
    assert block_record("full+offload+tiled", tile_tokens=512) == BlockRecord(
        treatment="full+offload+tiled", checkpoint=True, offload=True, tiled=True, tile_tokens=512)
    assert block_record("attn-saved+offload") == BlockRecord(treatment="attn-saved+offload", checkpoint=True,
                                                             keeps="attention", offload=True)
    assert block_record("selective").keeps == "matmuls" and block_record("mlp").submodule == "mlp"
    assert block_record("tiled") == BlockRecord(treatment="tiled", tiled=True)
    assert block_record("keep") == BlockRecord(treatment="keep")
    assert block_record("selective", tile_tokens=512).tile_tokens is None
    assert block_record("segment:3") == BlockRecord(treatment="segment:3", checkpoint=True, segment=3,
                                                    segment_size=1)
    with pytest.raises(ValueError, match="unknown treatment 'fulll'.*segment:<i>"):
        block_record("fulll")
    with pytest.raises(ValueError, match="unknown treatment"):
        block_record(["full"])


def test_one_table_says_what_each_treatment_decides():
    """The plan's lists, the records and the profile's measured and derived treatments all follow from TABLE."""
    assert TREATMENTS == tuple(TABLE) and len(set(TABLE.values())) == len(TABLE)  # no two names for one treatment
    for name, row in TABLE.items():
        record = block_record(name)
        assert {f: getattr(record, f) for f in vars(row)} == vars(row), name
        assert (name in OFFLOADING_TREATMENTS, name in TILED_TREATMENTS) == (row.offload, row.tiled)
    assert set(MEASURED_TREATMENTS) | set(DERIVED) == set(TREATMENTS) and not set(MEASURED_TREATMENTS) & set(DERIVED)
    assert DERIVED["full+offload+tiled"] == "full+tiled" and DERIVED["offload"] == "keep"
    assert all(base in MEASURED_TREATMENTS and replace(TABLE[name], offload=False) == TABLE[base]
               for name, base in DERIVED.items())
    assert variant("full", offload=True, tiled=True) == "full+offload+tiled" and variant("mlp", offload=True) is None


def _treatment_names_compared(function: ast.FunctionDef) -> list:
    """The string constants ``function`` compares anything with (``x == "full"``, ``x in ("a", "b")``)."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return found


def test_treat_dispatches_on_the_records_fields_not_on_names():
    tree = ast.parse((SRC / "treat" / "treatments.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name in ("_treated_forward", "apply_treatment", "check_treatment"):
        assert _treatment_names_compared(functions[name]) == [], name


def test_a_plan_becomes_one_record_per_block_with_its_segments_numbered():
    names = [f"layers.{i}" for i in range(5)]
    plan = resolve("segments:2", names)
    records = block_records(plan, names)
    assert [(r.name, r.index, r.segment, r.position, r.segment_size) for r in records] == [
        ("layers.0", 0, 0, 0, 2), ("layers.1", 1, 0, 1, 2), ("layers.2", 2, 1, 0, 2), ("layers.3", 3, 1, 1, 2),
        ("layers.4", 4, 2, 0, 1)]
    mixed = block_records(Plan({"layers.1": "full+tiled"}, tile_tokens=64), names)
    assert [r.treatment for r in mixed] == ["keep", "full+tiled", "keep", "keep", "keep"]
    assert mixed[1].tile_tokens == 64 and mixed[1].checkpoint and mixed[1].tiled


def test_treat_never_asks_planning_what_a_name_means():
    """``remat.treat`` imports nothing of ``remat.planning``: the records carry every decision."""
    for path in (SRC / "treat").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("remat.planning"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("remat.planning") for a in node.names), path.name


def test_apply_treats_by_the_records_and_reports_the_plans_names():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2))
    remat.apply(model, {"model.layers.0": "segment:0", "model.layers.1": "segment:0", "model.layers.2": "mlp",
                        "model.layers.3": "full+tiled"}, tile_tokens=8)
    assert list(remat.api.treatments(model).values()) == ["segment:0", "segment:0", "mlp", "full+tiled"]
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
