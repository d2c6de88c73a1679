"""Capacity -> slots: the simulator's converter, and errors before anything moves."""

from __future__ import annotations

import pytest

from moeexp.engine.budget import make_budget
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

DIMS = TraceDims(num_layers=4, num_experts=8, top_k=2, hidden_size=16, spec_depth=0,
                 expert_bytes=1000)


def test_fraction_bytes_and_strings() -> None:
    """0.25 of 32 experts = 8 slots; 5000 bytes = 5 slots; "3KB" = 3 slots; 1.0 = all 32."""
    assert make_budget(0.25, DIMS).slots == 8
    assert make_budget(5000, DIMS).slots == 5
    assert make_budget("3KB", DIMS).slots == 3
    b = make_budget(1.0, DIMS)
    assert (b.slots, b.budget_bytes, b.total_expert_bytes) == (32, 32000, 32000)


def test_below_top_k_is_an_error() -> None:
    """1999 bytes buy one slot, fewer than top-k=2: refused, naming the valid forms."""
    with pytest.raises(ConfigError, match="top"):
        make_budget(1999, DIMS)
    with pytest.raises(ConfigError):
        make_budget("lots", DIMS)
