"""Byte counts for people: B, kB, MB, GB, TB, PB (decimal)."""

from __future__ import annotations

import math

import pytest

from moeexp.units import byte_unit, format_bytes, format_bytes_interval


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (512, "512 B"), (999.5, "999.50 B"), (1000, "1.00 kB"),
    (28_110_000, "28.11 MB"), (1.2e9, "1.20 GB"),
    (36_946_062.01e6, "36.95 TB"),  # issue 29: printed "36,946,062.01 MB" before
    (2.5e15, "2.50 PB"), (5e18, "5,000.00 PB"), (-3e9, "-3.00 GB"),
    (None, "-"), (math.nan, "-"), (math.inf, "-"),
])
def test_format_bytes(n, text) -> None:
    assert format_bytes(n) == text


def test_forced_unit_and_interval() -> None:
    assert byte_unit(999) == ("B", 1.0) and byte_unit(1e12) == ("TB", 1e12)
    assert format_bytes(2.5e9, ("MB", 1e6)) == "2,500.00 MB"
    assert format_bytes_interval(3.6946e13, 1.2e11) == "36.95 ± 0.12 TB"  # the mean's unit
    assert format_bytes_interval(2.8e7, math.nan) == "28.00 MB"
    assert format_bytes_interval(math.nan, 1.0) == "-"
