"""Byte sizes as people write them: ``"24GiB"``, ``"80GB"``, ``"1.5 TiB"``, ``25769803776``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
of 1000, as the SI and IEC define them; ``torch.cuda`` reports binary bytes and vendors
sell decimal ones, so both occur. A bare ``"24G"`` is refused rather than guessed: a
planner that silently reads 24 GB as 24 GiB is 7% off its budget.

:func:`parse_size` reads any size; :func:`parse_budget` is the one check every memory
budget goes through (the CLI's ``--budget`` and the Python API alike): it also refuses
zero, negative and non-finite budgets and anything above :data:`MAX_BUDGET_BYTES`, since
a budget is the memory of one device and a typo such as ``1e30`` would otherwise be
planned for as if it were real. :func:`format_size` is the one way remat prints bytes.
"""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "B": 1,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_PATTERN = re.compile(r"^\s*([+-]?)([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

MAX_BUDGET_BYTES = 64 * 2**40
"""The largest budget :func:`parse_budget` accepts: 64 TiB, far above the memory of any one
accelerator (an H200 has 141 GB), so that only typos are refused."""


def parse_size(value) -> int:
    """Bytes from an int, a float or a string such as ``"24GiB"``; ValueError if unclear.

    Negative and non-finite sizes are refused (ValueError), bools and other types too
    (TypeError).
    """
    if isinstance(value, bool):
        raise TypeError("a size must be a number of bytes or a string like '24GiB', got a bool")
    if isinstance(value, (int, float)):
        number = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(3).upper() if match else None
        if match is None or unit not in _UNITS:
            hint = ""
            if unit in ("K", "M", "G", "T"):
                hint = f" ('{unit}' is ambiguous: write {unit}iB for powers of 1024 or {unit}B for powers of 1000)"
            raise ValueError(f"cannot read size {value!r}{hint}; expected a number with a unit such as "
                             "'24GiB', '80GB', '512MiB', or a plain number of bytes")
        number = float(match.group(1) + match.group(2)) * _UNITS[unit]
    else:
        raise TypeError(f"a size must be a number of bytes or a string like '24GiB', "
                        f"got {type(value).__name__}")
    if not math.isfinite(number):
        raise ValueError(f"a size must be a finite number of bytes, got {value!r}; "
                         "pass a number with a unit such as '24GiB'")
    if number < 0:
        raise ValueError(f"a size must be non-negative, got {value!r}; pass a number with a unit such as '24GiB'")
    return int(number)


def parse_budget(value) -> int:
    """Bytes of a peak-memory budget for one device: :func:`parse_size`, then a sanity check.

    Refused with a ValueError that says what to pass instead: zero, negative, infinite or
    NaN budgets, and budgets above :data:`MAX_BUDGET_BYTES` (64 TiB).
    """
    try:
        n = parse_size(value)
    except ValueError as e:
        raise ValueError(f"cannot use {value!r} as a memory budget: {e}") from None
    if n <= 0:
        raise ValueError(f"a memory budget must be more than 0 bytes, got {value!r}; pass the peak memory "
                         "one device may use, such as '24GiB' or '80GB'")
    if n > MAX_BUDGET_BYTES:
        raise ValueError(f"a memory budget of {value!r} is more than {format_size(MAX_BUDGET_BYTES)}, larger than "
                         "any device's memory; pass the peak memory one device may use, such as '24GiB' "
                         "or '80GB' (with FSDP, the memory of one rank)")
    return n


def format_size(n: float) -> str:
    """``27.60 GiB``-style text for a byte count, in the largest binary unit it fills.

    Binary units, as torch.cuda reports: ``8388608`` is ``8.00 MiB``, ``3_500_000`` is
    ``3.34 MiB``, ``512`` is ``512 B``.
    """
    n = float(n)
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
