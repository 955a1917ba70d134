"""Numbers as the bench's tables and the report's charts write them: sizes and figures.

Pure functions, any thread; a leaf (the standard library only), shared by :mod:`.bench` and
:mod:`.report`, which each import it and not each other.
"""

from __future__ import annotations


def format_size(nbytes: int) -> str:
    """4096 -> "4KiB", 16777216 -> "16MiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def fmt(value: float) -> str:
    """About three significant digits, no exponent."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
