"""Metric definitions: prediction recall/precision per (pass, layer), latency series."""

from __future__ import annotations

import math

import pytest
from tests.unit.simulator.simhelpers import ScriptedPredictor, hand_trace, unit_cost

from moeexp.cache.lru import LRUCache
from moeexp.simulator import simulate
from moeexp.simulator.report import Tally

ROUTE = [[[[[3], [0], [0]]]]]  # one pass; layer 0 -> 3, layers 1 and 2 -> 0


def test_tally_prediction_definitions() -> None:
    """P={0,1}, A={0}: recall 1, precision 1/2. P empty: recall 0, no precision term."""
    t = Tally(num_layers=2)
    t.pred.add({0, 1}, [0])
    t.pred.add(None, [2, 3])
    assert t.pred.recall == 0.5
    assert t.pred.precision == 0.5


def test_recall_from_prefetches_made_before_the_router() -> None:
    """At iteration start the predictor prefetches {0, 1} for layer 1 (needs 0): layer 1
    recall 1, precision 1/2; layers 0 and 2 have no prediction: recall 0. Mean recall 1/3,
    precision 1/2. A prefetch for layer 2 issued after layer 2's router does not count."""
    tr = hand_trace(ROUTE, 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 1, 0), (1.0, 1, 1)],
                             at_layer={2: [(1.0, 2, 0)]})
    m = simulate(tr, pred, LRUCache(capacity_slots=6, num_layers=3, num_experts=4),
                 unit_cost(tr.dims), progress=False).metrics
    assert m["prediction_recall"] == pytest.approx(1 / 3)
    assert m["prediction_precision"] == pytest.approx(0.5)
    assert m["prediction_f1"] == pytest.approx(2 * 0.5 / 3 / (0.5 + 1 / 3))


def test_predicted_overrides_prefetches() -> None:
    """``predicted`` {2: [0]} counts for layer 2 even though nothing is prefetched for it:
    layer 2 recall 1 and precision 1; recall mean 1/3."""
    tr = hand_trace(ROUTE, 4)
    pred = ScriptedPredictor(dims=tr.dims, predicted={2: [0]})
    m = simulate(tr, pred, LRUCache(capacity_slots=6, num_layers=3, num_experts=4),
                 unit_cost(tr.dims), progress=False).metrics
    assert m["prediction_recall"] == pytest.approx(1 / 3)
    assert m["prediction_precision"] == 1.0


def test_latency_series_and_tpot() -> None:
    """Prefill then 2 decode steps on one layer, all experts resident from a full cache:
    TTFT = first pass; TPOT = (e2e - TTFT) / 2; without decode steps TPOT is NaN."""
    tr = hand_trace([[[[[0]]], [[[0]]], [[[0]]]], [[[[1]]]]], 2)
    r = simulate(tr, ScriptedPredictor(dims=tr.dims), LRUCache(capacity_slots=2, num_layers=1,
                 num_experts=2), unit_cost(tr.dims), progress=False)
    s = r.series
    assert s["tpot_ms"][0] == pytest.approx((s["e2e_ms"][0] - s["ttft_ms"][0]) / 2)
    assert s["tpot_ms"][0] == pytest.approx(200, abs=1e-3)  # dense 0.1 + expert 0.1, a hit
    assert math.isnan(s["tpot_ms"][1])
    assert len(s["iter_hits"]) == 4 and sum(s["iter_misses"]) == 2
