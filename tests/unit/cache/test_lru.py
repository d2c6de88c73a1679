"""``lru``: the least recently used unprotected expert goes; inserts and uses refresh."""

from __future__ import annotations

import pytest

from moeexp.cache import CACHES
from moeexp.cache.lru import LRUCache
from moeexp.errors import ConfigError


def _filled(keys):  # type: ignore[no-untyped-def]
    c = LRUCache(capacity_slots=len(keys), num_layers=4, num_experts=4)
    for i, k in enumerate(keys):
        c.on_insert(k, i, prefetched=False)
    return c


def test_evicts_least_recently_used() -> None:
    """Insert A, B, C (3 slots); use A: order B, C, A -> B is the victim for D."""
    A, B, C, D = (0, 0), (0, 1), (1, 0), (2, 3)
    c = _filled([A, B, C])
    c.on_access(A, 3, hit=True)
    assert c.victim(D, set(), 4) == B


def test_room_means_no_victim() -> None:
    """With a free slot nothing is evicted."""
    c = LRUCache(capacity_slots=2, num_layers=2, num_experts=2)
    c.on_insert((0, 0), 0, prefetched=True)
    assert c.victim((1, 1), set(), 1) is None


def test_protected_keys_are_skipped() -> None:
    """A (oldest) is protected, B is next oldest -> B; everything protected -> ConfigError."""
    A, B, C = (0, 0), (0, 1), (1, 0)
    c = _filled([A, B, C])
    assert c.victim((3, 3), {A}, 3) == B
    with pytest.raises(ConfigError, match="no evictable"):
        c.victim((3, 3), {A, B, C}, 3)


def test_evict_then_reinsert_is_most_recent() -> None:
    """Evict A, re-insert it: it is now the most recent; the victim is B."""
    A, B, C = (0, 0), (0, 1), (1, 0)
    c = _filled([A, B, C])
    c.on_evict(A)
    assert A not in c.resident
    c.on_insert(A, 5, prefetched=False)
    assert c.victim((2, 2), set(), 6) == B
    assert c.choose([A, C], (2, 2), 6) == C


def test_registered_and_typed() -> None:
    """Built through the registry; a misspelled key fails."""
    assert isinstance(CACHES.build("lru", capacity_slots=4, num_layers=2, num_experts=4), LRUCache)
    with pytest.raises(ConfigError, match="unknown key"):
        CACHES.build("lru", capacity_slots=4, num_layers=2, num_experts=4, slotz=3)
