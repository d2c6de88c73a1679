"""``contiguous``: whole consecutive layers per device."""

from __future__ import annotations

from moeexp.placement import PLACEMENTS, device_map


def test_layers_split_into_blocks_first_blocks_longer() -> None:
    """L=5 over 2 devices: layers 0-2 on device 0, 3-4 on device 1, all experts of a layer
    together."""
    got = device_map(PLACEMENTS.build("contiguous"), 5, 2, 2)
    assert got.tolist() == [[0, 0], [0, 0], [0, 0], [1, 1], [1, 1]]


def test_more_devices_than_layers_leaves_the_last_ones_empty() -> None:
    got = device_map(PLACEMENTS.build("contiguous"), 2, 3, 3)
    assert got.tolist() == [[0, 0, 0], [1, 1, 1]]
