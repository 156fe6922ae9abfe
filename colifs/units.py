"""Sizes as people write and read them: `200G` in, `1.50 GiB` out."""

from __future__ import annotations

import re

from colifs.errors import UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`200G`, `1.5T`, `500M` (powers of 1024, like truncate(1)); `200GB` powers of 1000; bytes."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"size {text!r}: expected a number with an optional K, M, G, T or P suffix")
    number, unit, tail = float(m.group(1)), m.group(2).upper(), m.group(3).upper()
    power = "KMGTP".index(unit) + 1 if unit else 0
    base = 1000 if tail == "B" and power else 1024
    return int(number * base**power)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
