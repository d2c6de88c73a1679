"""``round_robin``: the FineMoE artifact's flat layer x expert dealing."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.placement import PLACEMENTS, device_map


def test_experts_are_dealt_in_flat_layer_expert_order() -> None:
    """L=2, J=3 over 2 devices: flat order 0..5 -> devices 0 1 0 1 0 1, so layer 1 starts
    on device 1 (the count runs on across layers, it does not restart per layer)."""
    got = device_map(PLACEMENTS.build("round_robin"), 2, 3, 2)
    assert got.tolist() == [[0, 1, 0], [1, 0, 1]]


def test_start_device_offsets_the_deal() -> None:
    got = device_map(PLACEMENTS.build("round_robin", start_device=2), 1, 4, 3)
    assert got.tolist() == [[2, 0, 1, 2]]


def test_one_device_holds_everything() -> None:
    assert not device_map(PLACEMENTS.build("round_robin"), 4, 8, 1).any()


def test_every_device_holds_an_equal_share_within_one() -> None:
    counts = np.bincount(device_map(PLACEMENTS.build("round_robin"), 24, 60, 6).ravel())
    assert counts.tolist() == [240] * 6


def test_a_negative_start_is_refused() -> None:
    with pytest.raises(ConfigError, match="start_device"):
        PLACEMENTS.build("round_robin", start_device=-1)
