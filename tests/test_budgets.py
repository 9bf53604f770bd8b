"""Budgets are checked where users give them (issue 14): the Python API refuses what the CLI
refuses — zero, negative, non-finite and absurd budgets — before the model is profiled."""
import math

import pytest
import torch

import remat


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("budget", ["1e30", "1e30GiB", 1e30, math.inf, float("nan"), -1, 0, "-5GiB", "24G"])
def test_plan_refuses_bad_budgets_before_profiling(budget, monkeypatch):
    import remat.planner
    profiled = []
    monkeypatch.setattr(remat.planner, "_profile", lambda *a, **k: profiled.append(1))
    with pytest.raises(ValueError):
        remat.plan(_llama(), torch.zeros(1, 8, dtype=torch.long), budget)
    assert profiled == []


def test_solve_refuses_absurd_budgets():
    from remat.planning.solver import solve
    with pytest.raises(ValueError, match="larger than any device"):
        solve(None, "1e30GiB")
