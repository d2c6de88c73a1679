"""layer_transition: P(e_{l+1} | e_l) with Laplace smoothing, chained for distance d."""

from __future__ import annotations

import numpy as np

from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import LayerObservation
from moeexp.predictors.layer_transition import transition_counts
from moeexp.traces.synthetic import random_trace


def chain_trace(J: int = 4, L: int = 4):
    """K = 1 routing where layer l expert e is always followed by expert (e + 1) % J."""
    tr = random_trace(num_layers=L, num_experts=J, top_k=1, num_requests=4, prompt_len=6,
                      output_len=3, store_fraction=1.0, seed=3)
    first = np.arange(tr.num_tokens) % J
    for layer in range(L):
        tr.topk_idx[:, layer, 0] = (first + layer) % J
    return tr


def observe(layer: int, expert: int, J: int = 4) -> LayerObservation:
    counts = np.zeros(J, dtype=np.int64)
    counts[expert] = 1
    return LayerObservation(layer=layer, probs=np.eye(J, dtype=np.float32)[[expert]],
                            experts=np.array([expert]), counts=counts)


def test_counts_and_laplace_smoothing() -> None:
    """The chain gives C[l, a, (a+1)%4] = tokens starting at a, zero elsewhere. With
    alpha = 1 a row with n counts on one pair gives P = (n+1)/(n+4) there, 1/(n+4) elsewhere."""
    tr = chain_trace()
    C = transition_counts(tr)
    n = C[0, 0, 1]
    assert n > 0 and C[0, 0].sum() == n and C[2, 3, 0] == C[2, 3].sum()
    p = PREDICTORS.build("layer_transition", dims=tr.dims, alpha=1.0)
    p.fit(tr)
    np.testing.assert_allclose(p.trans[0, 0], [1 / (n + 4), (n + 1) / (n + 4), 1 / (n + 4),
                                               1 / (n + 4)])
    np.testing.assert_allclose(p.trans.sum(axis=-1), 1.0)


def test_deterministic_chain_is_predicted_at_distance_1_and_2() -> None:
    """Observing expert 2 at layer 0 predicts (2+1)%4 = 3 at layer 1 (d=1) and
    (2+2)%4 = 0 at layer 2 (d=2: the matrices chained); expert 3 at layer 1 with d=2 ->
    (3+2)%4 = 1 at layer 3; nothing beyond the last layer."""
    tr = chain_trace()
    p1 = PREDICTORS.build("layer_transition", dims=tr.dims, distance=1, alpha=0.01, top_n=1)
    p1.fit(tr)
    assert {k: v.tolist() for k, v in p1.observe_layer(observe(0, 2)).predicted.items()} == {1: [3]}
    p2 = PREDICTORS.build("layer_transition", dims=tr.dims, distance=2, alpha=0.01, top_n=1)
    p2.fit(tr)
    assert {k: v.tolist() for k, v in p2.observe_layer(observe(0, 2)).predicted.items()} == {2: [0]}
    assert p2.observe_layer(observe(1, 3)).predicted[3].tolist() == [1]
    assert p2.observe_layer(observe(2, 0)).prefetch == []


def test_prefill_predicts_as_many_experts_as_it_observed() -> None:
    """Three distinct experts observed at layer 0 (K=1, top_n default 1) -> three experts
    predicted for layer 1: the successors {1, 2, 3} of {0, 1, 2}."""
    tr = chain_trace()
    p = PREDICTORS.build("layer_transition", dims=tr.dims, alpha=0.01)
    p.fit(tr)
    counts = np.array([1, 1, 1, 0])
    out = p.observe_layer(LayerObservation(0, np.zeros((3, 4), np.float32),
                                           np.array([0, 1, 2]), counts))
    assert sorted(out.predicted[1].tolist()) == [1, 2, 3]
