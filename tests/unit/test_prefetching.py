"""Prefetch queue and prediction-set rules (the simulator's)."""

from __future__ import annotations

import numpy as np

from moeexp.engine.prefetch import PredictionSets, PrefetchQueue
from moeexp.predictors.base import Prediction, Prefetch


def test_priority_dedupe_and_drops() -> None:
    """(2,1) asked at 1.0 then 5.0 is queued once at 5.0; (0,3) targets a layer <= current
    (0) and is dropped; resident (3,0) is skipped; pop order: 5.0 then 2.0."""
    q = PrefetchQueue(4, 4)
    n = q.push([Prefetch(1.0, 2, 1), Prefetch(5.0, 2, 1), Prefetch(2.0, 3, 2),
                Prefetch(9.0, 0, 3), Prefetch(9.0, 3, 0)], current_layer=0,
               is_resident={(3, 0)})
    assert n == 3 and len(q) == 2 and q.dropped == 1
    assert q.pop(current_layer=0) == (2, 1)
    assert q.pop(current_layer=2) == (3, 2)
    assert q.pop(current_layer=2) is None


def test_pop_drops_passed_layers_and_clear() -> None:
    q = PrefetchQueue(4, 4)
    q.push([Prefetch(3.0, 1, 0), Prefetch(2.0, 3, 1)], current_layer=-1, is_resident=set())
    assert q.pop(current_layer=2) == (3, 1)  # (1, 0) is for a layer that already ran
    assert q.dropped == 1
    q.push([Prefetch(1.0, 2, 2)], current_layer=-1, is_resident=set())
    q.clear()
    assert len(q) == 0 and q.dropped == 2 and q.pop(-1) is None


def test_prediction_sets() -> None:
    """predicted beats prefetched; a hook at layer l speaks only for layers > l."""
    ps = PredictionSets()
    ps.take(Prediction(prefetch=[Prefetch(1.0, 1, 2), Prefetch(1.0, 2, 0)]), hook_layer=-1)
    ps.take(Prediction(predicted={2: np.array([3, 4]), 0: np.array([1])}), hook_layer=0)
    assert ps.for_layer(1) == {2}
    assert ps.for_layer(2) == {3, 4}
    assert ps.for_layer(0) is None
    ps.clear()
    assert ps.for_layer(2) is None
