"""MoE-Infinity's cache: Algorithm-1 priorities (paper) and LFU (oss)."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.moe_infinity import MoEInfinityCache
from moeexp.errors import ConfigError


def filled(variant: str, keys: list[tuple[int, int]]) -> MoEInfinityCache:
    cache = CACHES.build("moe_infinity", capacity_slots=len(keys), num_layers=4, num_experts=2,
                         variant=variant)
    for k in keys:
        cache.on_insert(k, 0, False)
    return cache


def drain(cache: MoEInfinityCache, n: int) -> list[tuple[int, int]]:
    """The next ``n`` victims, evicting each (the cache is full for the first one)."""
    out = [cache.victim((3, 3), set(), 0)]
    cache.on_evict(out[0])
    while len(out) < n:
        out.append(cache.choose(sorted(cache.resident), (3, 3), 0))
        cache.on_evict(out[-1])
    return out


def test_algorithm1_eviction_order() -> None:
    """L = 4, ε = 1e-6. pEAM rows: layer 0 [.9, .1], layer 1 [2, 6] (unnormalised: Σ = 8),
    layer 2 [.5, .5], layer 3 [1, 0]. p = (pEAM + ε)/Σ · (1 − l/4):
    (3,1) ε·.25 ≈ 2.5e-7; (0,1) .1; (1,0) 2/8·.75 = .1875; (3,0) ≈ .25000025;
    (2,0) ≈ .2500005; (0,0) .9 → evicted in that order."""
    keys = [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1)]
    cache = filled("paper", keys)
    cache.observe_scores({0: np.array([0.9, 0.1]), 1: np.array([2.0, 6.0]),
                          2: np.array([0.5, 0.5]), 3: np.array([1.0, 0.0])})
    assert cache.priority((1, 0)) == pytest.approx(0.1875)
    assert drain(cache, 6) == [(3, 1), (0, 1), (1, 0), (3, 0), (2, 0), (0, 0)]


def test_unscored_layers_count_as_uniform_and_favour_early_layers() -> None:
    """No pEAM: every row uniform (.5), so the priority is .5·(1 − l/4): the latest layer
    goes first ((3,0), (3,1): tie → lower key), early layers stay; visits do not matter."""
    cache = filled("paper", [(0, 0), (2, 1), (3, 0), (3, 1)])
    for _ in range(5):
        cache.on_access((3, 1), 0, True)
    cache.observe_scores({2: np.zeros(2)})  # an all-zero row also counts as uniform
    assert drain(cache, 3) == [(3, 0), (3, 1), (2, 1)]


def test_oss_variant_is_lfu_by_in_cache_visits() -> None:
    """oss ignores pEAM: visits (0,0) 3, (2,0) 1, (3,0) 2 → (2,0) goes first although its
    Algorithm-1 priority would be higher than (3,0)'s. A returning expert starts at 0."""
    cache = filled("oss", [(0, 0), (2, 0), (3, 0)])
    cache.observe_scores({3: np.array([0.0, 1.0])})
    assert np.all(cache.peam == 0.5)  # the rows are not even kept: LFU reads none
    for key, n in [((0, 0), 3), ((2, 0), 1), ((3, 0), 2)]:
        for _ in range(n):
            cache.on_access(key, 0, True)
    assert drain(cache, 1) == [(2, 0)]
    cache.on_insert((2, 0), 0, False)
    assert cache.victim((1, 1), set(), 0) == (2, 0)
    with pytest.raises(ConfigError, match="variant"):
        CACHES.build("moe_infinity", capacity_slots=2, num_layers=4, num_experts=2, variant="x")
