"""Byte sizes as people write them: ``"24GiB"``, ``"80GB"``, ``"1.5 TiB"``, ``25769803776``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
of 1000, as the SI and IEC define them; ``torch.cuda`` reports binary bytes and vendors
sell decimal ones, so both occur. A bare ``"24G"`` is refused rather than guessed: a
planner that silently reads 24 GB as 24 GiB is 7% off its budget.
"""
from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value) -> int:
    """Bytes from an int, a float or a string such as ``"24GiB"``; ValueError if unclear."""
    if isinstance(value, bool):
        raise TypeError("a size must be a number of bytes or a string like '24GiB', got a bool")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ValueError(f"a size must be a non-negative number of bytes, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"a size must be a number of bytes or a string like '24GiB', "
                        f"got {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        hint = ""
        if unit in ("K", "M", "G", "T"):
            hint = f" ('{unit}' is ambiguous: write {unit}iB for powers of 1024 or {unit}B for powers of 1000)"
        raise ValueError(f"cannot read size {value!r}{hint}; expected a number with a unit such as "
                         "'24GiB', '80GB', '512MiB', or a plain number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """``27.6 GiB``-style text for a byte count (binary units, as torch.cuda reports)."""
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
