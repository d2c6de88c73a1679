"""FeedGate: rest the predictor where feeding it costs more than the misses it removes."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from moeexp.cache import CACHES
from moeexp.cache.belady import PrefetchRefused
from moeexp.cache.feed_gate import (
    EARLY_MIN,
    NEVER,
    REST_BITS,
    WARMUP,
    WINDOW,
    FeedGate,
    fit_rest_table,
    rest_column,
    store_buckets,
)
from moeexp.cache.next_use import NextUseCache
from moeexp.errors import ConfigError
from moeexp.traces.synthetic import random_trace


def gate(feed_s: float = 1.0, miss_s: float = 1.0, capacity: int = 2) -> FeedGate:
    return FeedGate(capacity_slots=capacity, num_layers=2, num_experts=8, feed_s=feed_s,
                    miss_s=miss_s)


def run_pass(g: FeedGate, keys: list[tuple[int, int]], hits: list[bool], now: int) -> int:
    """One pass's accesses (layer by layer); returns the clock after it."""
    for k, h in zip(keys, hits, strict=True):
        g.access(k, h)
        now += 1
    return now


# a stream no 2-slot LRU hits: 4 distinct keys per layer cycle, 2 per layer
CYCLE = [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(0, 2), (1, 2)], [(0, 3), (1, 3)]]
#: passes at rest before the first window: one fills the 2-slot shadow (its compulsory
#: misses are not counted), WARMUP more measure the bound
FIRST = 1 + WARMUP


def passes(g: FeedGate, n: int, hit: bool) -> list[bool]:
    """``n`` passes of :data:`CYCLE` (2 layers, every access a miss for a 2-slot LRU), each
    access a hit of this cache or not; what :meth:`FeedGate.pass_begins` said for each."""
    now, fed = 0, []
    for i in range(n):
        fed.append(g.pass_begins())
        now = run_pass(g, CYCLE[i % 4], [hit] * 2, now)
    return fed


def test_a_predictor_that_removes_no_miss_is_fed_for_a_cut_window_then_rests() -> None:
    g = gate(feed_s=0.1, miss_s=1.0)
    fed = passes(g, FIRST + WARMUP + EARLY_MIN + 5, hit=False)  # misses as the shadow
    # at rest while the shadow fills and the bound is measured, then one window (its
    # warm-up included) cut short after EARLY_MIN passes (every pass saves 0 < f, no
    # spread), then rest
    assert fed == [False] * FIRST + [True] * (WARMUP + EARLY_MIN) + [False] * 5
    assert g.saving_s == pytest.approx(0.0) and g.share == 0.0
    assert g.bound == pytest.approx(1.0)  # every shadow access a miss: 1 per layer
    assert g.stats()["feed_switches"] == 2.0 and g.stats()["feed_windows_cut"] == 1.0


def test_a_window_is_cut_only_when_its_passes_could_not_pay() -> None:
    """Passes alternately saving every miss and none: mean 0.5 of f = 0.6 per layer, but
    their spread keeps the bound mean + 2 s / √n above f until the window ends."""
    g = gate(feed_s=0.6, miss_s=1.0)
    now = 0
    fed = []
    for i in range(FIRST + WARMUP + WINDOW + 1):
        fed.append(g.pass_begins())
        now = run_pass(g, CYCLE[i % 4], [i % 2 == 0] * 2, now)
    assert fed == [False] * FIRST + [True] * (WARMUP + WINDOW) + [False]
    assert g.saving_s == pytest.approx(0.5) and g.stats()["feed_windows_cut"] == 0.0
    # the same mean without the spread (every pass saving half its misses) is cut
    g = gate(feed_s=0.6, miss_s=1.0)
    fed = []
    for i in range(FIRST + WARMUP + EARLY_MIN + 1):
        fed.append(g.pass_begins())
        now = run_pass(g, CYCLE[i % 4], [True, False], now)
    assert fed == [False] * FIRST + [True] * (WARMUP + EARLY_MIN) + [False]
    assert g.stats()["feed_windows_cut"] == 1.0


def test_a_predictor_that_removes_the_misses_stays_fed() -> None:
    g = gate(feed_s=0.5, miss_s=1.0)
    fed = passes(g, 4 * (WARMUP + WINDOW), hit=True)  # the cache hits what LRU misses
    assert fed == [False] * FIRST + [True] * (len(fed) - FIRST)
    assert g.saving_s == pytest.approx(1.0) and g.share == pytest.approx(1.0)


def test_rests_double_and_a_bound_below_the_feed_is_never_fed() -> None:
    g = gate(feed_s=0.1, miss_s=1.0)
    fed = passes(g, 400, hit=False)
    starts = [i for i in range(1, len(fed)) if fed[i] and not fed[i - 1]]
    stops = [i for i in range(1, len(fed)) if not fed[i] and fed[i - 1]]
    # two windows, each cut after EARLY_MIN passes (the second after WINDOW passes of
    # rest), then the rest doubles; the windows agree (r = 0, no spread), so no third is
    # bought
    assert starts == [FIRST, FIRST + WARMUP + EARLY_MIN + WINDOW]
    assert all(b - a == WARMUP + EARLY_MIN for a, b in zip(starts, stops, strict=True))
    assert g._rest == 2 * WINDOW and g.windows == 2
    # a bound below the feed (no predictor could pay): never fed, not even a window
    g = gate(feed_s=2.0, miss_s=1.0)
    assert not any(passes(g, 400, hit=False))
    assert g.stats()["feed_rested_share"] == 1.0


def test_the_shadow_is_an_lru_of_the_capacity_and_bad_costs_are_refused() -> None:
    g = gate(capacity=2)
    g.pass_begins()
    for k in [(0, 0), (0, 1), (0, 0), (0, 2), (0, 1)]:
        g.access(k, True)
    assert list(g.shadow) == [(0, 2), (0, 1)]  # (0, 0) was the least recent
    assert g._pass[0] == 4  # (0, 0), (0, 1), (0, 2) cold, (0, 1) evicted and missed again
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="feed_s"):
            gate(feed_s=bad)
        with pytest.raises(ConfigError, match="miss_s"):
            gate(miss_s=bad)


def next_use(**kw):
    c = CACHES.build("next_use", capacity_slots=2, num_layers=2, num_experts=8, **kw)
    c.set_link(copy_s=1.0, window_s=0.5)
    return c


def test_next_use_without_a_feed_cost_has_no_gate_and_resting_it_is_lru() -> None:
    c = next_use()
    c.set_feed_cost(0.0)
    assert c.feed_gate is None and all(c.feeding() for _ in range(50))
    off = next_use(feed_gate=False)
    off.set_feed_cost(0.1)
    assert off.feed_gate is None and off.feeding()
    with pytest.raises(ConfigError, match="feed cost"):
        c.set_feed_cost(-1.0)
    with pytest.raises(ConfigError, match="feed_gate"):
        CACHES.build("next_use", capacity_slots=2, num_layers=2, num_experts=8,
                     feed_gate="no")
    fresh = CACHES.build("next_use", capacity_slots=2, num_layers=2, num_experts=8)
    with pytest.raises(ConfigError, match="copy time"):
        fresh.set_feed_cost(0.1)
    c.set_feed_cost(0.1)
    g = c.feed_gate
    assert g is not None
    g.fed = False  # resting: the least recently used goes, and no prefetch is taken
    now = 0
    for k in [(0, 5), (1, 2)]:
        c.on_insert(k, now, False)
        c.on_access(k, now, False)
        now += 1
    c.on_access((0, 5), now, True)  # (1, 2) is now the least recent
    c.P[1, 2] = 1.0  # its predicted next use would keep it
    c.P[0, 5] = 0.0
    c._E = None
    assert c.victim((1, 7), {(1, 7)}, now + 1) == (1, 2)
    assert c.victim((1, 7), {(1, 7), (1, 2)}, now + 1) == (0, 5)  # protected: the next
    assert c.choose([(0, 5), (1, 2)], (1, 7), now + 1) == (1, 2)
    # recency is the order of events, as lru's, not the access clock: the engine uses a
    # layer's hits before its demand loads, with clocks ranked by expert
    c.on_access((1, 2), now - 5, True)
    assert c.victim((1, 7), {(1, 7)}, now + 1) == (0, 5)
    c.on_evict((0, 5))
    assert c.victim((1, 7), {(1, 7)}, now + 1) is None  # room again
    c.on_insert((0, 5), now, False)  # back, the most recent
    with pytest.raises(PrefetchRefused):
        c.victim((1, 6), set(), now + 1)
    assert c.choose([(0, 5), (1, 2)], (1, 7), now + 1) == (1, 2)
    g.fed = True  # fed: the predicted next use decides again
    assert c.victim((1, 7), {(1, 7)}, now + 1) == (0, 5)


def test_a_resting_cache_offers_the_next_layers_experts_of_highest_use_rate() -> None:
    """Resting, ``next_use`` folds each layer's routing into the gate's use patterns and
    offers the next layer's top k by their resting probability (without a fit, the decayed
    score: sum of 2^-(i+1) over the runs i back that used it); it takes such a prefetch
    where its rule pays on it (an expert used at each of the last runs of its layer, over a
    victim never used), refuses one never used, and offers nothing while fed, at the last
    layer, or with ``rest_prefetch`` off (then every prefetch is refused)."""
    c = next_use()
    c.set_feed_cost(0.1)
    g = c.feed_gate
    assert g is not None and not g.fed  # a gate starts resting
    assert c.rest_layer(0, np.array([1, 2]), 2).tolist() == []  # layer 1 never ran
    c.rest_layer(1, np.array([3, 5]), 2)
    c.rest_layer(0, np.array([1]), 2)
    c.rest_layer(1, np.array([3]), 2)
    assert g.history[1, 3] == 0b11 and g.history[1, 5] == 0b10 and g.history[0, 1] == 0b11
    assert g.rest_prob((1, 3)) == 0.75 and g.rest_prob((1, 5)) == 0.25
    assert c.rest_layer(0, np.array([1]), 1).tolist() == [3]
    assert c.rest_layer(0, np.array([1]), 4).tolist() == [3, 5]  # rate 0 is never offered
    assert c.rest_layer(1, np.array([3]), 2).tolist() == []  # the last layer: nothing ahead
    for k in [(0, 6), (1, 7)]:  # full, with residents never used since
        c.on_insert(k, 0, False)
    c.rest_layer(1, np.array([3]), 2)
    assert c.victim((1, 3), set(), 1) == (0, 6)  # 0.875 over a victim never used
    with pytest.raises(PrefetchRefused, match="resting offer"):
        c.victim((1, 4), set(), 1)  # never used
    # the CPU rule (later passes' uses credited) only where the CPU computes a miss for
    # less than a copy; where it is slower every miss is copied anyway: the copy rule
    seen: list[bool | None] = []
    rule = c._rule
    c._rule = lambda *a, cpu=None: seen.append(cpu) or rule(*a, cpu=cpu)  # type: ignore
    for miss_s in (0.5, 2.0):
        c.set_miss_cost(miss_s)
        c._rest_pays((1, 3), (0, 6))
    assert seen == [True, False]
    g.fed = True
    assert c.rest_layer(0, np.array([1]), 2).tolist() == []
    off = next_use(rest_prefetch=False)
    off.set_feed_cost(0.1)
    assert off.rest_layer(0, np.array([1]), 2).tolist() == []
    with pytest.raises(PrefetchRefused, match="rests"):
        off.victim((1, 3), set(), 1)
    with pytest.raises(ConfigError, match="rest_prefetch"):
        next_use(rest_prefetch=1)


def test_the_resting_table_is_the_store_splits_next_use_rate_per_pattern() -> None:
    """``fit_rest_table``: per use pattern over a layer's last REST_BITS decode passes (in
    order, across requests), the Laplace-smoothed share of cells whose expert is used at the
    next pass, pooled over layers and experts; the same as a loop over every cell. A fitted
    ``next_use`` cache's gate reads it; a request of another split raises."""
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=10, output_len=12,
                      seed=3)
    store = tr.split("store")
    table = fit_rest_table(store)
    cells, want = loop_table(store, np.zeros((3, 6), dtype=int))
    assert cells.sum() > 100 and table.shape == (1, 2 ** REST_BITS)
    assert np.allclose(table, want)
    c = CACHES.build("next_use", capacity_slots=4, num_layers=3, num_experts=6,
                     rest_buckets=1, rest_ages=0)
    c.fit(store)
    c.set_link(copy_s=1.0, window_s=0.5)
    c.set_feed_cost(0.1)
    assert c.feed_gate is not None and np.array_equal(c.feed_gate.rest_table, table)
    with pytest.raises(ConfigError, match="store split"):
        fit_rest_table(tr.split("test"))
    with pytest.raises(ConfigError, match="rest_table"):
        FeedGate(capacity_slots=2, num_layers=2, num_experts=8, feed_s=1.0, miss_s=1.0,
                 rest_table=np.zeros(3))


def loop_table(store, bucket: np.ndarray, ages: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``fit_rest_table`` by a loop over every (pass, layer, expert) cell: the cells per
    (bucket, column), and the Laplace-smoothed share used next; with ``ages``, a pattern 0
    reads the age class of the runs since the expert's last use (all of them: class
    ``ages`` - 1 if never), counted back by hand."""
    sizes = np.diff(store.iter_offsets)
    idx = store.topk_idx[np.repeat(sizes == 1, sizes)]
    L, J = bucket.shape
    used = np.zeros((len(idx), L, J), dtype=bool)
    for t, row in enumerate(idx):
        for layer in range(L):
            used[t, layer, row[layer]] = True
    B = bucket.max() + 1
    size = 2 ** REST_BITS + ages
    cells, uses = np.zeros((B, size)), np.zeros((B, size))
    for t in range(REST_BITS, len(idx)):
        for layer in range(L):
            for e in range(J):
                pat = sum(int(used[t - 1 - i, layer, e]) << i for i in range(REST_BITS))
                if ages and not pat:
                    back = [s for s in range(t) if used[s, layer, e]]
                    age = t - 1 - back[-1] if back else None
                    cls = ages - 1
                    for c in range(ages):  # class c: age in [6 + 2^c - 1, 6 + 2^(c+1) - 2]
                        if age is not None and REST_BITS + 2 ** c - 1 <= age <= (
                                REST_BITS + 2 ** (c + 1) - 2):
                            cls = min(c, ages - 1)
                    pat = 2 ** REST_BITS + cls
                cells[bucket[layer, e], pat] += 1
                uses[bucket[layer, e], pat] += used[t, layer, e]
    return cells, (uses + 1) / (cells + 2)


def test_store_frequency_buckets_split_the_resting_table_and_the_victim_reads_it() -> None:
    """``store_buckets``: rank by store use (ties: the lower key), B equal parts, 0 the most
    used; ``fit_rest_table`` with them is the loop's table per bucket; a ``next_use`` cache
    with ``rest_buckets`` reads its rows by expert, and under ``rest_evict: prob`` a resting
    victim is the resident of least resting probability (LRU among equals)."""
    counts = np.array([[5.0, 1.0, 5.0], [0.0, 9.0, 2.0]])
    assert store_buckets(counts, 2).tolist() == [[0, 1, 0], [1, 0, 1]]
    assert store_buckets(counts, 6).tolist() == [[1, 4, 2], [5, 0, 3]]
    assert not store_buckets(counts, 1).any()
    with pytest.raises(ConfigError, match="buckets"):
        store_buckets(counts, 0)
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=10, output_len=12,
                      seed=3)
    store = tr.split("store")
    c = CACHES.build("next_use", capacity_slots=4, num_layers=3, num_experts=6,
                     rest_buckets=3, rest_evict="prob", rest_ages=0)
    c.fit(store)
    c.set_link(copy_s=1.0, window_s=0.5)
    c.set_feed_cost(0.1)
    g = c.feed_gate
    assert g is not None
    bucket = store_buckets(c.P, 3)
    assert np.array_equal(g.rest_bucket, bucket) and sorted(np.bincount(bucket.ravel())) == [6] * 3
    assert np.allclose(g.rest_table, loop_table(store, bucket)[1])
    g.history[:] = 0
    g.history[0, 2] = 0b1
    assert g.rest_prob((0, 2)) == g.rest_table[bucket[0, 2], 1]
    for k in [(0, 2), (1, 1), (1, 4), (2, 0)]:
        c.on_insert(k, 0, False)
    probs = {k: g.rest_prob(k) for k in g.order}
    low = min(probs.values())
    first_low = next(k for k in g.order if probs[k] == low)
    assert first_low != next(iter(g.order))  # not the least recently used
    assert c.victim((2, 5), {(2, 5)}, 1) == first_low
    assert c.choose(list(g.order), (2, 5), 1) == first_low
    # a hot expert idle for REST_BITS runs may rank among the top k; it is not offered
    hot = FeedGate(capacity_slots=2, num_layers=2, num_experts=4, feed_s=1.0, miss_s=1.0,
                   rest_table=np.stack([np.full(2 ** REST_BITS, 0.9),
                                        np.linspace(0.0, 0.5, 2 ** REST_BITS)]),
                   rest_bucket=np.array([[0, 1, 1, 1], [0, 1, 1, 1]]))
    hot.history[1] = [0, 1, 3, 0]
    assert hot.rest_offers(1, 2).tolist() == [2] and hot.rest_offers(1, 3).tolist() == [2, 1]
    with pytest.raises(ConfigError, match="rest_evict"):
        next_use(rest_evict="lfu")
    with pytest.raises(ConfigError, match="rest_buckets"):
        next_use(rest_buckets=0)
    with pytest.raises(ConfigError, match="rest_bucket"):
        FeedGate(capacity_slots=2, num_layers=2, num_experts=8, feed_s=1.0, miss_s=1.0,
                 rest_bucket=np.ones((2, 8), dtype=int))


def test_age_classes_tell_a_long_idle_expert_from_a_short_idle_one() -> None:
    """``rest_ages``: an expert whose pattern is 0 reads its age class, doubling from
    REST_BITS runs since its last use (``rest_column``); ``fit_rest_table`` counts the same
    classes on the store passes (the loop's table); the gate ages its experts as it
    observes rested runs, and under ``rest_evict: prob`` the resting victim among a
    bucket's idle experts is the one idle longest where the store says so."""
    base = 2 ** REST_BITS
    ages = np.array([6, 7, 8, 9, 12, 13, 20, 21, 100, NEVER])
    assert rest_column(np.zeros(10, dtype=np.uint8), ages, 4).tolist() == [
        base, base + 1, base + 1, base + 2, base + 2, base + 3, base + 3, base + 3,
        base + 3, base + 3]
    assert rest_column(np.zeros(3, dtype=np.uint8), np.array([20, 21, 37]), 8).tolist() == [
        base + 3, base + 4, base + 5]
    assert rest_column(np.array([5, 0]), np.array([0, 6]), 3).tolist() == [5, base]
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=10, output_len=12,
                      seed=3)
    store = tr.split("store")
    table = fit_rest_table(store, None, 5)
    cells, want = loop_table(store, np.zeros((3, 6), dtype=int), 5)
    assert table.shape == (1, base + 5) and np.allclose(table, want)
    assert cells[0, base + 1:].sum() > 20 and cells[0, 0] == 0  # pattern 0 is never read
    assert np.array_equal(fit_rest_table(store)[0, 1:], table[0, 1:base])  # h > 0: as before
    c = CACHES.build("next_use", capacity_slots=4, num_layers=3, num_experts=6,
                     rest_ages=5, rest_evict="prob", rest_buckets=1)
    c.fit(store)
    c.set_link(copy_s=1.0, window_s=0.5)
    c.set_feed_cost(0.1)
    g = c.feed_gate
    assert g is not None and np.allclose(g.rest_table, table)
    assert (g.column == base + 4).all()  # never used: the last class
    for run in range(9):  # expert 1 used at the first run only, expert 2 at the fourth
        g.rest_observe(1, np.array([1] if run == 0 else [2] if run == 3 else [5]))
    assert g.age[1].tolist() == [NEVER, 8, 5, NEVER, NEVER, 0]
    assert g.column[1].tolist() == [base + 4, base + 1, 0b100000, base + 4, base + 4, 0b11111]
    assert g.rest_prob((1, 1)) == table[0, base + 1]
    g.rest_table = np.tile(np.linspace(0.9, 0.1, base + 5), (1, 1))  # older: less likely
    for k in [(1, 1), (1, 5), (1, 2), (1, 4)]:
        c.on_insert(k, 0, False)
    assert c.victim((2, 5), {(2, 5)}, 1) == (1, 4)  # never used, though inserted last
    with pytest.raises(ConfigError, match="rest_ages"):
        next_use(rest_ages=-1)
    with pytest.raises(ConfigError, match="rest ages"):
        fit_rest_table(store, None, True)
    with pytest.raises(ConfigError, match="age classes"):
        FeedGate(capacity_slots=2, num_layers=2, num_experts=8, feed_s=1.0, miss_s=1.0,
                 rest_table=np.zeros(2 ** REST_BITS), rest_ages=2)


def test_a_burst_of_misses_does_not_buy_a_window() -> None:
    """Probes read the run's long average of the bound: after a window that saved nothing,
    a stream the shadow LRU mostly hits (bound long below f) gets no further window from
    bursts of misses every 100 passes, though each burst lifts the short average above f."""
    g = gate(feed_s=0.2, miss_s=1.0)
    now, fed, short = 0, [], []
    hot = [(0, 0), (1, 0)]  # fits in the 2-slot shadow: no miss once loaded
    for i in range(1200):
        fed.append(g.pass_begins())
        short.append(g.bound)
        burst = i < 20 or i % 100 in (50, 51, 52)
        now = run_pass(g, CYCLE[i % 4] if burst else hot, [False] * 2 if burst else [True] * 2,
                       now)
    assert fed[FIRST] and g.saving_s == 0.0  # the first window: fed, saved nothing
    assert not any(fed[400:])
    assert max(short[400:]) > 0.2 > g.bound_long  # the bursts show in the short average only


def test_windows_stop_once_even_an_optimistic_share_cannot_pay() -> None:
    """A predictor measured to save the same share every window (here none, r = 0, so the
    windows' spread is 0) against a bound of 1 miss a layer and f = 0.4: two windows are
    bought (the upper bound on r is 1 before two), then none however long the run; a
    predictor whose windows disagree keeps its upper bound up: r + 2 s / sqrt(n)."""
    g = gate(feed_s=0.4, miss_s=1.0)
    fed = passes(g, 6000, hit=False)
    starts = sum(1 for i in range(1, len(fed)) if fed[i] and not fed[i - 1])
    assert g.windows == 2 and starts == 2 and not any(fed[200:])
    g = gate(feed_s=0.4, miss_s=1.0)
    g.windows, g.share, g._shares = 4, 0.25, [1.0, 0.5]  # shares 0, 0, 0.5, 0.5
    assert g._hope() == pytest.approx(0.25 + 2 * math.sqrt((0.5 - 4 * 0.25 ** 2) / 3 / 4))


def test_a_resting_gate_keeps_the_last_passes_routing_for_the_catch_up() -> None:
    """While it rests, the gate keeps each rested pass's routing (bool[L, J], from the
    accesses it sees), the last HISTORY of them; ``rested()`` hands them over oldest first
    and forgets them. A fed pass keeps nothing."""
    from moeexp.cache.feed_gate import HISTORY

    g = gate(feed_s=2.0, miss_s=1.0)  # a bound below the feed: it never feeds
    n = HISTORY + 6
    assert not any(passes(g, n, hit=False))
    g.pass_begins()  # folds the last pass
    kept = g.rested()
    assert len(kept) == HISTORY and g.rested() == []
    for i, used in zip(range(n - HISTORY, n), kept, strict=True):
        want = np.zeros((2, 8), dtype=bool)
        for k in CYCLE[i % 4]:
            want[k] = True
        assert (used == want).all()
    fed = gate(feed_s=0.5, miss_s=1.0)
    passes(fed, 40, hit=True)  # fed from pass FIRST on
    fed.pass_begins()
    assert len(fed.rested()) == FIRST  # only the passes before the first window


def bursts(g: FeedGate, n: int, help_when_fed: bool) -> list[bool]:
    """``n`` passes: a burst of :data:`CYCLE` (every access a shadow miss) in passes 50..59
    of every 100, the 2-slot-resident ``hot`` pair otherwise; in a burst the cache
    hits while fed if ``help_when_fed``, else misses as the shadow does."""
    now, fed = 0, []
    hot = [(0, 0), (1, 0)]
    for i in range(n):
        fed.append(g.pass_begins())
        if 50 <= i % 100 < 60:
            now = run_pass(g, CYCLE[i % 4], [help_when_fed and fed[-1]] * 2, now)
        else:
            now = run_pass(g, hot, [True] * 2, now)
    return fed


def primed(feed_s: float) -> FeedGate:
    """A gate that has measured r = 0.5 in ten agreeing windows (r⁺ = 0.5: the long route's
    test r⁺ · b_long > f fails on these streams, so only the short route opens windows)."""
    g = gate(feed_s=feed_s, miss_s=1.0)
    g.windows, g.share, g._pooled, g._shares = 10, 0.5, [10 ** 6, 2 * 10 ** 6], [5.0, 2.5]
    return g


def test_the_short_route_stops_once_its_windows_do_not_keep_their_promise() -> None:
    """Each burst lifts r · b_short above f (fifteenth stage). Windows that save nothing of
    what r · b_short promised: the short route opens two (ρ⁺ = 1 before two), then none
    (ρ, their mean ratio, is below 0.5). Windows that save what they promise: one a burst."""
    g = primed(0.2)
    fed = bursts(g, 1000, help_when_fed=False)
    opened = [i for i in range(1, len(fed)) if fed[i] and not fed[i - 1]]
    assert len(opened) == 2 and all(50 <= i % 100 < 60 for i in opened)
    # they saved only the shadow's misses on the hot pair as the burst ended
    assert g._kept[0] == 2 and g._kept_word() < 0.5
    g = primed(0.2)
    fed = bursts(g, 1000, help_when_fed=True)
    opened = [i for i in range(1, len(fed)) if fed[i] and not fed[i - 1]]
    assert len(opened) >= 9 and g._kept_word() == 1.0
    assert g.stats()["feed_rested_share"] > 0.5  # the hot stretches rest it again


def against_rest(rest_baseline: bool, feed_s: float, fed_hits: list[bool], n: int = 120
                 ) -> tuple[FeedGate, list[bool]]:
    """``n`` passes of :data:`CYCLE` (every access a shadow miss) through a gate that
    weighs the fed saving against the resting policy's (``rest_baseline``) or LRU's: a rested
    pass hits one of its two accesses (resting saves 0.5 misses a layer), a fed pass hits
    as ``fed_hits`` says."""
    g = FeedGate(capacity_slots=2, num_layers=2, num_experts=8, feed_s=feed_s, miss_s=1.0,
                 rest_baseline=rest_baseline)
    now, fed = 0, []
    for i in range(n):
        fed.append(g.pass_begins())
        now = run_pass(g, CYCLE[i % 4], fed_hits if fed[-1] else [True, False], now)
    return g, fed


def test_a_fed_window_must_beat_what_resting_saves_not_lru() -> None:
    """Eighteenth stage: with resting offers the policy a fed predictor replaces saves
    misses of its own (g); a window pays only if its saving beyond g pays the feed."""
    # saving what resting saves (0.5 of 1 miss a layer): against LRU it pays f = 0.3 and
    # is fed for good; against resting it saves nothing, and its window is cut
    _, fed = against_rest(False, 0.3, [True, False])
    assert fed == [False] * FIRST + [True] * (len(fed) - FIRST)
    g, fed = against_rest(True, 0.3, [True, False])
    assert g.rest_gain == pytest.approx(0.5)
    # g is measured on WINDOW rested passes before the first window (from the pass after
    # the one that filled the shadow); the window is cut after EARLY_MIN, and g is
    # measured again only SETTLE passes into the rest
    first = 1 + WINDOW
    assert fed[:first + WARMUP + EARLY_MIN] == [False] * first + [True] * (WARMUP + EARLY_MIN)
    assert not any(fed[first + WARMUP + EARLY_MIN:first + WARMUP + EARLY_MIN + WINDOW])
    assert g.stats()["feed_windows_cut"] >= 1.0
    assert g.stats()["feed_rest_gain_us_per_layer"] == pytest.approx(0.5e6)
    # saving every miss: 0.5 beyond resting pays f = 0.4, and it is fed for good
    g, fed = against_rest(True, 0.4, [True, True])
    assert fed == [False] * (1 + WINDOW) + [True] * (len(fed) - 1 - WINDOW)
    # ... but not f = 0.6, which no predictor could earn beyond g (bound 1 - 0.5): never fed
    g, fed = against_rest(True, 0.6, [True, True])
    assert not any(fed) and g.windows == 0


def test_the_config_and_the_class_agree_on_every_option() -> None:
    """``conf/cache/next_use.yaml`` gives each option of ``NextUseCache`` the class's own
    default (the resting options' defaults changed in issue 27's nineteenth stage: both at
    once)."""
    conf = OmegaConf.load(Path(__file__).parents[3] / "conf" / "cache" / "next_use.yaml")
    params = inspect.signature(NextUseCache.__init__).parameters
    options = [k for k in params if k not in ("self", "capacity_slots", "num_layers",
                                              "num_experts")]
    assert {"rest_buckets", "rest_ages", "rest_evict"} <= set(options)
    for key in options:
        assert conf[key] == params[key].default, key
    assert (conf.rest_buckets, conf.rest_ages, conf.rest_evict) == (4, 8, "prob")


def test_feed_overlap_prices_a_cpu_miss_less_the_gpu_work_it_takes_off() -> None:
    """``feed_overlap``: the feed gate's m is the CPU's miss less the GPU time it takes off
    the GPU's chain (``relief_s``), where the CPU computes the miss (it beats the copy); a
    copy miss, or the option off, keeps the whole m; a relief above m leaves a free miss
    (the predictor can never pay). The prefetch gate's m is unchanged."""
    c = next_use(feed_overlap=True)  # copy_s 1.0
    c.set_miss_cost(0.8, relief_s=0.5)
    c.set_feed_cost(0.1)
    assert c.feed_gate is not None and c.feed_gate.miss_s == pytest.approx(0.3)
    c.feeding()
    assert c.feed_gate.miss_s == pytest.approx(0.3) and c._miss() == 0.8
    c.set_miss_cost(1.5, relief_s=0.5)  # the copy is cheaper: a miss is a copy
    c.feeding()
    assert c.feed_gate.miss_s == 1.0
    c.set_miss_cost(0.8, relief_s=2.0)
    c.feeding()
    assert 0 < c.feed_gate.miss_s < 1e-6
    assert next_use().feed_overlap  # the default
    off = next_use(feed_overlap=False)
    off.set_miss_cost(0.8, relief_s=0.5)
    off.set_feed_cost(0.1)
    assert off.feed_gate is not None and off.feed_gate.miss_s == 0.8
    with pytest.raises(ConfigError, match="relief"):
        off.set_miss_cost(0.8, relief_s=-1.0)
    with pytest.raises(ConfigError, match="feed_overlap"):
        next_use(feed_overlap="yes")


def test_a_rested_prefill_evicts_the_layers_behind_first() -> None:
    """``within_pass``: in a pass of T > 1 tokens a resident of a layer the pass has still
    to run weighs its use within the pass, 1 - (1 - P)^T, so the resting victim is the
    least probable resident of a layer already run (LRU evicts the layers ahead first, the
    loop's worst case); a one-token pass, or the option off, reads P alone. The next_use
    option ``rest_within_pass`` (default true) asks for it where a miss is a copy, not
    where the CPU computes a miss for less."""
    # P(h) by pattern: the pattern of a once-used expert (1) 0.2; of one used twice (3) 0.5
    table = np.full(2 ** REST_BITS, 0.9)
    table[0b1], table[0b11] = 0.2, 0.5

    def made() -> FeedGate:
        g = FeedGate(capacity_slots=3, num_layers=3, num_experts=4, feed_s=1.0,
                     miss_s=1.0, rest_table=table)
        g.rest_observe(2, np.array([1]))  # (2, 1): P 0.2, of layer 2 (ahead of layer 0)
        g.rest_observe(0, np.array([3]))
        g.rest_observe(0, np.array([3]))  # (0, 3): P 0.5, of layer 0 (run)
        for key in [(2, 1), (0, 3), (0, 0)]:
            g.insert(key)
        return g

    def victim(g: FeedGate, tokens: int, within: bool = True) -> tuple[int, int] | None:
        g.pass_begins(tokens)
        g.access((0, 0), True)  # the pass is at layer 0: layer 2 is still to run
        return g.rest_victim(lambda k: k != (0, 0), within_pass=within)

    assert victim(made(), 1) == (2, 1)  # one token: 0.2 < 0.5, as before
    assert victim(made(), 8, within=False) == (2, 1)  # off: P alone
    on = made()
    assert victim(on, 8) == (0, 3)  # 1 - 0.8^8 = 0.83 > 0.5: the layer behind goes
    assert on.tokens == 8
    assert victim(on, 2) == (2, 1)  # 1 - 0.8^2 = 0.36 < 0.5: still the one ahead

    asked: list[bool] = []
    for opt, miss_s in ((True, None), (False, None), (True, 0.5), (True, 2.0)):
        c = next_use(rest_within_pass=opt)  # copy_s 1.0
        c.set_feed_cost(0.1)
        if miss_s is not None:
            c.set_miss_cost(miss_s)
        assert c.feed_gate is not None
        c.feed_gate.rest_victim = lambda allowed, within_pass=False: asked.append(within_pass)
        c._rest_victim(c.feed_gate, lambda k: True)
    # on with copies, off, on with a CPU cheaper than a copy, on with a dearer one
    assert asked == [True, False, False, True]
    with pytest.raises(ConfigError, match="rest_within_pass"):
        next_use(rest_within_pass="yes")
