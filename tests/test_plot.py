"""The frontier plot reads at a glance (issue 45): the names users know, units on budgets, and no label
over another label, a marker or the axes' edge, on the records the README's plots are drawn from."""
import importlib.util
import json
import os

import pytest

from remat.prove import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _plots():
    spec = importlib.util.spec_from_file_location("plots", os.path.join(ROOT, "benchmarks", "plots.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("strategy, name", [
    ("hf_full", "HF gradient checkpointing"), ("sac", "HF + op-level SAC"), ("every2", "checkpoint every 2nd layer"),
    ("compile_0.5", "torch.compile, memory budget 0.5"), ("compile_1", "torch.compile"),
    ("remat@10GiB", "10 GiB plan"), ("remat+compile@24.5GiB", "24.5 GiB plan"),
    ("remat:full+chunked", "remat full + chunked head"), ("remat:keep+chunked", "remat chunked head only"),
    ("something new", "something new"),
])
def test_strategies_are_shown_by_the_names_users_know(strategy, name):
    assert plot.display_name(strategy) == name


def _drawn(records, **kwargs):
    pytest.importorskip("matplotlib")
    figure, labels = plot.draw(records, **kwargs)
    return figure, labels, plot.overlaps(figure, labels, [text.xy for text in labels])


def test_the_headline_plot_has_no_label_over_another_and_its_budgets_have_units():
    records, title, note = _plots().headline_records()
    figure, labels, found = _drawn(records, title=title, note=note)
    assert found == []
    texts = [t.get_text() for t in labels]
    assert "HF gradient checkpointing 0.81x" in texts and "torch.compile, memory budget 0.5 0.93x" in texts
    assert "10 GiB plan 1.14x" in texts and "10 GiB plan 0.85x" in texts  # compiled beside eager
    budgets = [t.get_text() for t in figure.axes[0].child_axes[0].get_xticklabels()]
    assert budgets == ["10 GiB", "16 GiB", "25 GiB", "32 GiB", "45 GiB"]


@pytest.mark.parametrize("folder", ["issue11/h200_frontier", "issue11/h100_frontier/compiled_mask_skip"])
def test_the_frontiers_the_readme_quotes_have_no_overlapping_labels(folder):
    with open(os.path.join(RESULTS, folder, "frontier.json")) as f:
        records = json.load(f)["records"]
    assert _drawn(records)[2] == []


def test_a_crowded_cluster_is_still_placed_apart():
    """Eight rows within 0.3 GiB and 0.5% of each other: every label finds room of its own."""
    records = [dict(strategy=f"remat@{10 + i}GiB", kind="remat", status="ok", peak_bytes=int((30 + 0.04 * i) * 2**30),
                    vs_eager=1.0 + 0.001 * i, tokens_per_s=1000.0, budget_bytes=(10 + i) * 2**30) for i in range(8)]
    records.append(dict(strategy="eager", kind="anchor", status="ok", peak_bytes=50 * 2**30, tokens_per_s=1000.0))
    assert _drawn(records)[2] == []
