"""``oracle``: prefetches the true experts of upcoming layers, nearest first."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation
from moeexp.predictors.oracle import OraclePredictor
from moeexp.traces.schema import TraceDims

DIMS = TraceDims(num_layers=3, num_experts=4, top_k=1, hidden_size=2, spec_depth=0, expert_bytes=8)
FUTURE = (np.array([1]), np.array([0, 2]), np.array([3]))


def _start(pred, future=FUTURE):  # type: ignore[no-untyped-def]
    return pred.start_iteration(IterationStart(request_ids=np.array([0]), step=0,
                                               embed=np.zeros((1, 2), np.float32),
                                               token_request=np.array([0]), future=future))


def _obs(layer: int) -> LayerObservation:
    return LayerObservation(layer=layer, probs=np.zeros((1, 4), np.float32),
                            experts=FUTURE[layer], counts=np.zeros(4, np.int64))


def test_iteration_start_prefetches_every_layer_nearest_first() -> None:
    """Layers 0, 1, 2 get priorities 3, 2, 1; predicted = the true experts of every layer."""
    pred = PREDICTORS.build("oracle", dims=DIMS)
    assert pred.needs == frozenset({"future"})
    p = _start(pred)
    assert [(x.priority, x.layer, x.expert) for x in p.prefetch] == [
        (3.0, 0, 1), (2.0, 1, 0), (2.0, 1, 2), (1.0, 2, 3)]
    assert {k: v.tolist() for k, v in p.predicted.items()} == {0: [1], 1: [0, 2], 2: [3]}


def test_reissue_and_lookahead() -> None:
    """After layer 0: reissue gives layers 1..2; lookahead=1 gives only layer 1 (at start
    only layer 0); without reissue only the layer entering the window."""
    pred = OraclePredictor(dims=DIMS)
    _start(pred)
    assert [(x.layer, x.expert) for x in pred.observe_layer(_obs(0)).prefetch] == [(1, 0), (1, 2), (2, 3)]
    assert pred.observe_layer(_obs(2)).prefetch == []
    one = OraclePredictor(dims=DIMS, lookahead=1, reissue=False)
    assert [(x.layer, x.expert) for x in _start(one).prefetch] == [(0, 1)]
    assert [(x.layer, x.expert) for x in one.observe_layer(_obs(0)).prefetch] == [(1, 0), (1, 2)]
    assert [(x.layer, x.expert) for x in one.observe_layer(_obs(1)).prefetch] == [(2, 3)]


def test_without_future_or_bad_lookahead_fails() -> None:
    """The mechanism must pass the future; lookahead must be >= 1."""
    with pytest.raises(ConfigError, match="future"):
        _start(OraclePredictor(dims=DIMS), future=None)
    with pytest.raises(ConfigError, match="lookahead"):
        OraclePredictor(dims=DIMS, lookahead=0)
