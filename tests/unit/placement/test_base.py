"""The placement registry and :func:`device_map`'s checks."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.placement import PLACEMENTS, Placement, device_map


def test_registry_holds_the_yaml_names_and_suggests_close_ones() -> None:
    assert {"round_robin", "contiguous"} <= set(PLACEMENTS.names())
    with pytest.raises(ConfigError, match="round_robin"):
        PLACEMENTS.build("round_robbin")


class _Bad(Placement):
    name = "bad"

    def assign(self, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
        return np.full((num_layers, num_experts), devices)  # one past the last device


@pytest.mark.parametrize("devices", [0, -1, 1.5, True])
def test_devices_below_one_or_not_an_int_are_refused(devices: object) -> None:
    with pytest.raises(ConfigError, match="hardware.devices must be an integer >= 1"):
        device_map(PLACEMENTS.build("round_robin"), 2, 2, devices)  # type: ignore[arg-type]


def test_a_device_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="outside 0..1"):
        device_map(_Bad(), 2, 2, 2)
