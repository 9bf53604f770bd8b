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
