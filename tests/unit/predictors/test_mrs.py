"""mrs predictor: router scores (top_p kept) to the cache, next layer's highest-S experts
prefetched in decode only."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import LayerObservation
from moeexp.traces.schema import TraceDims

DIMS = TraceDims(num_layers=3, num_experts=4, top_k=1, hidden_size=8, spec_depth=0,
                 expert_bytes=64)


def obs(layer: int, rows: list[list[float]]) -> LayerObservation:
    probs = np.asarray(rows, dtype=np.float32)
    return LayerObservation(layer=layer, probs=probs, experts=np.array([0]),
                            counts=np.zeros(4, dtype=np.int64))


def test_scores_sent_and_next_layer_prefetched_by_its_score() -> None:
    """top_p = 2K = 2. Layer 1's earlier pass ranks expert 3 highest: at layer 0 of a decode
    pass the prediction sends layer 0's row cut to its top 2 and prefetches (1, 3)."""
    p = PREDICTORS.build("mrs", dims=DIMS)
    p.observe_layer(obs(1, [[0.1, 0.2, 0.0, 0.7]]))
    pred = p.observe_layer(obs(0, [[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_allclose(pred.scores[0], [0.5, 0.3, 0.0, 0.0])
    assert [(f.layer, f.expert) for f in pred.prefetch] == [(1, 3)]
    np.testing.assert_allclose(p.scores[0], [0.25, 0.15, 0.0, 0.0])


def test_prefill_and_last_layer_prefetch_nothing() -> None:
    """A pass of 2 tokens (prefill) only sends the first token's scores; the last layer has
    no next layer; prefetch_size 0 never prefetches."""
    p = PREDICTORS.build("mrs", dims=DIMS)
    pred = p.observe_layer(obs(0, [[0.1, 0.2, 0.0, 0.7], [0.9, 0.1, 0.0, 0.0]]))
    assert pred.prefetch == [] and pred.scores[0][3] == pytest.approx(0.7)
    assert p.observe_layer(obs(2, [[0.1, 0.2, 0.0, 0.7]])).prefetch == []
    q = PREDICTORS.build("mrs", dims=DIMS, prefetch_size=0)
    q.observe_layer(obs(1, [[0.1, 0.2, 0.0, 0.7]]))
    assert q.observe_layer(obs(0, [[0.5, 0.3, 0.15, 0.05]])).prefetch == []
    with pytest.raises(ConfigError, match="prefetch_size"):
        PREDICTORS.build("mrs", dims=DIMS, prefetch_size=5)
