"""``resident``: every expert pinned (the no_offload system)."""

from __future__ import annotations

import pytest

from moeexp.cache import CACHES
from moeexp.errors import ConfigError


def test_holds_every_expert_whatever_the_capacity() -> None:
    """capacity_slots=3 is overridden to L*J = 8; all 8 keys are initial residents."""
    c = CACHES.build("resident", capacity_slots=3, num_layers=2, num_experts=4)
    assert c.capacity_slots == 8
    assert sorted(c.initial_residents()) == [(layer, e) for layer in range(2) for e in range(4)]


def test_never_evicts() -> None:
    """Filled with every expert, asking for a victim is an error; with room it is None."""
    c = CACHES.build("resident", capacity_slots=8, num_layers=2, num_experts=4)
    assert c.victim((0, 0), set(), 0) is None
    for k in c.initial_residents():
        c.on_insert(k, 0, prefetched=False)
    with pytest.raises(ConfigError, match="pinned"):
        c.victim((0, 0), set(), 0)
