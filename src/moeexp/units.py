"""Byte counts for people: one formatter for every printed table and log line.

Decimal units, as the rest of the project (a GB is 10^9 bytes, :mod:`moeexp.analysis.memory_capacity`)::

    format_bytes(512)          '512 B'
    format_bytes(28_110_000)   '28.11 MB'
    format_bytes(3.69e13)      '36.95 TB'

The unit is the largest whose value is at least 1 (up to PB), with two decimals (bytes
below 1 kB print whole). :func:`format_bytes_interval` writes a mean and its interval
half-width in the mean's unit (``36.95 ± 0.12 TB``).
"""

from __future__ import annotations

import math

#: (unit, bytes per unit), largest first.
UNITS: tuple[tuple[str, float], ...] = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6),
                                        ("kB", 1e3), ("B", 1.0))


def byte_unit(n: float) -> tuple[str, float]:
    """(unit, bytes per unit) for showing ``n`` bytes: the largest unit with ``|n| >= 1``
    of it (bytes for ``|n| < 1000``)."""
    for unit, size in UNITS:
        if abs(n) >= size:
            return unit, size
    return "B", 1.0


def format_bytes(n: float | int | None, unit: tuple[str, float] | None = None) -> str:
    """``n`` bytes as ``'36.95 TB'`` (``'-'`` for None or NaN); ``unit``: force one
    ``(name, size)`` of :data:`UNITS` (default :func:`byte_unit`). Whole bytes print as
    integers."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "-"
    name, size = unit or byte_unit(float(n))
    if size == 1.0:
        return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"
    return f"{float(n) / size:,.2f} {name}"


def format_bytes_interval(mean: float, half: float) -> str:
    """``'36.95 ± 0.12 TB'``: ``mean`` bytes and the interval's half-width ``half`` in the
    mean's unit (``half`` NaN or None: the mean alone)."""
    if half is None or not math.isfinite(half):
        return format_bytes(mean)
    if mean is None or not math.isfinite(mean):
        return "-"
    name, size = byte_unit(float(mean))
    mean_text = format_bytes(mean, (name, size))
    value, unit_name = mean_text.rsplit(" ", 1)
    d = len(value.split(".")[1]) if "." in value else 0
    return f"{value} ± {half / size:,.{d}f} {unit_name}"
