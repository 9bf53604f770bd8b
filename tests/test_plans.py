"""Plans: specs, JSON round trip, clear errors."""
import json

import pytest

import remat
from remat.planning.plans import PLAN_VERSION, Plan, resolve

NAMES = [f"model.layers.{i}" for i in range(5)]


def test_specs():
    assert set(resolve("selective", NAMES).blocks.values()) == {"selective"}
    every = resolve("every:2", NAMES).blocks
    assert [every[n] for n in NAMES] == ["full", "keep", "full", "keep", "full"]
    first = resolve("first:2:offload", NAMES).blocks
    assert [first[n] for n in NAMES] == ["offload", "offload", "keep", "keep", "keep"]


@pytest.mark.parametrize("spec", ["every:0", "every:x", "fast", "first:2:nope", "every"])
def test_bad_specs_say_what_is_accepted(spec):
    with pytest.raises(ValueError, match="every:N"):
        resolve(spec, NAMES)


def test_plan_for_another_model_is_refused():
    with pytest.raises(ValueError, match="another model"):
        resolve(Plan({"transformer.h.0": "full"}), NAMES)


def test_save_load_round_trip(tmp_path):
    plan = Plan({NAMES[0]: "full", NAMES[1]: "offload"}, head="chunked", chunk_tokens=1024,
                notes={"predicted_peak_bytes": 123})
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert json.loads(path.read_text())["version"] == PLAN_VERSION
    assert remat.Plan.load(str(path)) == plan


def test_load_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(str(bad))
    bad.write_text(json.dumps({"version": 99, "blocks": {}}))
    with pytest.raises(ValueError, match="version 99"):
        Plan.load(str(bad))
    with pytest.raises(ValueError, match="unknown treatments"):
        Plan({"a": "recompute-everything"})


def test_plan_is_immutable():
    plan = Plan({"a": "full"})
    with pytest.raises(TypeError):
        plan.blocks["a"] = "keep"


@pytest.mark.parametrize("field, value, match", [
    ("chunk_tokens", "abc", r"'chunk_tokens' must be a positive integer.*got 'abc' \(str\)"),
    ("chunk_tokens", 0, r"'chunk_tokens' must be a positive integer.*got 0 \(int\)"),
    ("chunk_tokens", True, r"'chunk_tokens' must be a positive integer.*got True \(bool\)"),
    ("chunk_tokens", 2.5, r"'chunk_tokens' must be a positive integer.*got 2.5 \(float\)"),
    ("blocks", ["model.layers.0"], r"'blocks' must be a mapping of block name to treatment.*got a list"),
    ("blocks", {"model.layers.0": "recompute"}, r"unknown treatments.*one of keep, full"),
    ("head", "fused", r"'head' must be a head mode \(a string\), one of plain, chunked, liger; got 'fused'"),
    ("head", 3, r"'head' must be a head mode \(a string\).*got 3 \(int\)"),
    ("notes", [], r"'notes' must be a mapping"),
    ("chunk", 1024, r"unknown fields \['chunk'\]"),
])
def test_a_bad_field_in_a_plan_file_is_named_with_its_type_and_the_file(tmp_path, field, value, match):
    data = Plan({NAMES[0]: "full"}, head="chunked", chunk_tokens=1024).to_dict()
    data[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as info:
        Plan.load(str(path))
    assert str(info.value).startswith(f"{path}: ")


def test_a_plan_file_that_is_not_an_object_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match=f"{path} is not a remat plan.*got a JSON list"):
        Plan.load(str(path))


@pytest.mark.parametrize("chunk_tokens", [0, False, 2.5, -4, "1024"])
def test_chunk_tokens_is_never_silently_the_default(chunk_tokens):
    with pytest.raises(ValueError, match="'chunk_tokens' must be a positive integer, or None"):
        Plan({}, head="chunked", chunk_tokens=chunk_tokens)


def test_chunk_tokens_from_numpy_is_a_plain_int():
    np = pytest.importorskip("numpy")
    plan = Plan({}, head="chunked", chunk_tokens=np.int64(2048))
    assert plan.chunk_tokens == 2048 and type(plan.chunk_tokens) is int
    json.dumps(plan.to_dict())


@pytest.mark.parametrize("spec, match", [
    ("every:0", "N must be a whole number >= 1, got '0'"), ("every:x", "got 'x'"),
    ("fast", "'fast' is neither a treatment nor 'every'/'first'"),
    ("first:2:nope", "unknown treatment 'nope'"), ("every", "got ''"),
])
def test_spec_errors_say_which_part_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve(spec, NAMES)
