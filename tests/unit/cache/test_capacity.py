"""``capacity_slots``: fractions, bytes and size strings -> expert slots, with clear errors."""

from __future__ import annotations

import pytest

from moeexp.cache.capacity import capacity_slots
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

# L=4, J=8: 32 experts of 1 MiB (32 MiB in all), top-2
DIMS = TraceDims(num_layers=4, num_experts=8, top_k=2, hidden_size=16, spec_depth=0,
                 expert_bytes=2**20)


@pytest.mark.parametrize(("spec", "slots"), [
    (0.25, 8),            # a quarter of 32 experts
    (1.0, 32),            # everything
    (0.3, 9),             # floor(9.6)
    (2**22, 4),           # int bytes: 4 MiB / 1 MiB
    (2**22 + 5, 4),       # partial slot ignored
    (2**40, 32),          # more than every expert: capped
    ("0.5", 16),          # fraction as a string
    ("25%", 8),           # percentage
    ("4MiB", 4),          # binary unit
    ("4 mib", 4),         # case and spaces
    ("5MB", 4),           # decimal unit: 5e6 / 2**20 = 4.77
    ("8388608", 8),       # a string holding bytes
    (4194304.0, 4),       # YAML's 4.194304e6 is a float: whole numbers > 1 are bytes
])
def test_valid_forms(spec, slots) -> None:  # type: ignore[no-untyped-def]
    """Each form gives floor(bytes / expert_bytes) slots, capped at L*J."""
    assert capacity_slots(spec, DIMS) == slots


def test_below_top_k_names_the_minimum() -> None:
    """0.05 * 32 = 1 slot < K=2: the error says the slot size, K and the smallest capacity."""
    with pytest.raises(ConfigError) as e:
        capacity_slots(0.05, DIMS)
    msg = str(e.value)
    assert "1 expert slot" in msg and "top_k=2" in msg and str(2 * 2**20) in msg
    assert "Valid forms" in msg
    with pytest.raises(ConfigError, match="fewer than top_k=2"):
        capacity_slots("1.5 MiB", DIMS)  # 1 whole slot


def test_int_one_hints_at_fraction() -> None:
    """``capacity: 1`` is one byte; the message suggests 1.0."""
    with pytest.raises(ConfigError, match="did you mean 1.0"):
        capacity_slots(1, DIMS)


@pytest.mark.parametrize(("spec", "match"), [
    ("lots", "not understood"),
    ("2 parsecs", "unknown unit 'parsecs'"),
    ("3XB", "unknown unit"),
    (1.5, r"fraction must lie in \(0, 1\]"),
    (0.0, r"fraction must lie in \(0, 1\]"),
    (-5, "must be positive"),
    (True, "boolean"),
    ([1], "has type list"),
    ("150%", r"fraction must lie in \(0, 1\]"),
])
def test_errors_name_the_valid_forms(spec, match) -> None:  # type: ignore[no-untyped-def]
    """Unparsable strings, unknown units, out-of-range fractions, wrong types."""
    with pytest.raises(ConfigError, match=match) as e:
        capacity_slots(spec, DIMS)
    assert "Valid" in str(e.value)
