"""next_use: approximate Belady on predicted next use, and the cost-aware prefetch gate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.belady import PrefetchRefused
from moeexp.errors import ConfigError
from moeexp.traces.synthetic import random_trace


def make(slots: int = 3, L: int = 4, J: int = 4, **kw):
    return CACHES.build("next_use", capacity_slots=slots, num_layers=L, num_experts=J, **kw)


def filled(c, keys) -> None:
    for k in keys:
        c.on_insert(k, 0, False)
        c.on_access(k, 0, False)


def test_expected_next_use_follows_the_layer_cycle_and_the_probability() -> None:
    """At layer 1 (L = 4): layer 2 runs in 1 step, layer 0 in 3, layer 1 itself in 4;
    E = delta + L (1 - P) / P."""
    c = make()
    c.observe_scores({layer: np.full(4, 0.5) for layer in range(4)})
    c.on_access((1, 0), 0, True)
    E = c.expected_next_use()
    np.testing.assert_allclose(E[:, 0], np.array([3.0, 4.0, 1.0, 2.0]) + 4.0)
    c.observe_scores({2: np.array([1.0, 0.25, 0.5, 0.5])})
    np.testing.assert_allclose(c.expected_next_use()[2, :2], [1.0, 1.0 + 12.0])


def test_later_probability_waits_after_the_first_chance() -> None:
    """With Q from :meth:`observe_later` for a layer, E = delta + L (1 - P) / Q for it (the
    first chance at P, then a geometric wait at Q); a later score without Q makes Q = P
    again, and a layer never given Q keeps the one-wait formula."""
    c = make()
    c.on_access((1, 0), 0, True)  # at layer 1: layer 2 is one step away
    c.observe_later({2: np.full(4, 0.5)})
    c.observe_scores({2: np.array([0.1, 0.9, 0.5, 0.5]), 3: np.full(4, 0.25)})
    E = c.expected_next_use()
    np.testing.assert_allclose(E[2, :2], [1.0 + 4 * 0.9 / 0.5, 1.0 + 4 * 0.1 / 0.5])
    np.testing.assert_allclose(E[3, 0], 2.0 + 4 * 0.75 / 0.25)
    c.observe_scores({2: np.full(4, 0.25)})  # no Q with it: one geometric wait
    np.testing.assert_allclose(c.expected_next_use()[2, 0], 1.0 + 4 * 0.75 / 0.25)


def test_later_probability_weighs_by_the_link_saturation() -> None:
    """With a cost model, Q = P + s (Q_later - P): a free link (s = 0: nothing needed
    lately) keeps this pass's P, a saturated one (s = 1) the next-pass Q_later (s set
    through the load model)."""
    c = make(saturation_model="load")
    c.set_link(copy_s=1.0, window_s=4.0)
    c.on_access((1, 0), 0, True)
    c.observe_later({2: np.full(4, 0.5)})
    c.observe_scores({2: np.full(4, 0.1)})
    assert c.saturation() == 0.0
    np.testing.assert_allclose(c.expected_next_use()[2, 0], 1.0 + 4 * 0.9 / 0.1)
    c.need = 2.0  # 2 copies of 1 s per 4 s layer: half the link
    c.set_link(copy_s=1.0, window_s=4.0)
    assert c.saturation() == 0.5
    np.testing.assert_allclose(c.expected_next_use()[2, 0], 1.0 + 4 * 0.9 / 0.3)


def test_demand_victim_is_the_furthest_expected_use_and_choose_agrees() -> None:
    c = make()
    filled(c, [(0, 0), (2, 1), (3, 2)])
    c.observe_scores({0: np.full(4, 0.9), 2: np.full(4, 0.05), 3: np.full(4, 0.9)})
    # at layer 3 (the last access): layer 0 is 1 step away, layer 2 is 3 steps + 4 * 19
    v = c.victim((3, 3), {(3, 3), (3, 2)}, 5)
    assert v == (2, 1)
    assert c.choose(sorted(c.resident - {(3, 2)}), (3, 3), 5) == v


def test_prefetch_whose_victim_is_needed_sooner_is_refused() -> None:
    c = make()
    filled(c, [(1, 0), (1, 1), (1, 2)])
    c.on_access((0, 0), 1, True)  # running layer 0: layer 1 is next
    c.observe_scores({1: np.full(4, 0.9), 3: np.full(4, 0.1)})
    with pytest.raises(PrefetchRefused):
        c.victim((3, 0), set(), 2)  # every resident is needed before (3, 0)
    assert c.refused == 1


def test_gate_prefetches_on_a_free_link_and_not_on_a_saturated_one() -> None:
    """A key of P = 0.6 with a free slot: on a free link (x < w, nothing needed lately)
    it pays; at x = 12 w with two copies needed per layer it needs P > x / (x + w)."""
    c = make(slots=8)
    c.observe_scores({2: np.array([0.6, 0.97, 0.0, 0.0])})
    c.set_link(copy_s=1.0, window_s=4.0)
    assert c.min_paying_prob() == 0.0
    assert c.victim((2, 0), set(), 0) is None  # taken
    c.set_link(copy_s=12.0, window_s=1.0)
    c.need = 2.0
    assert c.min_paying_prob() == pytest.approx(12.0 / 13.0)
    with pytest.raises(PrefetchRefused):
        c.victim((2, 0), set(), 0)
    assert c.victim((2, 1), set(), 0) is None  # 0.97 > 12 / 13
    ungated = make(slots=8, gate=False)
    ungated.observe_scores({2: np.array([0.6, 0.97, 0.0, 0.0])})
    ungated.set_link(copy_s=12.0, window_s=1.0)
    ungated.need = 2.0
    assert ungated.victim((2, 0), set(), 0) is None


def test_fill_takes_a_prefetch_into_a_free_slot_for_a_later_runs_use() -> None:
    """Saturated link (x = 12 w, two copies needed per layer): a key of P = 0.1 at its
    layer's next run is refused; with ``fill`` and a free slot, its use within the longest
    horizon (W = 0.9) counts a whole miss saved, so it is taken; one of W = 0.1 is not,
    nor is any fill once the cache is full (fills() is then False)."""
    for fill in (False, True):
        c = make(slots=2, fill=fill)
        c.set_horizons((2, 4))
        c.observe_scores({2: np.array([0.1, 0.1, 0.0, 0.0])})
        c.observe_within({2: np.array([[0.5, 0.05, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0]])})
        c.set_link(copy_s=12.0, window_s=1.0)
        c.need = 2.0
        assert c.fills() == fill
        if fill:
            assert c.victim((2, 0), set(), 0) is None  # taken
        else:
            with pytest.raises(PrefetchRefused):
                c.victim((2, 0), set(), 0)
        with pytest.raises(PrefetchRefused):
            c.victim((2, 1), set(), 0)  # W 0.1: a later use too unlikely
        filled(c, [(0, 0), (1, 0)])
        assert not c.fills()  # full: no fills, the gate as without fill
        with pytest.raises(ConfigError, match="fill"):
            make(fill=1)


def test_all_experts_makes_the_next_use_the_layers_next_run_and_every_prefetch_pay() -> None:
    """Under demand_load=all_experts every expert is touched at its layer's next run:
    E = delta for every expert whatever P says, and a prefetch whose victim runs later is
    taken on a saturated link (it replaces a copy the pass makes anyway); one whose victim
    runs sooner is still refused. A misspelt mode is refused."""
    c = make(slots=1)
    c.observe_scores({layer: np.full(4, 0.01) for layer in range(4)})
    c.set_link(copy_s=12.0, window_s=1.0)
    c.need = 4.0
    filled(c, [(1, 0)])  # at layer 1
    with pytest.raises(PrefetchRefused):  # activated: P = 0.01 does not pay
        c.victim((2, 3), set(), 1)
    c.set_mechanics(demand_load="all_experts")
    np.testing.assert_allclose(c.expected_next_use(),
                               np.repeat([[3.0], [4.0], [1.0], [2.0]], 4, axis=1))
    assert c.min_paying_prob() == 0.0
    assert c.victim((2, 3), set(), 1) == (1, 0)  # layer 1 runs again only after layer 2
    c.on_access((3, 0), 2, True)  # now at layer 3: layer 1 runs in 2 steps, layer 2 in 3
    with pytest.raises(PrefetchRefused):
        c.victim((2, 3), set(), 2)
    c.set_mechanics(demand_load="activated")
    assert not c.touch_all
    with pytest.raises(ConfigError, match="all_experts"):
        c.set_mechanics(demand_load="whole_layer")


def test_a_demand_load_is_never_refused() -> None:
    c = make(slots=1)
    filled(c, [(1, 0)])
    c.set_link(copy_s=100.0, window_s=1.0)
    c.need = 5.0
    assert c.victim((2, 3), {(2, 3)}, 1) == (1, 0)


@pytest.mark.parametrize(("counts", "per_layer"), [("all", (3, 1, 0)), ("needed", (2, 0, 1))])
def test_need_counts_the_links_copies_per_layer(counts: str, per_layer: tuple[int, ...]) -> None:
    """``all`` (the default): demand loads and every prefetch started, a wasted one too;
    ``needed``: demand loads and used prefetches (a prefetch counts at its use)."""
    c = make(slots=8, saturation_counts=counts)
    c.on_insert((0, 1), 0, True)  # a prefetch, used below
    c.on_insert((2, 3), 0, True)  # a prefetch never used
    c.on_access((0, 0), 0, False)  # a demand load
    c.on_access((0, 1), 1, True)  # the used prefetch
    c.on_access((0, 2), 2, True)  # a plain hit
    c.on_access((1, 0), 3, True)  # the next layer closes layer 0
    assert c.need == pytest.approx(0.2 * per_layer[0])
    c.on_insert((2, 1), 4, True)  # started in layer 1; in flight at its use (late), used
    c.on_access((2, 1), 5, False)  # closes layer 1
    c.on_access((3, 0), 6, True)  # closes layer 2
    need = 0.0
    for n in per_layer:
        need = 0.8 * need + 0.2 * n
    assert c.need == pytest.approx(need)


def test_saturation_counts_is_checked() -> None:
    assert make().count_all and not make(saturation_counts="needed").count_all
    with pytest.raises(ConfigError, match="saturation_counts.*'all', 'needed'.*'used'"):
        make(saturation_counts="used")


@pytest.mark.parametrize(("x", "w", "need", "load", "overflow"), [
    (0.27, 1.0, 0.0, 0.0, 0.0),      # a free link, no copies: nothing in the way
    (0.27, 1.0, 2.0, 0.54, 0.0),     # 3 copies' work (0.81) still fits the window
    (0.27, 1.0, 3.0, 0.81, 4.0 - 1.0 / 0.27),  # a fourth copy spills 0.30 of itself
    (0.27, 1.0, 5.0, 1.0, 1.0),      # past the window: every copy delays the next
    (3.62, 1.0, 0.0, 0.0, 1.0 - 1.0 / 3.62),  # a busy link: one copy outlasts the window
    (3.62, 1.0, 0.5, 1.0, 1.0),
])
def test_saturation_model_load_and_overflow(x: float, w: float, need: float, load: float,
                                            overflow: float) -> None:
    """s = min(1, n x / w) under ``load``; under ``overflow`` the share of one more copy
    that spills past the window, clip(n + 1 - w / x, 0, 1); ``by_execution`` picks by
    whether a miss is a copy."""
    for model, want in (("load", load), ("overflow", overflow)):
        c = make(saturation_model=model)
        c.set_link(copy_s=x, window_s=w)
        c.need = need
        assert c.saturation() == pytest.approx(want), model
    # by_execution (the default): the spill while every miss is a copy, the load once the
    # CPU may compute a miss (no demand load waits on the link then)
    c = make()
    c.set_link(copy_s=x, window_s=w)
    c.need = need
    assert c.saturation() == pytest.approx(overflow)
    c.set_miss_cost(x / 2)
    assert c.saturation() == pytest.approx(load)
    c = make(saturation_model="overflow")
    c.set_link(copy_s=0.5, window_s=None)  # no window: w = x, both give min(1, n)
    c.need = 0.4
    assert c.saturation() == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="saturation_model.*'by_execution', 'load', "
                                          "'overflow'.*'busy'"):
        make(saturation_model="busy")


def test_fit_sets_popularity_from_store_only() -> None:
    tr = random_trace(num_layers=3, num_experts=5, num_requests=6, output_len=6, seed=4)
    c = make(L=3, J=5)
    with pytest.raises(ConfigError, match="outside the store"):
        c.fit(tr)
    store = tr.split("store")
    c.fit(store)
    assert c.P.shape == (3, 5) and np.all((c.P > 0) & (c.P < 1))
    relabelled = dataclasses.replace(store, requests=[
        dataclasses.replace(store.requests[0], split="test"), *store.requests[1:]])
    with pytest.raises(ConfigError):
        c.fit(relabelled)
    with pytest.raises(ConfigError, match="copy_s"):
        c.set_link(copy_s=0.0, window_s=None)


def test_horizon_follows_the_residence_time_and_starts_at_one() -> None:
    """h = the one of {1, 2, 4, 8, 16} nearest R / 2 in log scale, R = capacity / copies per
    pass; 1 until a pass has run."""
    c = make(slots=16, L=2, J=16)
    c.set_horizons((2, 4, 8, 16))
    for e in range(2):  # layer 0: 2 copies
        c.on_insert((0, e), 0, False)
        c.on_access((0, e), 0, False)
    c.on_access((1, 0), 1, True)  # layer 0 done (one layer step)
    assert c.h == 1
    c.on_access((0, 0), 2, True)  # layer 1 done: a pass has run, 2 copies in 2 layer steps
    # R = 16 slots / (2 copies per pass) = 8 passes; R / 2 = 4
    assert c.h == 4
    for e in range(2, 10):
        c.on_insert((0, e), 2, False)
    c.on_access((1, 5), 3, True)  # 10 copies over 3 layer steps: 6.7 per pass; R/2 = 1.2
    assert c.h == 1


def test_horizon_ranks_by_the_chance_within_h_on_a_saturated_link() -> None:
    """With h = 2 on a saturated link (s = 1): q = 1 - (1 - W)^(1/2) and E = delta +
    L (1 - q) / q, whatever P says; on a free link (s = 0) E is P's as without a horizon."""
    c = make(slots=4, L=2, J=2)
    c.set_horizons((2, 4))
    c.observe_scores({0: np.array([0.1, 0.5]), 1: np.array([0.5, 0.5])})
    W = np.full((2, 2, 2), 0.5)
    W[0, 0] = [0.75, 0.19]  # h = 2: q = 0.5 and 0.1
    c.observe_within({0: W[:, 0], 1: W[:, 1]})
    c.h = 2
    c.on_access((1, 0), 0, True)  # a new layer: h is picked again; keep 2 for the test
    c.h, c._E = 2, None
    E = c.expected_next_use()
    np.testing.assert_allclose(E[0], 1.0 + 2.0 * np.array([1.0, 9.0]))
    assert E[0, 0] < E[0, 1]  # P ranked expert 1 first; the horizon ranks expert 0 first
    c.set_link(copy_s=1.0, window_s=1.0)  # need 0: s = 0, this pass's use
    assert c.saturation() == 0.0
    np.testing.assert_allclose(c.expected_next_use()[0], 1.0 + 2.0 * np.array([9.0, 1.0]))


def test_without_horizons_within_rows_are_refused_and_bad_horizons_named() -> None:
    c = make()
    with pytest.raises(ConfigError, match="before set_horizons"):
        c.observe_within({0: np.zeros((2, 4))})
    for bad in ((), (1, 2), (4, 2), (2, 2)):
        with pytest.raises(ConfigError, match="ascending distinct ints >= 2"):
            c.set_horizons(bad)


def test_fit_starts_the_horizons_from_popularity() -> None:
    t = random_trace(num_layers=2, num_experts=4, top_k=1, num_requests=6, output_len=4,
                     seed=1)
    c = make(slots=2, L=2, J=4)
    c.set_horizons((2,))
    c.fit(t.split("store"))
    np.testing.assert_allclose(c.W[0], 1.0 - (1.0 - c.P) ** 2)


def test_warm_start_loads_the_store_splits_most_used_experts() -> None:
    """warm: the capacity's most popular experts of the store split, most used first (ties:
    lower layer, then expert); cold (the default): none. Before fit it is refused, and a
    non-boolean switch is named."""
    tr = random_trace(num_layers=3, num_experts=5, num_requests=6, output_len=6, seed=4)
    store = tr.split("store")
    c = make(slots=4, L=3, J=5, warm=True)
    with pytest.raises(ConfigError, match="fit"):
        c.initial_residents()
    c.fit(store)
    keys = c.initial_residents()
    assert len(keys) == 4 and len(set(keys)) == 4
    order = sorted((-c.P[k], k) for k in np.ndindex(3, 5))
    assert keys == [k for _, k in order[:4]]
    cold = make(slots=4, L=3, J=5)
    cold.fit(store)
    assert cold.initial_residents() == []
    with pytest.raises(ConfigError, match="warm"):
        make(warm="yes")


def test_miss_cost_floors_the_offers_and_refuses_bad_costs() -> None:
    """Where a miss runs on the CPU for m < w, the least paying P of an offer rises from
    x s / (w + x s) to x s / (m + x s) (s from the load model). Bad costs are named."""
    c = make(slots=8, saturation_model="load")
    c.set_link(copy_s=2.0, window_s=4.0)
    c.need = 1.0  # s = min(1, 1 * 2 / 4) = 0.5
    assert c.min_paying_prob() == pytest.approx(1.0 / (2.0 + 1.0))
    c.set_miss_cost(0.5)
    assert c.min_paying_prob() == pytest.approx(1.0 / (0.5 + 1.0))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="miss"):
            c.set_miss_cost(bad)


def test_cpu_gate_weighs_the_late_landing_against_the_residence_it_buys() -> None:
    """With the CPU computing misses (m = 2) a prefetch of x = 10 for the layer d = 2 ahead
    (w = 1) lands 8 late, worse than the CPU's 2: it pays only through the later passes'
    uses it gains while it stays, Q_k R m (R = 16 before any copy): taken at Q_k = 0.9
    (0.9 (2 - 8) + 0.9 * 16 * 2 > 0), refused at Q_k = 0.05 (-5.4 + 1.6 < 0). R is the
    cache's residence, capacity / copies per pass."""
    c = make(slots=8)
    c.set_link(copy_s=10.0, window_s=1.0)
    c.set_miss_cost(2.0)
    assert c.saturation() == 0.0 and c.residence() == 16.0
    c.observe_scores({2: np.array([0.9, 0.9, 0.0, 0.0])})
    assert c.victim((2, 0), set(), 0) is None
    c.observe_later({2: np.array([0.05, 0.9, 0.0, 0.0])})
    c.observe_scores({2: np.array([0.9, 0.9, 0.0, 0.0])})  # P 0.9 now, Q 0.05 after
    with pytest.raises(PrefetchRefused):
        c.victim((2, 0), set(), 0)
    assert c.victim((2, 1), set(), 0) is None
    copy_only = make(slots=8)  # without a miss cost the copy rule: 0.9 min(10, 1) > 0
    copy_only.set_link(copy_s=10.0, window_s=1.0)
    copy_only.observe_later({2: np.array([0.05, 0.9, 0.0, 0.0])})
    copy_only.observe_scores({2: np.array([0.9, 0.9, 0.0, 0.0])})
    assert copy_only.victim((2, 0), set(), 0) is None
    late = make(slots=8)  # the CPU computes a late copy's expert: its wait is at most m
    late.set_link(copy_s=10.0, window_s=1.0)
    late.set_miss_cost(2.0, late_to_cpu=True)
    late.observe_later({2: np.array([0.05, 0.9, 0.0, 0.0])})
    late.observe_scores({2: np.array([0.9, 0.9, 0.0, 0.0])})
    assert late.victim((2, 0), set(), 0) is None  # 0.9 (2 - 2) + 1.6 > 0
    r = make(slots=8)
    filled(r, [(0, 0), (1, 0), (2, 0), (3, 0)])  # 4 copies over 3 layer changes
    assert r.residence() == pytest.approx(8 * 3 / (4 * 4))


@pytest.mark.parametrize("victim_horizon", [True, False])
def test_the_victim_term_counts_its_use_within_the_horizon(victim_horizon: bool) -> None:
    """Half-saturated link (x = 1, w = 2, one copy needed a layer: s = 0.5), P_k = 0.45, the
    victim (1, 1) unlikely at its next run (P = 0.05) but likely within h = 2 runs (W =
    0.9): with the horizon its term is 0.55 (0.05 + 0.5 * 0.85) and the prefetch does not
    pay (0.45 - 0.55 * 0.5 - 0.55 * 0.475 < 0); counting the next run only it does. On a
    free link (s = 0) and without a horizon in use (h = 1) both take it (s from the load
    model)."""
    c = make(slots=2, L=2, J=2, victim_horizon=victim_horizon, saturation_model="load")
    c.set_horizons((2,))
    filled(c, [(1, 1), (0, 1)])
    c.observe_scores({0: np.array([0.45, 0.9]), 1: np.array([0.5, 0.05])})
    W = np.full((1, 2, 2), 0.5)
    W[0, 0] = [0.9, 0.99]
    W[0, 1, 1] = 0.9
    c.observe_within({0: W[:, 0], 1: W[:, 1]})
    c.set_link(copy_s=1.0, window_s=2.0)
    c.h, c.need, c._E = 2, 1.0, None
    assert c.saturation() == 0.5
    if victim_horizon:
        with pytest.raises(PrefetchRefused):
            c.victim((0, 0), set(), 1)
    else:
        assert c.victim((0, 0), set(), 1) == (1, 1)
    c.need, c._E = 0.0, None  # a free link: the victim's later use is prefetched back
    assert c.victim((0, 0), set(), 1) == (1, 1)
    c.h, c.need, c._E = 1, 1.0, None
    assert c.victim((0, 0), set(), 1) == (1, 1)
    with pytest.raises(ConfigError, match="victim_horizon"):
        make(victim_horizon="yes")


def balanced(**kw):
    """L = 3, J = 5, 6 slots, every P = 1: layer 0 holds 4 of its 5 experts, layer 1 two;
    the latest access is at layer 2, so layer 0 runs next (E = 1) and layer 1 after (E = 2).
    Copy 1 s, one expert's compute 1 s: layer 0's hits hide 4 s of copies against its 1 s
    demand chain (4 - 1 >= 1 + 1: hidden), layer 1's 2 s against 3 s (not hidden)."""
    c = make(slots=6, L=3, J=5, **kw)
    c.observe_scores({layer: np.ones(5) for layer in range(3)})
    filled(c, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)])
    c.on_access((2, 0), 0, True)
    c.set_link(copy_s=1.0, window_s=10.0, expert_s=1.0)
    return c


def test_hidden_layers_are_those_whose_hits_hide_one_more_copy() -> None:
    """H_l - D_l >= x + c, with H_l = c sum(P, resident), D_l = x sum(P, absent); None where
    no layer is hidden, without the expert compute, with ``balance`` off, or where the CPU
    may compute a miss."""
    c = balanced()
    assert c.hidden_layers().tolist() == [True, False, False]
    c.on_evict((0, 3))  # memoised, but recomputed after a change: 3 - 2 < 2
    assert c.hidden_layers() is None
    c.on_insert((0, 3), 0, False)
    assert c.hidden_layers().tolist() == [True, False, False]
    c.observe_scores({0: np.full(5, 0.5)})  # 2 - 0.5 < 2
    assert c.hidden_layers() is None
    c.observe_scores({0: np.ones(5)})
    c.set_link(copy_s=1.6, window_s=10.0, expert_s=1.0)  # 4 - 1.6 < 1.6 + 1
    assert c.hidden_layers() is None
    c.set_link(copy_s=1.0, window_s=10.0)  # no expert compute known
    assert c.hidden_layers() is None
    assert balanced(balance=False).hidden_layers() is None
    cpu = balanced()
    cpu.set_miss_cost(0.5)
    assert cpu.hidden_layers() is None
    with pytest.raises(ConfigError, match="balance"):
        make(balance=1)
    with pytest.raises(ConfigError, match="expert_s"):
        make().set_link(copy_s=1.0, window_s=1.0, expert_s=-1.0)


def test_balance_evicts_from_a_hidden_layer_first() -> None:
    """Belady's rule on E takes layer 1's resident (next use 2 steps away, layer 0's 1);
    with ``balance`` the victim is a hidden layer's, whose miss its hits' compute hides.
    ``choose`` agrees; among candidates of no hidden layer it keeps the rule on E."""
    protected = {(2, 0)}
    assert balanced(balance=False).victim((2, 0), protected, 0) == (1, 0)
    c = balanced()
    assert c.victim((2, 0), protected, 0) == (0, 0)
    assert c.choose([(0, 3), (1, 1)], (2, 0), 0) == (0, 3)
    assert c.choose([(1, 0), (1, 1)], (2, 0), 0) == (1, 0)


def test_balance_takes_no_prefetch_into_a_hidden_layer_and_prices_its_victims_free() -> None:
    """A prefetch of layer 0's fifth expert would land in a layer that hides its miss: refused
    with ``balance`` (saves nothing), taken without it (P = 1, its victim of later use). A
    victim of a hidden layer costs no miss in the gate's rule (P_v = 0)."""
    with pytest.raises(PrefetchRefused):
        balanced().victim((0, 4), set(), 0)
    assert balanced(balance=False).victim((0, 4), set(), 0) == (1, 0)
    c = balanced()
    c.observe_scores({1: np.full(5, 0.4)})  # layer 1: 0.8 s hidden against 1.2 s of copies
    hidden = c.hidden_layers()
    assert hidden is not None and hidden[0]
    assert not c._pays((1, 4), (0, 0))  # P_k min(m, w) = 0.4 < (1 - 0.4) P_v m = 0.6
    assert c._pays((1, 4), (0, 0), hidden)
