"""The planning layer is pure: numbers in, plan out, without torch, a model or the layers below it."""
import dataclasses
import json
import pkgutil
import subprocess
import sys

import pytest

import remat.planning
from remat.planning.costs import BlockCost, HeadCost, Profile, Rates
from remat.planning.offload_model import EngineModel


def test_planning_imports_no_torch_treat_offload_or_profiling():
    names = sorted(f"remat.planning.{m.name}" for m in pkgutil.iter_modules(remat.planning.__path__))
    assert {"remat.planning.solver", "remat.planning.simulator", "remat.planning.costs"} <= set(names)
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    forbidden = ("torch", "transformers", "remat.treat", "remat.offload", "remat.profiling")
    assert [m for m in loaded if m in forbidden or m.startswith(tuple(f + "." for f in forbidden))] == []


def test_planning_defaults_are_the_offload_engines():
    from remat.profiling.profiler import engine_model
    assert engine_model() == EngineModel()


@pytest.mark.parametrize("record", [BlockCost, HeadCost, Profile, Rates, EngineModel])
def test_records_are_built_by_keyword_only(record):
    fields = dataclasses.fields(record)
    assert all(f.kw_only for f in fields)
    with pytest.raises(TypeError):
        record(*range(len(fields)))


def test_profile_round_trips_through_to_dict_as_json():
    from remat.planning.costs import rates_for
    cost = BlockCost(fwd_peak=3, kept=2, out_alive=1, out_bytes=1, saves_input=False, bwd_peak=4, bwd_end=2,
                     fwd_s=1e-3, bwd_s=2e-3)
    head = HeadCost(mode="plain", chunk_tokens=None, pre_peak=1, pre_end=1, head_fwd_peak=5, head_fwd_end=2,
                    head_bwd_peak=6, head_bwd_end=2, pre_bwd_peak=3, pre_bwd_end=1, pre_fwd_s=0.0,
                    head_fwd_s=1e-3, head_bwd_s=1e-3, pre_bwd_s=0.0)
    prof = Profile(model="m", block_names=("b0",), block_class=(0,), classes=({"keep": cost},), heads=(head,),
                   param_bytes=8, buffer_bytes=0, optimizer="none", optimizer_bytes=0, static_bytes=8,
                   hidden_bytes=1, batch=1, seq=1, dtype="bfloat16", device="fake", rates=rates_for("h100"))
    data = json.loads(json.dumps(prof.to_dict()))
    assert data["classes"][0]["keep"]["kept"] == 2 and data["engine"] == dataclasses.asdict(EngineModel())
