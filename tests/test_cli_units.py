"""Budgets and sizes: one parser for every budget (CLI and API), one formatter for every size."""
import pytest

from remat.units import MAX_BUDGET_BYTES, format_size, parse_budget, parse_size


@pytest.mark.parametrize("value, expected", [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), (1024, 1024),
                                             ("1.5 TiB", int(1.5 * 2**40)), (64 * 2**40, 64 * 2**40)])
def test_budgets_people_write_are_read(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value, match", [
    ("-5GiB", "negative"), (-1, "negative"), (0, "more than 0"), ("0GiB", "more than 0"),
    (float("inf"), "finite"), (float("nan"), "finite"), ("1e400", "finite"),
    ("1e30GiB", "64.00 TiB"), (1e30, "64.00 TiB"), (MAX_BUDGET_BYTES + 1, "larger than any device"),
    ("24G", "ambiguous"), ("lots", "cannot read"),
])
def test_absurd_budgets_are_refused_with_what_to_pass(value, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_budget(value)
    assert "24GiB" in str(info.value)  # every refusal shows what a budget looks like


def test_a_bool_is_not_a_budget():
    with pytest.raises(TypeError, match="bool"):
        parse_budget(True)


def test_parse_size_refuses_infinity_with_a_value_error_not_an_overflow():
    for value in (float("inf"), "1e999MiB"):
        with pytest.raises(ValueError, match="finite"):
            parse_size(value)


@pytest.mark.parametrize("n, text", [(512, "512 B"), (8 * 2**20, "8.00 MiB"), (3_495_000, "3.33 MiB"),
                                     (1.5 * 2**30, "1.50 GiB"), (3 * 2**50, "3.00 PiB")])
def test_format_size_picks_the_unit_that_fits(n, text):
    assert format_size(n) == text
