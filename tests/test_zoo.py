"""The zoo (issue 10): every treatment on every zoo model is exact, and every zoo model plans.

Each case trains a treated model beside an untouched copy (same state_dict, same batch as
users give it, same seed before each forward) for two SGD steps in fp32 with dropout on, and
compares the loss, every parameter gradient and every buffer with ``torch.equal``. A
treatment for a sub-module the blocks do not have ("mlp" on BART) must be refused with a
ValueError naming it. The models keep their configs' defaults (``use_cache`` on, router
logits on): see DESIGN.md, "Test what users run". The checks live in :mod:`zoo`;
``benchmarks/zoo_table.py`` prints them as a table.
"""
import pytest

import zoo
from versions import TRANSFORMERS_4

CASE_NAMES = sorted(zoo.CASES)
# selective keeps matmul outputs; a block that then adds into one in place (Falcon's
# ``mlp_output += attention_output``, transformers 4.x T5's ``scores += position_bias``) would
# be recomputed wrong, so remat refuses it clearly
IN_PLACE_INTO_KEPT = {("falcon", "selective")} | ({("t5", "selective")} if TRANSFORMERS_4 else set())
# transformers 4.x MoE routing (nonzero) and BART's layer drop read tensor values: a fake-tensor
# profile stops with a clear error that says to profile on a GPU
VALUE_DEPENDENT = {"bart", "mixtral", "qwen2_moe", "qwen3_moe"} if TRANSFORMERS_4 else set()


def _run(check, *args):
    try:
        return check(*args)
    except zoo.Unavailable as reason:
        pytest.skip(str(reason))


@pytest.mark.parametrize("spec", zoo.TREATMENTS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_treatment_is_exact(name, spec):
    case = zoo.CASES[name]
    if (name, spec) in IN_PLACE_INTO_KEPT:
        with pytest.raises(ValueError, match="modifies in place"):
            _run(zoo.run_treatment, name, spec)
        return
    expected = "refused" if (spec == "attention" and not case.has_attention) or \
        (spec == "mlp" and not case.has_mlp) else "exact"
    assert _run(zoo.run_treatment, name, spec) == expected


@pytest.mark.parametrize("name", CASE_NAMES)
def test_plans_on_fake_tensors(name):
    if name in VALUE_DEPENDENT:
        with pytest.raises(ValueError, match="depends on tensor values.*Profile on a GPU"):
            _run(zoo.run_plan, name)
        return
    _run(zoo.run_plan, name)
