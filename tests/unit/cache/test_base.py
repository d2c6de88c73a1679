"""CachePolicy.lowest_priority (the matrix victim rule) and RankedPolicy (the heap: a toy
policy, lfu, static) pick what the candidate-list rule picks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.base import CachePolicy, RankedPolicy
from moeexp.errors import ConfigError
from moeexp.traces.synthetic import random_trace


@pytest.mark.parametrize("name, kw", [("finemoe", {}), ("moe_infinity", {"variant": "paper"}),
                                      ("moe_infinity", {"variant": "oss"})])
def test_matrix_victim_equals_the_candidate_list_rule(name: str, kw: dict) -> None:
    """victim() (lowest_priority on the (L, J) matrices) picks what the base class's sorted
    candidates + choose() pick, over 2000 random events: inserts, prefetches, accesses,
    scores, protected sets (including every resident protected)."""
    rng = np.random.default_rng(0)
    L, J = 3, 6
    c = CACHES.build(name, capacity_slots=7, num_layers=L, num_experts=J, **kw)
    checked = 0
    for step in range(2000):
        key = (int(rng.integers(L)), int(rng.integers(J)))
        if rng.random() < 0.2:
            c.observe_scores({int(rng.integers(L)): rng.dirichlet(np.ones(J))})
        if key in c.resident:
            c.on_access(key, step, True)
            continue
        protected = {(int(rng.integers(L)), int(rng.integers(J))) for _ in range(rng.integers(0, 4))}
        if rng.random() < 0.02:
            protected = set(c.resident)
        try:
            want = CachePolicy.victim(c, key, protected, step)
        except ConfigError:
            with pytest.raises(ConfigError, match="no evictable expert"):
                c.victim(key, protected, step)
            continue
        assert c.victim(key, protected, step) == want
        checked += want is not None
        if want is not None:
            c.on_evict(want)
        c.on_insert(key, step, prefetched=bool(rng.random() < 0.5))
    assert checked > 500
    mask = np.zeros((L, J), dtype=bool)
    for k in c.resident:
        mask[k] = True
    assert np.array_equal(c.resident_mask, mask)


class _ByExpert(RankedPolicy):
    """A toy RankedPolicy: rank = the expert's index, fixed (ties across layers by key)."""

    name = "by_expert"

    def rank(self, key: tuple[int, int]) -> int:
        return key[1]


def test_ranked_victim_is_lowest_rank_then_lowest_key() -> None:
    """Residents (1,0), (0,2), (0,0): ranks 0, 2, 0 -> the tie on 0 goes to the lower key
    (0,0); with (0,0) protected, (1,0); with both protected, (0,2); with all protected, a
    ConfigError naming the capacity; protected keys met on the heap's top are kept."""
    c = _ByExpert(capacity_slots=3, num_layers=2, num_experts=3)
    for t, k in enumerate([(1, 0), (0, 2), (0, 0)]):
        c.on_insert(k, t, prefetched=False)
    assert c.victim((1, 1), set(), 3) == (0, 0)
    assert c.victim((1, 1), {(0, 0)}, 3) == (1, 0)
    assert c.victim((1, 1), {(0, 0), (1, 0)}, 3) == (0, 2)
    with pytest.raises(ConfigError, match="no evictable expert.*3 slots"):
        c.victim((1, 1), set(c.resident), 3)
    assert c.victim((1, 1), set(), 3) == (0, 0)  # the held entries went back
    c.on_evict((0, 0))
    assert c.victim((1, 1), set(), 4) is None  # room again


def test_ranked_heap_drops_stale_entries() -> None:
    """10,000 accesses of 3 resident keys, each followed by a victim query, leave the heap
    bounded (stale entries are dropped), and the victim still follows the rank."""
    c = _ByExpert(capacity_slots=3, num_layers=1, num_experts=4)
    for k in [(0, 3), (0, 1), (0, 2)]:
        c.on_insert(k, 0, prefetched=True)
    for t in range(10_000):
        c.on_access((0, 1 + t % 3), t, hit=True)
        assert c.victim((0, 0), {(0, 1)}, t) == (0, 2)
    assert len(c._heap) <= 2 * 3 + 64 + 1
    assert c.victim((0, 0), set(), 10_000) == (0, 1)


def heap_follows_rule(c: RankedPolicy, rule: Callable[[list[tuple[int, int]]], Any],
                      steps: int, seed: int) -> int:
    """Drive ``c`` with ``steps`` random events (misses with random protected sets, every
    resident protected now and then; hits; a resident re-inserted; a use of a key not
    resident) and assert at each miss that ``c.victim`` (the heap) and the base class's
    sorted candidates + ``choose`` both pick ``rule(unprotected residents in key order)``
    (None from the rule: a ConfigError from both). Returns the evictions checked."""
    rng = np.random.default_rng(seed)
    L, J = c.num_layers, c.num_experts
    checked = 0
    for step in range(steps):
        key = (int(rng.integers(L)), int(rng.integers(J)))
        if key in c.resident:
            if rng.random() < 0.1:
                c.on_insert(key, step, prefetched=True)
            else:
                c.on_access(key, step, True)
            continue
        if rng.random() < 0.05:
            c.on_access(key, step, False)
        protected = {(int(rng.integers(L)), int(rng.integers(J))) for _ in range(rng.integers(0, 4))}
        if rng.random() < 0.02:
            protected = set(c.resident)
        want = None
        if len(c.resident) >= c.capacity_slots:
            want = rule(sorted(k for k in c.resident if k not in protected))
            if want is None:
                for victim in (c.victim, lambda *a: CachePolicy.victim(c, *a)):
                    with pytest.raises(ConfigError, match="no evictable expert"):
                        victim(key, protected, step)
                continue
        assert c.victim(key, protected, step) == want
        assert CachePolicy.victim(c, key, protected, step) == want
        checked += want is not None
        if want is not None:
            c.on_evict(want)
        c.on_insert(key, step, prefetched=bool(rng.random() < 0.5))
        if rng.random() < 0.7:
            c.on_access(key, step, False)
    return checked


def test_lru2_heap_victim_equals_the_candidate_list_rule() -> None:
    """lru2 on the heap evicts what its rule over the candidate list evicts: oldest
    second-to-last use (none first), then oldest last use or insert, then lowest key; 3000
    random events."""
    c = CACHES.build("lru2", capacity_slots=7, num_layers=3, num_experts=6)

    def rule(cands: list[tuple[int, int]]) -> tuple[int, int] | None:
        return min(cands, key=lambda k: (c.rank(k), k), default=None)

    assert heap_follows_rule(c, rule, 3000, seed=1) > 1000


def test_lfu_heap_victim_equals_the_candidate_list_rule() -> None:
    """lfu on the heap evicts what its rule over the candidate list evicts: lowest in-cache
    count, then least recent insert or access, then lowest key; 3000 random events."""
    c = CACHES.build("lfu", capacity_slots=7, num_layers=3, num_experts=6)

    def rule(cands: list[tuple[int, int]]) -> tuple[int, int] | None:
        return min(cands, key=lambda k: (c.frequency(k), c.last_use(k), k), default=None)

    assert heap_follows_rule(c, rule, 3000, seed=2) > 1000


def test_static_heap_victim_equals_the_candidate_list_rule() -> None:
    """static on the heap evicts what its rule evicts: the least recent unpinned resident,
    then the lowest key, never a pinned one; 2000 random events, a refit on another store
    (other pinned keys, some resident already), 2000 more."""
    c = CACHES.build("static", capacity_slots=9, num_layers=3, num_experts=6, scratch_slots=4)

    def rule(cands: list[tuple[int, int]]) -> tuple[int, int] | None:
        free = [k for k in cands if k not in c.pinned]
        return min(free, key=lambda k: (c.last_use(k), k), default=None)

    def store(seed: int) -> Any:
        return random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=4,
                            prompt_len=3, output_len=5, store_fraction=1.0, seed=seed)

    c.fit(store(0))
    for k in c.initial_residents():
        c.on_insert(k, 0, prefetched=True)
    checked = heap_follows_rule(c, rule, 2000, seed=3)
    before = c.pinned
    c.fit(store(1))
    assert c.pinned != before and c.pinned & c.resident
    assert checked + heap_follows_rule(c, rule, 2000, seed=4) > 1000
