"""FineMoE's cache: evict the lowest p·freq in floating point; prefetched experts wait."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.finemoe import FineMoECache


def make(slots: int, **kw: object) -> FineMoECache:
    return CACHES.build("finemoe", capacity_slots=slots, num_layers=2, num_experts=4, **kw)


def use(cache: FineMoECache, key: tuple[int, int], times: int, prefetched: bool = False) -> None:
    if key not in cache.resident:
        cache.on_insert(key, 0, prefetched)
    for _ in range(times):
        cache.on_access(key, 0, True)


def test_evicts_lowest_p_times_freq_in_floating_point() -> None:
    """(0,0): p .3, 3 visits → .9; (0,1): p .5, 2 visits → 1.0 → evict (0,0).
    Then (1,0): p .3, 5 visits → 1.5; (1,1): p .4, 3 visits → 1.2: truncated to integers
    both are 1 and the tie would evict (1,0), the lower key; in float (1,1) goes."""
    cache = make(2)
    cache.observe_scores({0: np.array([0.3, 0.5, 0.1, 0.1])})
    use(cache, (0, 0), 3), use(cache, (0, 1), 2)
    assert cache.victim((1, 3), set(), 0) == (0, 0)
    cache = make(2)
    cache.observe_scores({1: np.array([0.3, 0.4, 0.2, 0.1])})
    use(cache, (1, 0), 5), use(cache, (1, 1), 3)
    assert [cache.priority(k) for k in [(1, 0), (1, 1)]] == pytest.approx([1.5, 1.2])
    assert cache.victim((0, 3), set(), 0) == (1, 1)


def test_unscored_layers_use_uniform_p_and_new_scores_replace_it() -> None:
    """No scores: p = 1/J = .25 everywhere, so the least visited goes ((0,1): 1 visit vs 2).
    Scores for layer 0 = [.05, .9, ...]: (0,0)·1 = .05 < (1,0)·2 = .5 (uniform) → (0,0).
    The uniform row sent at iteration start resets p(0,0) to .25: .25 < .5 → (0,0) still.
    A score row that is not probabilities is an error."""
    cache = make(2)
    use(cache, (0, 0), 2), use(cache, (0, 1), 1)
    assert cache.victim((1, 0), set(), 0) == (0, 1)
    cache = make(2)
    use(cache, (0, 0), 1), use(cache, (1, 0), 2)
    cache.observe_scores({0: np.array([0.05, 0.9, 0.03, 0.02])})
    assert cache.victim((1, 1), set(), 0) == (0, 0)  # .05·1 < .25·2
    cache.observe_scores({0: np.full(4, 0.25)})
    assert cache.victim((1, 1), set(), 0) == (0, 0)  # .25·1 < .25·2
    with pytest.raises(ValueError, match="probabilities"):
        cache.observe_scores({0: np.array([2.0, 0, 0, 0])})


def test_prefetched_expert_waits_until_its_layer_ran() -> None:
    """(0,0) used once (p·freq = .25); (1,2) prefetched, unused (freq 0 → product 0). The
    next insertion evicts (0,0): (1,2) is pending until layer 1 runs. After an access at
    layer 1 that is not (1,2), the prefetch was wasted: it becomes the victim.
    protect_prefetched=false: the fresh prefetch is the victim at once."""
    cache = make(2)
    use(cache, (0, 0), 1)
    use(cache, (1, 2), 0, prefetched=True)
    assert cache.victim((0, 1), set(), 0) == (0, 0)
    cache.on_evict((0, 0))
    use(cache, (1, 3), 1)
    assert cache.victim((0, 1), set(), 0) == (1, 2)
    bare = make(2, protect_prefetched=False)
    use(bare, (0, 0), 1)
    use(bare, (1, 2), 0, prefetched=True)
    assert bare.victim((0, 1), set(), 0) == (1, 2)


def test_frequency_is_in_cache_unless_lifetime() -> None:
    """(0,0) visited 4 times, evicted, reinserted and visited once: in-cache freq 1
    (< (0,1)'s 2 visits → evicted); lifetime freq 5 keeps it (→ (0,1) evicted)."""
    for mode, victim in [("in_cache", (0, 0)), ("lifetime", (0, 1))]:
        cache = make(2, frequency=mode)
        use(cache, (0, 0), 4)
        cache.on_evict((0, 0))
        use(cache, (0, 0), 1), use(cache, (0, 1), 2)
        assert cache.victim((1, 0), set(), 0) == victim


def test_pause_on_miss_and_protection() -> None:
    """A miss pauses prefetching; protected keys are never victims."""
    cache = make(2)
    assert cache.pause_prefetch_on_miss is True
    use(cache, (0, 0), 1), use(cache, (0, 1), 5)
    assert cache.victim((1, 0), {(0, 0)}, 0) == (0, 1)
    assert cache.victim((1, 0), set(), 0) == (0, 0)



def test_v2_shields_a_waiting_prefetch_from_prefetches_only() -> None:
    """(0,0) used once (.25); (1,2) prefetched, unused (0). A prefetch of (0,1) (the device
    never protects a prefetch's own key) evicts (0,0) under every rule but false; a demand
    load of (0,1) (its key protected) evicts (0,0) with true (ours) but (1,2) with v2 (the
    authors' V2: only prefetches respect the shield). ``finemoe_v2`` is v2 + lifetime."""
    for rule, by_prefetch, by_demand in [(True, (0, 0), (0, 0)), ("v2", (0, 0), (1, 2)),
                                         (False, (1, 2), (1, 2))]:
        cache = make(2, protect_prefetched=rule)
        use(cache, (0, 0), 1)
        use(cache, (1, 2), 0, prefetched=True)
        assert cache.victim((0, 1), set(), 0) == by_prefetch, rule
        assert cache.victim((0, 1), {(0, 1)}, 0) == by_demand, rule
    v2 = CACHES.build("finemoe_v2", capacity_slots=2, num_layers=2, num_experts=4)
    assert (v2.name, v2.protect_prefetched, v2.protect_from_demand, v2.frequency) == (
        "finemoe_v2", True, False, "lifetime")
    with pytest.raises(Exception, match="protect_prefetched"):
        make(2, protect_prefetched="always")


def test_incremental_priorities_equal_the_product() -> None:
    """The p·freq matrix victim() reads, kept entry by entry, equals p * freq after random
    scores, accesses and evictions (both frequency rules)."""
    rng = np.random.default_rng(1)
    for frequency in ("in_cache", "lifetime"):
        cache = make(8, frequency=frequency)
        for step in range(500):
            key = (int(rng.integers(2)), int(rng.integers(4)))
            r = rng.random()
            if r < 0.2:
                cache.observe_scores({int(rng.integers(2)): rng.dirichlet(np.ones(4))})
            elif r < 0.3:
                cache.observe_scores({0: rng.dirichlet(np.ones(4)), 1: rng.dirichlet(np.ones(4))})
            elif key in cache.resident and r < 0.45:
                cache.on_evict(key)
            else:
                if key not in cache.resident:
                    cache.on_insert(key, step, bool(r < 0.6))
                cache.on_access(key, step, True)
            assert np.array_equal(cache._prio, cache.priorities())


def test_when_every_candidate_waits_the_lowest_waiting_one_goes() -> None:
    """Both residents are fresh prefetches of a layer that has not run: the shield cannot
    hold, the victim is the lowest p·freq among them (ties: the lowest key), for a
    prefetch and for a demand load alike; a protected waiting expert is never taken."""
    cache = make(2)
    use(cache, (1, 2), 0, prefetched=True)
    use(cache, (1, 1), 0, prefetched=True)
    assert cache.waiting() == {(1, 1), (1, 2)}
    assert cache.victim((0, 0), set(), 0) == (1, 1)
    assert cache.victim((0, 0), {(0, 0)}, 0) == (1, 1)
    assert cache.victim((0, 0), {(0, 0), (1, 1)}, 0) == (1, 2)
    cache.on_access((1, 2), 0, True)  # layer 1 ran: (1, 2) used, (1, 1)'s wait ends too
    assert cache.waiting() == set()
    assert cache.victim((0, 0), set(), 0) == (1, 1)  # freq 0: the lowest product
