"""MoE-Infinity's EAM predictor: decayed prefetch scores, pEAM, collections, oss variant."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation, Prediction
from moeexp.predictors.eam import EAMCollection, EAMPredictor
from moeexp.predictors.expert_map_store import unit
from moeexp.traces.schema import TraceDims
from moeexp.traces.synthetic import random_trace

# Hand EAM, L = 4, J = 3: rows sum to 4, so pEAM = M / 4.
M = np.array([[4, 0, 0], [0, 3, 1], [1, 1, 2], [0, 0, 4]], dtype=float)


def dims(L: int = 4, J: int = 3, K: int = 1) -> TraceDims:
    return TraceDims(num_layers=L, num_experts=J, top_k=K, hidden_size=2, spec_depth=0,
                     expert_bytes=1)


def start(pred: EAMPredictor, step: int, rid: int = 0) -> Prediction:
    return pred.start_iteration(IterationStart(
        request_ids=np.array([rid]), step=step, embed=np.zeros((1, 2), dtype=np.float32),
        token_request=np.array([rid])))


def observe(pred: EAMPredictor, layer: int, counts: list[int]) -> Prediction:
    c = np.asarray(counts)
    return pred.observe_layer(LayerObservation(
        layer=layer, probs=np.full((1, len(c)), 1.0 / len(c), dtype=np.float32),
        experts=np.flatnonzero(c), counts=c))


def prefetches(pred: Prediction) -> list[tuple[int, int, float]]:
    return [(f.layer, f.expert, round(f.priority, 6)) for f in pred.prefetch]


def test_paper_decayed_prefetch_scores() -> None:
    """One stored prefill EAM M; after layer 0 of a prefill (counts [4, 0, 0]) the only
    match gives pEAM = M/4 and score pEAM[i][j]·(1 − (i − 0)/4) for i > 0:
    (1,1) .75·.75 = .5625, (1,2) .25·.75 = .1875, (2,0) = (2,1) = .25·.5 = .125,
    (2,2) .5·.5 = .25, (3,2) 1·.25 = .25. Descending (ties: nearer layer first):
    (1,1), (2,2), (3,2), (1,2), (2,0), (2,1); max_prefetch = J = 3 keeps the first three.
    predicted names layer 1 only: its top-K (K = 1) = {1}."""
    pred = EAMPredictor(dims=dims(), max_prefetch=10)
    pred.collections["prefill"].add(M)
    assert start(pred, step=0).prefetch == []  # nothing observed yet: no query
    got = observe(pred, 0, [4, 0, 0])
    assert prefetches(got) == [(1, 1, 0.5625), (2, 2, 0.25), (3, 2, 0.25), (1, 2, 0.1875),
                               (2, 0, 0.125), (2, 1, 0.125)]
    assert list(got.predicted) == [1] and got.predicted[1].tolist() == [1]
    np.testing.assert_allclose(got.scores[2], [0.25, 0.25, 0.5])
    short = EAMPredictor(dims=dims())
    short.collections["prefill"].add(M)
    start(short, step=0)
    assert prefetches(observe(short, 0, [4, 0, 0])) == [(1, 1, 0.5625), (2, 2, 0.25),
                                                         (3, 2, 0.25)]


def test_oss_decays_raw_counts_with_l_plus_one() -> None:
    """oss, same M in its single collection: score M[i][j]·(1 − (i − 0)/5) on raw counts:
    (1,1) 3·.8 = 2.4, (3,2) 4·.4 = 1.6, (2,2) 2·.6 = 1.2, (1,2) .8, (2,0) = (2,1) = .6 —
    an order the paper variant does not give ((2,2) before (3,2) there)."""
    pred = EAMPredictor(dims=dims(), variant="oss", max_prefetch=10)
    pred.collections["all"].add(M)
    start(pred, step=0)
    assert prefetches(observe(pred, 0, [4, 0, 0])) == [
        (1, 1, 2.4), (3, 2, 1.6), (2, 2, 1.2), (1, 2, 0.8), (2, 0, 0.6), (2, 1, 0.6)]
    assert pred.collections["all"].access.tolist()[0] == 2  # inserted (1) + one match


def test_per_layer_keeps_the_best_n_of_each_future_layer() -> None:
    """The artifact's MoE-Infinity (per_layer = top_k = K = 1): of the oss scores above,
    each future layer keeps its best expert only ((2,0) and (2,1) tie below (2,2)), and
    every future layer is requested (max_prefetch defaults to all): (1,1), (3,2), (2,2).
    With per_layer = 2 layer 2's tie goes to the lower expert: (2,2) then (2,0)."""
    one = EAMPredictor(dims=dims(), variant="oss", per_layer="top_k")
    one.collections["all"].add(M)
    start(one, step=0)
    assert prefetches(observe(one, 0, [4, 0, 0])) == [(1, 1, 2.4), (3, 2, 1.6), (2, 2, 1.2)]
    two = EAMPredictor(dims=dims(), variant="oss", per_layer=2)
    two.collections["all"].add(M)
    start(two, step=0)
    assert prefetches(observe(two, 0, [4, 0, 0])) == [
        (1, 1, 2.4), (3, 2, 1.6), (2, 2, 1.2), (1, 2, 0.8), (2, 0, 0.6)]
    for bad in (0, "k", True, 1.5):
        with pytest.raises(ConfigError, match="per_layer"):
            EAMPredictor(dims=dims(), per_layer=bad)


def test_top_n_matches_are_summed_then_row_normalised() -> None:
    """L = 2, J = 2. E1 = [[2,0],[1,1]], E2 = [[0,2],[0,2]]; query after layer 0 = [1,1]
    (flattened [1,1,0,0]): cos E1 = 2/(√2·√6) = .577, cos E2 = 2/(√2·√8) = .5.
    top_n = 1 → E1 → pEAM layer 1 = [.5, .5]; top_n = 2 → E1 + E2 = [[2,2],[1,3]] → [.25, .75]."""
    for top_n, want in [(1, [0.5, 0.5]), (2, [0.25, 0.75])]:
        pred = EAMPredictor(dims=dims(L=2, J=2), top_n=top_n)
        for e in ([[2, 0], [1, 1]], [[0, 2], [0, 2]]):
            pred.collections["prefill"].add(np.array(e, dtype=float))
        start(pred, step=0)
        np.testing.assert_allclose(observe(pred, 0, [1, 1]).scores[1], want)


def test_collection_replacement_paper_most_similar_oss_least_accessed() -> None:
    """Capacity 2 holding A = [[1,0],[1,0]] and B = [[0,1],[0,1]]; C = [[1,0],[.9,.1]] is
    most similar to A: the paper variant replaces A (slot 0). oss: A was matched twice
    (access 3, B 1), so C replaces the least-accessed B (slot 1)."""
    A, B, C = (np.array(x) for x in ([[1.0, 0], [1, 0]], [[0.0, 1], [0, 1]], [[1.0, 0], [.9, .1]]))
    paper = EAMCollection(2, 2, 2, "similar")
    paper.add(A), paper.add(B)
    assert paper.add(C) == 0 and np.allclose(paper.eams[0], C)
    oss = EAMCollection(2, 2, 2, "least_accessed")
    oss.add(A), oss.add(B)
    assert oss.match_layer_mean(A, 0) == 0 and oss.match_layer_mean(A, 0) == 0
    assert oss.access.tolist() == [3, 1]
    assert oss.add(C) == 1 and np.allclose(oss.eams[1], C)


def test_prefill_and_decode_kept_apart_and_decode_query_accumulates() -> None:
    """Paper: fit() puts one prefill EAM and one decode EAM per store request into separate
    collections (oss: one per request); the prefill EAM of request 0 is its step-0
    iteration's counts. A decode iteration's start already has a query (the request's
    previous decode iterations) and predicts layer 0; the prefill start has none."""
    trace = random_trace(num_requests=6, prompt_len=3, output_len=4, seed=2)
    n_store = sum(r.split == "store" for r in trace.requests)
    pred = EAMPredictor(dims=trace.dims)
    pred.fit(trace)  # test requests are ignored
    assert {p: c.size for p, c in pred.collections.items()} == {"prefill": n_store,
                                                                 "decode": n_store}
    np.testing.assert_array_equal(pred.collections["prefill"].eams[0], trace.iteration_counts(0))
    oss = EAMPredictor(dims=trace.dims, variant="oss")
    oss.fit(trace)
    assert oss.collections["all"].size == n_store
    L, J = trace.dims.num_layers, trace.dims.num_experts
    for step, expect in [(0, False), (1, False), (2, True)]:
        got = start(pred, step=step, rid=99)
        assert bool(got.prefetch) is expect and (0 in got.predicted) is expect
        for layer in range(L):
            observe(pred, layer, list(np.eye(J, dtype=int)[layer % J] * 3))
        pred.end_iteration()


def test_online_update_and_oss_prefetch_switch() -> None:
    """end_request adds the request's nonzero EAMs (online_update: true, the default) and
    adds nothing when false; oss_prefetch: false never prefetches nor predicts."""
    for online, grows in [(True, 1), (False, 0)]:
        pred = EAMPredictor(dims=dims(), online_update=online)
        pred.collections["prefill"].add(M)
        start(pred, step=0, rid=5)
        for layer in range(4):
            observe(pred, layer, [1, 1, 0])
        pred.end_iteration()
        pred.end_request(5)
        assert pred.collections["prefill"].size == 1 + grows
        assert pred.collections["decode"].size == 0
    off = EAMPredictor(dims=dims(), variant="oss", oss_prefetch=False)
    off.collections["all"].add(M)
    start(off, step=0)
    got = observe(off, 0, [4, 0, 0])
    assert got.prefetch == [] and got.predicted == {}


def test_capacity_defaults_and_errors() -> None:
    """Default capacity: 120 EAMs (paper), 1000 (oss); bad variant → ConfigError."""
    assert PREDICTORS.build("eam", dims=dims()).collections["decode"].capacity == 120
    assert PREDICTORS.build("eam", dims=dims(), variant="oss").collections["all"].capacity == 1000
    with pytest.raises(ConfigError, match="variant"):
        PREDICTORS.build("eam", dims=dims(), variant="v2")


def test_suffix_winners_are_the_exact_matches_or_none_on_a_near_tie() -> None:
    """Every first layer's winner is the row ``match_unit_rows`` returns for the query's
    suffix (40 random collections of count EAMs, L = 6, J = 4), and it counts no access;
    two equal stored EAMs tie at every first layer: None there (the exact product
    decides), while a third row that clearly wins is still named."""
    rng = np.random.default_rng(3)
    L, J = 6, 4
    named = 0
    for _ in range(40):
        coll = EAMCollection(1000, L, J, "least_accessed")
        for _ in range(int(rng.integers(1, 30))):
            coll.add(rng.integers(0, 5, size=(L, J)).astype(float))
        q = rng.integers(0, 5, size=(L, J)).astype(float)
        q_units = unit(q)
        before = coll.access.copy()
        winners = coll.suffix_winners(q_units)
        assert np.array_equal(coll.access, before)
        for f, w in enumerate(winners):
            if w is not None:
                assert w == coll.match_unit_rows(q_units[f:], f)
                named += 1
    assert named > 150  # of 240: the exact product is the exception
    tied = EAMCollection(10, 2, 2, "least_accessed")
    A, B = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[0.0, 1.0], [1.0, 0.0]])
    tied.add(A), tied.add(A)
    assert tied.suffix_winners(A) == [None, None]
    tied.add(B)
    assert tied.suffix_winners(B) == [2, 2]
