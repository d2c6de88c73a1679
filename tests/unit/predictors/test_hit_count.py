"""FineMoE's "hit count" ablation predictor: most counted experts per layer."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation
from moeexp.predictors.hit_count import HitCountPredictor
from moeexp.traces.synthetic import random_trace


def start(pred: HitCountPredictor) -> list[tuple[int, int, float]]:
    got = pred.start_iteration(IterationStart(
        request_ids=np.array([0]), step=1, embed=np.zeros((1, 16), dtype=np.float32),
        token_request=np.array([0])))
    return [(f.layer, f.expert, round(f.priority, 6)) for f in got.prefetch]


def observe(pred: HitCountPredictor, layer: int, counts: np.ndarray) -> list[tuple[int, int, float]]:
    got = pred.observe_layer(LayerObservation(
        layer=layer, probs=np.full((1, len(counts)), 1 / len(counts), dtype=np.float32),
        experts=np.flatnonzero(counts), counts=counts))
    return [(f.layer, f.expert, round(f.priority, 6)) for f in got.prefetch]


def test_counts_come_from_the_store_split_only() -> None:
    """fit() on a whole trace counts the selected experts of the store requests' tokens:
    the sum of their iterations' count matrices; the test requests add nothing."""
    trace = random_trace(num_requests=8, prompt_len=3, output_len=3, seed=1)
    pred = HitCountPredictor(dims=trace.dims, prefetch_distance=2)
    pred.fit(trace)
    store = trace.split("store")
    want = sum(store.iteration_counts(i) for i in range(store.num_iterations))
    np.testing.assert_array_equal(pred.counts, want)


def test_top_counted_experts_with_distance_priorities() -> None:
    """L = 4, J = 8, K = 2, d = 2 (random_trace dims). Hand counts: layer 0 [6, 3, 1, 0..],
    layer 1 [0, 0, 5, 5, 0..], layer 2 [1, 1, 1, 1, 0, 0, 0, 4] (shares .125 × 4 and .5),
    layer 3 nothing. Start (l_now = −1): layer 0 → experts 0 (.6/1) and 1 (.3/1);
    layer 1 → 2 and 3 (.5/2 each). After layer 0: layer 2 → expert 7 (.5/2 = .25) then
    expert 0 (.125/2, first of the tied shares). After layer 1: layer 3 has no counts →
    nothing."""
    trace = random_trace(num_requests=2, seed=0)
    pred = HitCountPredictor(dims=trace.dims, prefetch_distance=2)
    counts = np.zeros((4, 8))
    counts[0, :3] = [6, 3, 1]
    counts[1, 2:4] = 5
    counts[2, [0, 1, 2, 3, 7]] = [1, 1, 1, 1, 4]
    pred.counts = counts
    assert start(pred) == [(0, 0, 0.6), (0, 1, 0.3), (1, 2, 0.25), (1, 3, 0.25)]
    assert observe(pred, 0, np.zeros(8, dtype=int)) == [(2, 7, 0.25), (2, 0, 0.0625)]
    assert observe(pred, 1, np.zeros(8, dtype=int)) == []


def test_online_mode_counts_the_history() -> None:
    """Online: fit() leaves zero counts, nothing is predicted until a layer has been seen;
    after layer 2 used experts 5 (3 tokens) and 6 (1), layer 2 is predicted as [5, 6]."""
    trace = random_trace(num_requests=2, seed=0)
    pred = PREDICTORS.build("hit_count", dims=trace.dims, prefetch_distance=2, mode="online")
    pred.fit(trace)
    assert not pred.counts.any() and start(pred) == []
    observe(pred, 2, np.array([0, 0, 0, 0, 0, 3, 1, 0]))
    assert observe(pred, 0, np.zeros(8, dtype=int)) == [(2, 5, 0.375), (2, 6, 0.125)]
    with pytest.raises(ConfigError, match="mode"):
        PREDICTORS.build("hit_count", dims=trace.dims, mode="history")
