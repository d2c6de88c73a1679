"""lru_per_layer: each layer evicts only among its own slots, least recently used first."""

from __future__ import annotations

import pytest

from moeexp.cache import CACHES
from moeexp.errors import ConfigError


def build(**kw):
    return CACHES.build("lru_per_layer", capacity_slots=4, num_layers=2, num_experts=4, **kw)


def test_never_evicts_across_layers() -> None:
    """2 slots per layer. Layer 1's experts are the oldest (t=0, 1); layer 0 holds (0,0)
    used at t=5 and (0,1) at t=3. Incoming (0,2) evicts (0,1), layer 0's LRU, although
    layer 1's experts were used longer ago; incoming (1,2) evicts (1,0)."""
    c = build()
    for t, k in enumerate([(1, 0), (1, 1), (0, 0), (0, 1)]):
        c.on_insert(k, t, prefetched=False)
    c.on_access((0, 1), 3, hit=True)
    c.on_access((0, 0), 5, hit=True)
    assert not c.has_room((0, 2)) and c.victim((0, 2), set(), 6) == (0, 1)
    assert c.victim((1, 2), set(), 6) == (1, 0)
    c.on_evict((0, 1))
    assert c.has_room((0, 2)) and not c.has_room((1, 2))
    assert c.victim((0, 2), set(), 7) is None


def test_room_is_per_layer_and_protected_keys_are_skipped() -> None:
    """Layer 0 full with (0,0) protected -> its other expert (0,1) goes; with both
    protected there is nothing to evict in layer 0 -> ConfigError, even though layer 1 has
    free slots (which the incoming expert may not use)."""
    c = build()
    c.on_insert((0, 0), 0, False)
    c.on_insert((0, 1), 1, False)
    assert c.victim((0, 3), {(0, 0)}, 2) == (0, 1)
    with pytest.raises(ConfigError):
        c.victim((0, 3), {(0, 0), (0, 1)}, 2)
    assert c.has_room((1, 0))


def test_slots_per_layer_derivation_and_validation() -> None:
    """capacity 5 over 2 layers -> 2 slots per layer (the remainder is unused); an explicit
    slots_per_layer of 3 needs 6 > 5 slots -> ConfigError; capacity 1 over 2 layers -> none."""
    assert CACHES.build("lru_per_layer", capacity_slots=5, num_layers=2,
                        num_experts=4).slots_per_layer == 2
    with pytest.raises(ConfigError, match="slots_per_layer"):
        CACHES.build("lru_per_layer", capacity_slots=5, num_layers=2, num_experts=4,
                     slots_per_layer=3)
    with pytest.raises(ConfigError):
        CACHES.build("lru_per_layer", capacity_slots=1, num_layers=2, num_experts=4)
