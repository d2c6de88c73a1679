"""CachePolicy.lowest_priority: the matrix victim rule equals the candidate-list rule."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.base import CachePolicy
from moeexp.errors import ConfigError


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
