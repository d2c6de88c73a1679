"""lfu: global least in-cache frequency, ties broken by recency."""

from __future__ import annotations

from moeexp.cache import CACHES


def build(cap: int = 3):
    return CACHES.build("lfu", capacity_slots=cap, num_layers=2, num_experts=4)


def test_evicts_least_used() -> None:
    """A=(0,0) used 5x, B=(0,1) once at t=1, C=(1,0) once at t=9 (more recent than B):
    B and C tie on frequency 1, B is less recent -> B is evicted."""
    c = build()
    A, B, C = (0, 0), (0, 1), (1, 0)
    for k in (A, B, C):
        c.on_insert(k, 0, prefetched=True)
    for t in range(2, 7):
        c.on_access(A, t, hit=True)
    c.on_access(B, 1, hit=True)
    c.on_access(C, 9, hit=True)
    assert c.victim((1, 1), set(), 10) == B
    assert c.victim((1, 1), {B}, 10) == C


def test_frequency_is_in_cache_only() -> None:
    """A used 3x, then evicted and reinserted at t=5: its count restarts at 0. A (0, t=5)
    and B (0, inserted t=1) tie on frequency -> the less recent B goes; after one use of B,
    A (count 0) goes."""
    c = build(cap=2)
    A, B = (0, 0), (0, 1)
    c.on_insert(A, 0, False)
    for t in range(3):
        c.on_access(A, t, hit=True)
    c.on_evict(A)
    c.on_insert(B, 1, False)
    c.on_insert(A, 5, False)
    assert c.frequency(A) == 0
    assert c.victim((1, 0), set(), 6) == B
    c.on_access(B, 6, hit=True)
    assert c.victim((1, 0), set(), 7) == A
