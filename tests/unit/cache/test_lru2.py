"""lru2: evict the expert whose second-to-last use is oldest (an insert is not a use)."""

from __future__ import annotations

import pytest

from moeexp.cache import CACHES
from moeexp.errors import ConfigError

A, B, C, D = (0, 0), (0, 1), (1, 0), (1, 1)


def build(cap: int = 3):
    return CACHES.build("lru2", capacity_slots=cap, num_layers=2, num_experts=4)


def test_second_to_last_use_not_last_use() -> None:
    """A used at t=1 and t=2, B at t=3 and t=9, C at t=4 and t=5. A's second-to-last use (1)
    is oldest: A goes. A used again at t=10: its second-to-last use is 2, still the oldest,
    although A is now the most recently used: A goes again (LRU would evict C, last use 5).
    A used at t=11 too: B's second-to-last use (3) is now the oldest: B goes, although its
    last use (9) is more recent than C's (5), which LRU would evict."""
    c = build()
    for k in (A, B, C):
        c.on_insert(k, 0, prefetched=False)
    for t, k in [(1, A), (2, A), (3, B), (4, C), (5, C), (9, B)]:
        c.on_access(k, t, hit=True)
    assert c.victim(D, set(), 10) == A
    c.on_access(A, 10, hit=True)
    assert c.victim(D, set(), 11) == A
    c.on_access(A, 11, hit=True)
    assert c.victim(D, set(), 12) == B


def test_fewer_than_two_uses_go_first() -> None:
    """A used twice (t=1, 2); B used once at t=8; C inserted at t=3 and never used (an
    insert is not a use). B and C have no second-to-last use, so they go before A; between
    them the least recent last event goes: C (inserted at 3) before B (used at 8)."""
    c = build()
    c.on_insert(A, 0, prefetched=False)
    c.on_insert(B, 0, prefetched=False)
    c.on_access(A, 1, hit=False)
    c.on_access(A, 2, hit=True)
    c.on_insert(C, 3, prefetched=True)
    c.on_access(B, 8, hit=True)
    assert c.victim(D, set(), 9) == C
    assert c.victim(D, {C}, 9) == B
    assert c.victim(D, {B, C}, 9) == A
    with pytest.raises(ConfigError, match="no evictable expert"):
        c.victim(D, {A, B, C}, 9)


def test_history_survives_eviction() -> None:
    """A used at t=1 and t=7, then evicted; B inserted at t=2 and used at 2 and 3. A returns
    at t=10 and is used once: its last two uses are 7 and 10 (its use at 7 was kept while it
    was away), B's are 2 and 3 -> B goes, not the just-returned A."""
    c = build(cap=2)
    c.on_insert(A, 0, prefetched=False)
    c.on_access(A, 1, hit=False)
    c.on_insert(B, 2, prefetched=False)
    c.on_access(B, 2, hit=False)
    c.on_access(B, 3, hit=True)
    c.on_access(A, 7, hit=True)
    c.on_evict(A)
    c.on_insert(C, 8, prefetched=False)
    c.on_evict(C)
    c.on_insert(A, 10, prefetched=False)
    c.on_access(A, 10, hit=False)
    assert c.rank(A) == (7, 10) and c.rank(B) == (2, 3)
    assert c.victim(D, set(), 11) == B


def test_access_of_a_key_not_resident_is_ignored() -> None:
    """An access of a key that is not resident changes nothing: A accessed at t=0 while
    away, then inserted at t=3 and never used, ranks by its insert alone."""
    c = build(cap=1)
    c.on_access(A, 0, hit=False)
    assert c.resident == set() and c.victim(A, set(), 1) is None
    c.on_insert(A, 3, prefetched=True)
    assert c.rank(A) == (-1, 3)


def test_room_means_no_victim() -> None:
    """Below capacity there is nothing to evict."""
    c = build(cap=3)
    c.on_insert(A, 0, prefetched=False)
    assert c.victim(B, set(), 1) is None
