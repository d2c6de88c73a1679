"""speculative_gate and promoe: prefetch the top-K of the recorded speculative gate outputs."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import LayerObservation
from moeexp.predictors.speculative import aggregate_topk
from moeexp.traces.schema import TraceDims
from moeexp.traces.synthetic import random_trace

DIMS = TraceDims(num_layers=4, num_experts=4, top_k=2, hidden_size=2, spec_depth=2,
                 expert_bytes=1)


def obs(layer: int, spec: list, probs: list | None = None) -> LayerObservation:
    s = np.asarray(spec, dtype=np.float32)  # [T, D, J]
    p = np.asarray(probs if probs is not None else np.full((s.shape[0], 4), 0.25), np.float32)
    top = np.argsort(-p, axis=1)[:, :2]
    counts = np.bincount(top.reshape(-1), minlength=4)
    return LayerObservation(layer=layer, probs=p, experts=np.flatnonzero(counts), counts=counts,
                            spec_probs=s)


SPEC = [[[0.1, 0.5, 0.3, 0.1],    # d=1: gate_{l+1}(h_l)
         [0.4, 0.1, 0.1, 0.4]]]   # d=2: gate_{l+2}(h_l)


def test_speculative_prefetches_topk_of_spec_probs_at_distance_d() -> None:
    """At layer 1, d=1 reads spec[:, 0] = [.1,.5,.3,.1]: experts 1 then 2 for layer 2;
    d=2 reads spec[:, 1] = [.4,.1,.1,.4]: experts 0 then 3 (tie -> lower index) for layer 3."""
    p1 = PREDICTORS.build("speculative_gate", dims=DIMS, distance=1).observe_layer(obs(1, SPEC))
    assert [(f.layer, f.expert) for f in sorted(p1.prefetch, reverse=True)] == [(2, 1), (2, 2)]
    assert p1.predicted[2].tolist() == [1, 2]
    np.testing.assert_allclose(p1.scores[2], [0.1, 0.5, 0.3, 0.1], atol=1e-6)
    p2 = PREDICTORS.build("speculative_gate", dims=DIMS, distance=2).observe_layer(obs(1, SPEC))
    assert [(f.layer, f.expert) for f in sorted(p2.prefetch, reverse=True)] == [(3, 0), (3, 3)]


def test_speculative_beyond_last_layer_predicts_nothing() -> None:
    """Layer 3 is the last of 4: layer 3 + 1 does not exist -> empty prediction."""
    p = PREDICTORS.build("speculative_gate", dims=DIMS).observe_layer(obs(3, SPEC))
    assert p.prefetch == [] and p.predicted == {}


def test_union_over_tokens_orders_by_votes() -> None:
    """Token tops {0,1} and {1,2} (K=2): union {0,1,2}; expert 1 (2 votes) first, then by
    mean probability: 0 (.35) before 2 (.25). ``mean`` instead takes top-2 of the mean
    [.35,.5,.25,0]: experts 1, 0."""
    probs = np.array([[0.6, 0.4, 0.0, 0.0], [0.1, 0.6, 0.5, 0.0]])
    experts, mean = aggregate_topk(probs, 2, "union")
    assert experts.tolist() == [1, 0, 2]
    np.testing.assert_allclose(mean, [0.35, 0.5, 0.25, 0.0])
    assert aggregate_topk(probs, 2, "mean")[0].tolist() == [1, 0]


def test_promoe_uses_router_of_layer_l_plus_d_minus_1() -> None:
    """promoe with d=3 at layer 0: router of layer 0+3-1 = 2 on h_0 = spec distance 2
    ([.4,.1,.1,.4]) -> experts 0, 3 for layer 2. With d=2: spec distance 1 -> layer 1,
    experts 1, 2. With d=1: layer 0's own router (probs) for layer 0 itself."""
    p3 = PREDICTORS.build("promoe", dims=DIMS, distance=3).observe_layer(obs(0, SPEC))
    assert p3.predicted == {2: p3.predicted[2]} and p3.predicted[2].tolist() == [0, 3]
    p2 = PREDICTORS.build("promoe", dims=DIMS, distance=2).observe_layer(obs(0, SPEC))
    assert p2.predicted[1].tolist() == [1, 2]
    own = [[0.0, 0.2, 0.7, 0.1]]
    p1 = PREDICTORS.build("promoe", dims=DIMS, distance=1).observe_layer(obs(0, SPEC, own))
    assert p1.predicted[0].tolist() == [2, 1]


def test_fit_requires_spec_probs_with_enough_depth() -> None:
    """A trace without spec_probs, or recorded with spec_depth < d, is a ConfigError that
    names the trace option to set."""
    with pytest.raises(ConfigError, match="trace.spec_depth"):
        PREDICTORS.build("speculative_gate", dims=DIMS).fit(random_trace(spec_depth=0))
    with pytest.raises(ConfigError, match="trace.spec_depth >= 3"):
        PREDICTORS.build("speculative_gate", dims=DIMS, distance=3).fit(random_trace(spec_depth=2))
    with pytest.raises(ConfigError, match="trace.spec_depth"):
        PREDICTORS.build("promoe", dims=DIMS, distance=3).fit(random_trace(spec_depth=1))
    PREDICTORS.build("promoe", dims=DIMS, distance=3).fit(random_trace(spec_depth=2))


def test_bad_keys_fail() -> None:
    """distance 0 and unknown keys are ConfigErrors."""
    with pytest.raises(ConfigError):
        PREDICTORS.build("speculative_gate", dims=DIMS, distance=0)
    with pytest.raises(ConfigError, match="distance"):
        PREDICTORS.build("speculative_gate", dims=DIMS, distanse=1)


def test_distance_beyond_the_model_fails_at_construction() -> None:
    """With L = 4 MoE layers: speculative_gate reads gate_{l+d} (d <= 3), promoe the router of
    layer l+d-1 (d <= 4), layer_transition predicts layer l+d (d <= 3). A larger distance
    is a ConfigError when the predictor is built (the pipeline builds it with the model's
    dims before any weight is read), not after a trace was recorded."""
    for name, bad, ok in (("speculative_gate", 4, 3), ("promoe", 5, 4),
                          ("layer_transition", 4, 3)):
        with pytest.raises(ConfigError, match=f"{name}: distance must be in 1..{ok}.*4 MoE"):
            PREDICTORS.build(name, dims=DIMS, distance=bad)
        PREDICTORS.build(name, dims=DIMS, distance=ok)


def test_layer_prediction_memo_gives_the_same_prediction_and_is_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a memo: the same requests, experts and scores as without, the experts
    read-only and shared per (layer, experts); the memo is emptied at its cap."""
    import moeexp.predictors.speculative as spec
    from moeexp.predictors.speculative import layer_prediction

    made: spec.Made = {}
    scores = np.array([0.1, 0.5, 0.4, 0.0])
    for experts in ([1, 2], [2, 1], [1, 2]):
        e = np.array(experts, dtype=np.int64)
        plain, memo = layer_prediction(3, e, scores, 6), layer_prediction(3, e, scores, 6, made)
        assert memo.prefetch == plain.prefetch  # priorities 3 - 1e-3 * rank, best first
        assert [p.expert for p in memo.prefetch] == experts
        assert memo.predicted[3].tolist() == plain.predicted[3].tolist() == experts
        assert not memo.predicted[3].flags.writeable
        assert memo.scores[3].tolist() == plain.scores[3].tolist() == scores.tolist()
    assert len(made) == 2  # (3, 1, 2) and (3, 2, 1)
    again = layer_prediction(3, np.array([1, 2]), None, 6, made)
    assert again.predicted[3] is made[(3, 1, 2)][1] and not again.scores
    monkeypatch.setattr(spec, "MADE_ENTRIES", 2)
    layer_prediction(4, np.array([0]), None, 6, made)
    assert list(made) == [(4, 0)]


def test_one_token_topk_is_aggregate_topk_row_by_row() -> None:
    """The batched one-token order equals aggregate_topk's on each row alone (ties by
    index), for every k, and both outputs are read-only."""
    from moeexp.predictors.speculative import one_token_topk

    rows = np.random.default_rng(3).random((7, 6)).astype(np.float32)
    rows[2] = 0.5  # all tied
    rows[4, [1, 3]] = rows[4, 0]  # a tie at the top
    for k in (1, 2, 6, 9):
        order, mean = one_token_topk(rows, k)
        assert not order.flags.writeable and not mean.flags.writeable
        for i, row in enumerate(rows):
            want, want_mean = aggregate_topk(row[None], k)
            assert order[i].tolist() == want.tolist()
            assert mean[i].tolist() == want_mean.tolist()
