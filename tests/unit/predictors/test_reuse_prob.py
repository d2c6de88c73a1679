"""reuse_prob: calibrated probabilities for eviction and prefetch; the cost model it binds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors import reuse_features as rf
from moeexp.predictors.base import IterationStart, LayerObservation, RestLayer
from moeexp.simulator import simulate
from moeexp.traces.synthetic import random_trace


def trace():
    return random_trace(num_layers=4, num_experts=8, top_k=2, num_requests=12, output_len=10,
                        seed=5)


def observation(tr, it: int, layer: int) -> LayerObservation:
    sl = tr.token_slice(it)
    idx = tr.topk_idx[sl, layer].astype(np.int64).reshape(-1)
    counts = np.bincount(idx, minlength=tr.dims.num_experts)
    return LayerObservation(layer=layer, probs=np.zeros((1, 8), np.float32),
                            experts=np.flatnonzero(counts), counts=counts)


def test_scores_cover_the_layer_and_the_layers_ahead_and_offers_respect_the_floor() -> None:
    tr = trace()
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, min_prob=0.3)
    p.fit(tr.split("store"))
    p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                     token_request=np.array([0])))
    out = p.observe_layer(observation(tr, 1, 1))
    assert sorted(out.scores) == [1, 2, 3]
    for row in out.scores.values():
        assert row.shape == (8,) and np.all((row >= 0) & (row <= 1))
    assert all(pf.layer in (2, 3) and out.scores[pf.layer][pf.expert] >= 0.3
               for pf in out.prefetch)
    offered = {(pf.layer, pf.expert) for pf in out.prefetch}
    assert offered == {(t, e) for t in (2, 3) for e in range(8) if out.scores[t][e] >= 0.3}
    near = [pf.priority for pf in out.prefetch if pf.layer == 2]
    far = [pf.priority for pf in out.prefetch if pf.layer == 3]
    assert not near or not far or min(near) > max(far)  # nearer layers first
    assert sorted(p.observe_layer(observation(tr, 1, 3)).scores) == [3]
    deep = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=9)  # capped at L - 1 = 3
    deep.fit(tr.split("store"))
    assert sorted(deep.observe_layer(observation(tr, 1, 0)).scores) == [0, 1, 2, 3]
    capped = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, min_prob=0.0,
                              max_per_layer=1)
    capped.fit(tr.split("store"))
    got = capped.observe_layer(observation(tr, 1, 0)).prefetch
    assert sorted(pf.layer for pf in got) == [1, 2]


def test_layers_ahead_get_the_next_pass_probability_if_unused_now() -> None:
    """A bound ``next_use`` cache gets, for each layer ahead, P = this pass's probability
    (the scores) and Q = the next model on the state a pass without the expert leaves
    (recency one pass older); the layer that ran gets Q = P. ``later=False`` sends no Q;
    ``logistic_no_follow`` fits the next model without the follow column and
    ``logistic_no_recency`` without that and the recency column."""
    tr = trace()
    for later in (True, False):
        p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, later=later, knn=False,
                             knn_ahead=False)  # the next model's own columns, no kNN one
        c = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8)
        p.fit(tr.split("store"))
        p.bind(cost(tr, 32.0), [c])
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                         token_request=np.array([0])))
        for layer in range(4):
            out = p.observe_layer(observation(tr, 1, layer))
            c.observe_scores(out.scores)
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=2, embed=None,
                                         token_request=np.array([0])))
        out = p.observe_layer(observation(tr, 2, 0))
        c.observe_scores(out.scores)
        np.testing.assert_array_equal(c.P[1], out.scores[1])
        np.testing.assert_array_equal(c.Q[0], c.P[0])
        want = p.models.next(rf.next_features(p.state, p.models.logpop, slice(1, 3),
                                              unused=True, follow=p.models.follow))
        if later:
            np.testing.assert_allclose(c.Q[1:3], want)
            assert not np.allclose(c.Q[1:3], c.P[1:3])
        else:
            np.testing.assert_array_equal(c.Q[1:3], c.P[1:3])
    assert len(p.models.next.coef) == 6 and p.models.follow is not None
    for name, n in (("logistic_no_follow", 5), ("logistic_no_recency", 4)):
        old = PREDICTORS.build("reuse_prob", dims=tr.dims, next_model=name, knn=False,
                               knn_ahead=False)
        old.fit(tr.split("store"))
        assert len(old.models.next.coef) == n and old.models.follow is None


def test_fit_refuses_test_requests_and_bad_settings() -> None:
    tr = trace()
    p = PREDICTORS.build("reuse_prob", dims=tr.dims)
    with pytest.raises(ConfigError, match="outside the store"):
        p.fit(tr)
    with pytest.raises(ConfigError, match="before fit"):
        p.observe_layer(observation(tr, 0, 0))
    for bad in ({"depth": 0}, {"min_prob": 1.5}, {"alpha": 0.0}, {"max_per_layer": -1},
                {"next_model": "logistic5"}, {"later": "flase"}, {"later": 1},
                {"horizon": "yes"}, {"horizons": []}, {"horizons": [4, 2]},
                {"horizons": [1, 2]}, {"horizons": [2, 2]}, {"horizons": [2, 300]},
                {"horizons": [2.5]}, {"horizons": 8}, {"horizons": [2, "4"]},
                {"knn_rows": 0}, {"knn_rows": 1.5}, {"knn_rows": True}, {"knn_rows": "8192"}):
        with pytest.raises(ConfigError):
            PREDICTORS.build("reuse_prob", dims=tr.dims, **bad)


def test_knn_rows_caps_the_index_at_a_sample_of_the_store_tokens() -> None:
    """``knn_rows`` bounds the trajectory index: below the store's decode pairs it keeps
    that many (a seeded sample of them, store requests only); the default keeps them all
    here."""
    tr = trace()
    store = tr.split("store")
    full = PREDICTORS.build("reuse_prob", dims=tr.dims)
    full.fit(store)
    n = len(full.models.knn)
    assert full.knn_rows == rf.KNN_ROWS and 4 <= n < rf.KNN_ROWS
    small = PREDICTORS.build("reuse_prob", dims=tr.dims, knn_rows=n // 2)
    small.fit(store)
    assert len(small.models.knn) == n // 2
    assert set(small.models.knn.request) <= set(full.models.knn.request)
    assert set(full.models.knn.request) <= {r.request_id for r in store.requests}


def cost(tr, gbps: float) -> CostModel:
    prof = dataclasses.replace(load_profile("rtx3090_pcie4"), h2d_gbps=gbps)
    return CostModel.from_profile(prof, tr.dims)


def replay(tr, gbps: float, gate: bool = True):
    pred = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2)
    cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8, gate=gate)
    pred.fit(tr.split("store"))
    cache.fit(tr.split("store"))
    m = simulate(tr.split("test"), pred, cache, cost(tr, gbps), progress=False).metrics
    return m, cache


def test_bind_hands_the_cost_model_to_the_cache_and_the_gate_follows_the_link() -> None:
    """The simulator binds the cost model: the cache knows the copy time and each pass's
    compute window. On a very slow link the gate takes fewer prefetches than on a fast one,
    and fewer than without the gate at the same link."""
    tr = trace()
    fast, c_fast = replay(tr, 1000.0)
    slow, c_slow = replay(tr, 0.01)
    open_gate, _ = replay(tr, 0.01, gate=False)
    assert c_slow.copy_s == pytest.approx(cost(tr, 0.01).copy_s)
    assert c_slow.window_s is not None and c_slow.window_s > 0
    assert c_slow.copy_s > c_slow.window_s > c_fast.copy_s
    assert c_slow.expert_s is not None and 0 < c_slow.expert_s < c_slow.window_s
    assert slow["prefetches_issued"] < fast["prefetches_issued"]
    assert slow["prefetches_issued"] < open_gate["prefetches_issued"]
    assert fast["hit_rate"] > 0 and np.isfinite(fast["predictor_query_us_mean"])


def test_spec_auto_reads_the_gates_where_the_trace_records_them() -> None:
    """``spec: auto`` needs the gates after a fit on a store that records them (and its
    layers-ahead scores move with them); ``off`` or a routing-only store needs nothing."""
    tr = trace()
    auto = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2)
    auto.fit(tr.split("store"))
    assert auto.needs == frozenset({"spec_probs"})
    obs = observation(tr, 1, 0)
    sure = np.zeros((1, 2, 8), np.float32)
    sure[0, :, 3] = 1.0
    other = np.zeros((1, 2, 8), np.float32)
    other[0, :, 5] = 1.0
    a = auto.observe_layer(dataclasses.replace(obs, spec_probs=sure)).scores
    b = auto.observe_layer(dataclasses.replace(obs, spec_probs=other)).scores
    assert a[1][3] > b[1][3] and b[1][5] > a[1][5]
    off = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, spec="off")
    off.fit(tr.split("store"))
    assert off.needs == frozenset()
    bare = dataclasses.replace(tr, spec_probs=None,
                               dims=dataclasses.replace(tr.dims, spec_depth=0))
    plain = PREDICTORS.build("reuse_prob", dims=bare.dims, depth=2)
    plain.fit(bare.split("store"))
    assert plain.needs == frozenset()
    with pytest.raises(ConfigError, match="spec"):
        PREDICTORS.build("reuse_prob", dims=tr.dims, spec="on")


def test_a_prefill_pass_scores_every_layer_ahead_a_decode_pass_its_depth() -> None:
    tr = trace()
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=1)
    p.fit(tr.split("store"))
    for T, want in ((1, [0, 1]), (6, [0, 1, 2, 3])):
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=int(T == 1),
                                         embed=None, token_request=np.zeros(T, int)))
        assert sorted(p.observe_layer(observation(tr, 0, 0)).scores) == want


def test_horizon_hands_the_cache_within_rows_and_false_hands_none() -> None:
    """With ``horizon`` (the default) the bound next_use cache gets the horizons and, at
    each layer, rows float[H, J] for the layer that ran and the layers ahead (those: used
    now or within h passes after, so at least this pass's probability); ``horizon=false``
    gives it none and the sixth stage's ranking."""
    tr = trace()
    store = tr.split("store")
    for horizon in (True, False):
        p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, horizon=horizon)
        cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8)
        p.fit(store)
        cache.fit(store)
        p.bind(cost(tr, 1.0), [cache])
        if not horizon:
            assert cache.horizons == () and cache.W is None and not p.models.within
            continue
        assert cache.horizons == rf.HORIZONS
        seen: dict[int, np.ndarray] = {}
        cache.observe_within = seen.update  # type: ignore[method-assign]
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                         token_request=np.zeros(1, np.int64)))
        out = p.observe_layer(observation(store, 1, 0))
        assert set(seen) == {0, 1, 2}
        assert all(r.shape == (len(rf.HORIZONS), 8) for r in seen.values())
        for layer in (1, 2):  # never below this pass's probability
            assert (seen[layer] >= out.scores[layer][None, :] - 1e-12).all()
        assert (np.diff(seen[0], axis=0) >= -1e-12).all()  # more passes, more likely
    # other horizons: fitted, handed to the cache and its rows, one per h
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, horizons=[3, 32])
    cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8)
    p.fit(store)
    cache.fit(store)
    p.bind(cost(tr, 1.0), [cache])
    assert cache.horizons == (3, 32) and sorted(p.models.within) == [3, 32]
    seen = {}
    cache.observe_within = seen.update  # type: ignore[method-assign]
    p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                     token_request=np.zeros(1, np.int64)))
    p.observe_layer(observation(store, 1, 0))
    assert all(r.shape == (2, 8) for r in seen.values())
    assert (np.diff(seen[0], axis=0) >= -1e-12).all()


def test_the_feed_gate_rests_a_predictor_no_stall_can_pay_for_and_is_inert_without_a_cost() -> None:
    """With a feed cost above anything the misses could cost (f = 10 copies per layer, top-2
    routing: at most 2 misses a layer), ``prefetch_if_pays`` never feeds its predictor: with
    ``rest_prefetch`` off it is then on-demand LRU (the same hits and TPOT as ``none`` +
    ``lru``) and faster than the same system always fed; with it on (the default) it also
    takes resting offers that pay (here on a fast link: on the slow one none does). Without
    a feed cost,
    the gate changes nothing: every metric equals the run with ``feed_gate=false``."""
    tr = trace()
    c = cost(tr, 1.0)

    def run(feed: float, feed_gate: bool, rest: bool = False,  # type: ignore[no-untyped-def]
            c=c):
        pred = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2)
        cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8,
                             feed_gate=feed_gate, rest_prefetch=rest)
        pred.fit(tr.split("store"))
        cache.fit(tr.split("store"))
        return simulate(tr.split("test"), pred, cache, c, progress=False,
                        predictor_feed_s=feed).metrics

    f = 10 * c.copy_s
    gated, always = run(f, True), run(f, False)
    assert gated["predictor_feed_switches"] == 0.0
    assert gated["predictor_feed_rested_share"] == 1.0 and gated["prefetches_issued"] == 0
    assert run(f, True, rest=True)["prefetches_issued"] == 0  # a slow link: none pays
    fast = cost(tr, 100.0)
    rest = run(10 * fast.copy_s, True, rest=True, c=fast)
    assert rest["predictor_feed_rested_share"] == 1.0 and rest["prefetches_issued"] > 0
    assert gated["tpot_ms_mean"] < always["tpot_ms_mean"]
    assert "predictor_feed_switches" not in always
    lru = simulate(tr.split("test"), PREDICTORS.build("none", dims=tr.dims),
                   CACHES.build("lru", capacity_slots=8, num_layers=4, num_experts=8), c,
                   progress=False).metrics
    for k in ("hit_rate", "tpot_ms_mean", "ttft_ms_mean", "h2d_bytes_total"):
        assert gated[k] == lru[k], k
    free_on, free_off = run(0.0, True), run(0.0, False)
    wall = {"sim_wall_s", "accesses_per_s", "predictor_query_us_mean"}
    assert free_on.keys() == free_off.keys()
    for k in free_on.keys() - wall:
        a, b = free_on[k], free_off[k]
        assert a == b or (a != a and b != b), k  # NaN where undefined


def resting_pair(tr, **cache_kw):  # type: ignore[no-untyped-def]
    """``reuse_prob`` bound to a fitted ``next_use`` cache (8 slots, ``cache_kw`` its
    options) with a feed cost of 1 s a layer, so its gate starts resting."""
    pred = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2)
    cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8,
                         **cache_kw)
    pred.fit(tr.split("store"))
    cache.fit(tr.split("store"))
    pred.bind(cost(tr, 1.0), [cache])
    pred.set_feed_cost(1.0)
    return pred, cache


def test_a_rested_layer_passes_on_the_caches_next_layer_offers_in_decode_only() -> None:
    """``rest_layer`` folds the layer's routing into every bound cache's resting use
    patterns and, in a one-token pass, offers the cache's top ``top_k`` of the next layer
    by resting probability (experts used lately only; priority below 1, best first); in a
    prefill it folds the routing and offers nothing."""
    p, c = resting_pair(trace(), rest_buckets=1)  # one table: P(0) ranks last
    assert not p.feeding()  # the gate starts resting
    assert p.rest_layer(RestLayer(2, 1, np.array([4, 6]))).prefetch == []  # layer 3 unseen
    assert p.rest_layer(RestLayer(3, 5, np.array([1, 5, 7]))).prefetch == []  # a prefill
    g = c.feed_gate
    assert g is not None and g.history[3].tolist() == [0, 1, 0, 0, 0, 1, 0, 1]
    p.rest_layer(RestLayer(3, 1, np.array([5])))
    out = p.rest_layer(RestLayer(2, 1, np.array([4])))
    got = [(pf.layer, pf.expert) for pf in out.prefetch]
    probs = [g.rest_prob(k) for k in got]
    assert len(got) == 2 and {k[0] for k in got} == {3} and {k[1] for k in got} < {1, 5, 7}
    assert probs == sorted(probs, reverse=True) and min(probs) >= g.rest_prob((3, 0))
    assert 1.0 >= out.prefetch[0].priority > out.prefetch[1].priority
    assert p.rest_layer(RestLayer(3, 1, np.array([5]))).prefetch == []  # the last layer
    # a rested decode pass's first layer prices its compute window for the gate (no fed pass
    # yet: no dense part), as a fed pass's first observation does
    assert c.window_s is None
    p.rest_layer(RestLayer(0, 1, np.array([2, 3])))
    counts = np.zeros(8, dtype=np.int64)
    counts[[2, 3]] = 1
    assert c.window_s == p._cost.experts_s(counts) > 0
    assert c.expert_s == pytest.approx(p._cost.experts_s(counts) / 2)  # one used expert's


def test_fed_again_the_reuse_state_catches_up_on_the_rested_passes() -> None:
    """When the gate feeds the predictor again, ``feeding`` first moves the reuse state on by
    the rested passes' routing the cache kept (one ``update_all`` each, oldest first), so
    recency and the averages are current; a fed pass with nothing kept leaves it alone."""
    from moeexp.predictors.reuse_features import ReuseState

    tr = trace()
    pred, cache = resting_pair(tr)
    g = cache.feed_gate
    assert g is not None
    rng = np.random.default_rng(0)
    kept = [rng.random((4, 8)) < 0.3 for _ in range(3)]
    pred.state.update(0, np.ones(8))
    want = ReuseState.zeros(4, 8)
    want.update(0, np.ones(8))
    for used in kept:
        want.update_all(used.astype(np.float64))
    g._rested.extend([[(int(a), int(b)) for a, b in zip(*np.nonzero(u), strict=True)]
                      for u in kept])  # each rested pass's accesses
    g.fed = True  # the pass that begins is fed (a window is under way)
    assert pred.feeding()
    assert np.array_equal(pred.state.feat, want.feat) and np.array_equal(pred.state.rec, want.rec)
    assert pred.feeding() and np.array_equal(pred.state.feat, want.feat)  # nothing kept now


def test_knn_within_gives_each_horizon_its_own_knn_column() -> None:
    """``knn`` with ``knn_within`` (the default): the within row of a layer that ran is
    each within[h] model on the next model's features with the kNN column swapped for the
    neighbours' within-h share; with ``knn_within=false`` every h reads the next token's."""
    tr = random_trace(num_layers=4, num_experts=8, top_k=2, num_requests=16, output_len=14,
                      seed=6)
    store = tr.split("store")
    its = [i for i in range(len(tr.iter_offsets) - 1) if np.diff(tr.iter_offsets)[i] == 1]
    for within in (True, False):
        p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, knn=True,
                             knn_within=within)
        cache = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8)
        p.fit(store)
        cache.fit(store)
        p.bind(cost(tr, 1.0), [cache])
        assert p.models.knn.tgt.shape[2] == (1 + len(rf.HORIZONS) if within else 1)
        seen: dict[int, np.ndarray] = {}
        cache.observe_within = seen.update  # type: ignore[method-assign]
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                         token_request=np.zeros(1, np.int64)))
        p.observe_layer(observation(tr, its[0], 0))
        knn = p._knn_rows[:, 0]  # [H1, J], this token's rows at layer 0
        assert not within or not np.allclose(knn[1:], knn[0])  # the swap is visible
        for i, h in enumerate(rf.HORIZONS):
            col = knn[1 + i] if within else knn[0]
            X = rf.next_features(p.state, p.models.logpop, 0, follow=p.models.follow,
                                 knn_col=col)
            want = rf.sigmoid(X @ p.models.within[h].coef + p.models.within[h].intercept)
            assert np.allclose(seen[0][i], want)


def test_knn_ahead_adds_the_neighbours_use_to_every_ahead_model() -> None:
    """``knn_ahead``: each ahead model has one more coefficient, and a decode layer's
    scores ahead are those models on the state, the carried evidence and the index's
    :meth:`ahead` rows; it acts only with ``knn``."""
    tr = random_trace(num_layers=4, num_experts=8, top_k=2, num_requests=16, output_len=14,
                      seed=6)
    store = tr.split("store")
    alone = PREDICTORS.build("reuse_prob", dims=tr.dims, knn=False, knn_ahead=True)
    assert not alone.knn_ahead  # it acts only with the index knn builds
    lrb = PREDICTORS.build("reuse_prob", dims=tr.dims, next_model="lrb")
    assert not lrb.knn and not lrb.knn_ahead  # the kNN column is the logistic model's
    base = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, knn=True, knn_ahead=False)
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, knn=True, knn_ahead=True)
    base.fit(store)
    p.fit(store)
    assert p._coef[0].shape[1] == base._coef[0].shape[1] + 1
    assert p._coef[1].shape[1] == base._coef[1].shape[1] + 1
    its = [i for i in range(len(tr.iter_offsets) - 1) if np.diff(tr.iter_offsets)[i] == 1]
    p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                     token_request=np.zeros(1, np.int64)))
    obs = observation(tr, its[0], 0)
    out = p.observe_layer(obs)
    ka = p.models.knn.ahead(0, 2)
    extra = rf.carried(obs.counts, p._from[0])
    want = p._ahead(0, 2, extra, None, ka)
    assert np.allclose(out.scores[1], want[0]) and np.allclose(out.scores[2], want[1])
    assert not np.allclose(want, p._ahead(0, 2, extra, None, None))  # the column is read


def test_under_all_experts_every_expert_of_the_layers_ahead_is_offered() -> None:
    """A ``next_use`` cache under ``demand_load=all_experts`` takes every offer (each layer
    copies all its experts anyway): the bound predictor then offers all J experts of each
    layer ahead, not only those over ``min_prob``, nearer layers first; under ``activated``
    the floor is ``min_prob`` again."""
    tr = trace()
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, min_prob=0.5)
    # fill=False: the empty cache would also be offered fills (below every offer)
    c = CACHES.build("next_use", capacity_slots=8, num_layers=4, num_experts=8, fill=False)
    p.fit(tr.split("store"))
    p.bind(cost(tr, 32.0), [c])
    start = IterationStart(request_ids=np.array([0]), step=1, embed=None,
                           token_request=np.array([0]))
    p.start_iteration(start)
    few = p.observe_layer(observation(tr, 1, 0)).prefetch
    assert len(few) < 16 and all(pf.priority % 1 >= 0.5 for pf in few)
    c.set_mechanics(demand_load="all_experts")
    assert c.takes_every_offer()
    p.start_iteration(start)
    every = p.observe_layer(observation(tr, 1, 0)).prefetch
    assert sorted((pf.layer, pf.expert) for pf in every) == [(t, e) for t in (1, 2)
                                                             for e in range(8)]
    assert min(pf.priority for pf in every if pf.layer == 1) > max(
        pf.priority for pf in every if pf.layer == 2)
    c.set_mechanics(demand_load="activated")
    assert not c.takes_every_offer()


def test_fills_are_offered_below_every_offer_only_while_a_fill_cache_has_room() -> None:
    """A bound ``next_use`` cache with ``fill`` and a free slot gets, besides this pass's
    offers (p >= the floor), fills: experts of every layer ahead left out of those offers
    whose chance of use within the longest horizon is >= ``min_prob``, each at a priority
    below every offer. Without ``fill``, or with the cache full, the offers are the same
    as before."""
    tr = trace()
    offers = {}
    for fill, full in ((False, False), (True, False), (True, True)):
        p = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=1, min_prob=0.5)
        c = CACHES.build("next_use", capacity_slots=4, num_layers=4, num_experts=8, fill=fill)
        p.fit(tr.split("store"))
        p.bind(cost(tr, 32.0), [c])
        if full:
            for e in range(4):
                c.on_insert((3, e), 0, False)
        p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                         token_request=np.array([0])))
        offers[fill, full] = p.observe_layer(observation(tr, 1, 0)).prefetch
    plain = offers[False, False]
    assert plain and all(pf.layer == 1 and pf.priority >= 0 for pf in plain)
    assert offers[True, True] == plain
    fills = [pf for pf in offers[True, False] if pf not in plain]
    assert [pf for pf in offers[True, False] if pf in plain] == plain
    assert fills and all(-1.0 < pf.priority < 0.0 for pf in fills)
    assert {pf.layer for pf in fills} > {1}  # layers past this pass's reach too
    assert not {(pf.layer, pf.expert) for pf in fills} & {(pf.layer, pf.expert) for pf in plain}


def test_a_decode_pass_of_several_requests_reads_the_models_without_the_knn() -> None:
    """The kNN index holds one request's trajectories, so a decode pass of several requests
    (continuous batching) has no kNN row: its next-pass and within models are the ones
    fitted on the same rows without the kNN column, which are the ``knn=false`` models. A
    pass of one request reads the kNN models."""
    tr = random_trace(num_layers=4, num_experts=8, top_k=2, num_requests=16, output_len=14,
                      seed=6)
    store = tr.split("store")
    knn = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, knn=True, knn_ahead=False)
    plain = PREDICTORS.build("reuse_prob", dims=tr.dims, depth=2, knn=False, knn_ahead=False)
    for p in (knn, plain):
        p.fit(store)
        p.bind(cost(tr, 32.0), [CACHES.build("next_use", capacity_slots=8, num_layers=4,
                                             num_experts=8)])
    assert knn.models.plain is not None and plain.models.plain is None
    np.testing.assert_allclose(knn.models.plain[0].coef, plain.models.next.coef)
    its = [i for i in range(len(tr.iter_offsets) - 1) if np.diff(tr.iter_offsets)[i] == 1]
    for ids, same in ((np.array([0, 1]), True), (np.array([0]), False)):
        outs, rows = [], []
        for p in (knn, plain):
            p.start_iteration(IterationStart(request_ids=ids, step=3, embed=None,
                                             token_request=ids))
            outs.append(p.observe_layer(observation(tr, its[3], 0)).scores[0])
            rows.append(p._within(0))  # float64[H, J]: what the cache ranks eviction by
        assert np.allclose(outs[0], outs[1]) == same
        assert np.allclose(rows[0], rows[1]) == same
