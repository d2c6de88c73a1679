"""Topology settings, budgets per device, one policy per device
(:mod:`moeexp.simulator.topology`)."""

from __future__ import annotations

import pytest
from tests.unit.simulator.simhelpers import hand_trace

from moeexp.errors import ConfigError
from moeexp.simulator.topology import Topology, build_device_caches, device_slots

DIMS = hand_trace([[[[[0, 1], [2, 3]]]]], 4).dims  # L=2, J=4, K=2, 1 GB experts


@pytest.mark.parametrize("kw, match", [
    ({"devices": 0}, "hardware.devices must be an integer >= 1"),
    ({"devices": 2.0}, "hardware.devices must be an integer >= 1"),
    ({"demand_concurrency": "parallel"}, "valid: single, per_device"),
    ({"budget": "each"}, "valid: total, per_device"),
])
def test_bad_settings_are_refused_naming_the_valid_values(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Topology(**kw)


def test_an_unknown_placement_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="contiguous, pinned, round_robin"):
        Topology.build(devices=2, placement={"name": "random"})
    with pytest.raises(ConfigError, match="start_device"):
        Topology.build(devices=2, placement={"name": "round_robin", "start_devic": 1})


def test_a_total_budget_is_split_evenly_the_remainder_to_the_first_devices() -> None:
    """5 slots over 2 devices holding 4 experts each: 3 + 2."""
    topo = Topology(devices=2)
    assert device_slots(topo, 5, topo.device_map(2, 4)) == [3, 2]


def test_a_per_device_budget_gives_each_device_the_capacity_capped_at_its_experts() -> None:
    topo = Topology(devices=2, budget="per_device")
    assert device_slots(topo, 3, topo.device_map(2, 4)) == [3, 3]
    assert device_slots(topo, 9, topo.device_map(2, 4)) == [4, 4]


def test_a_device_left_without_a_slot_is_refused() -> None:
    """2 slots over 3 devices that all hold experts: device 2 could never load one."""
    topo = Topology(devices=3)
    with pytest.raises(ConfigError, match=r"device\(s\) 2 without a slot"):
        device_slots(topo, 2, topo.device_map(2, 4))


def test_build_device_caches_gives_one_policy_per_device_with_its_slots() -> None:
    """capacity 0.75 of 8 experts = 6 slots, total over 2 devices: 3 each."""
    caches = build_device_caches({"name": "lru", "capacity": 0.75}, DIMS, Topology(devices=2))
    assert [c.capacity_slots for c in caches] == [3, 3] and caches[0] is not caches[1]
