"""eMoE: period and fallback order, Eq. 2 selection, emoe_l / emoe_a history models."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation, RequestStart
from moeexp.predictors.emoe import expected_tokens, select_top
from moeexp.predictors.emoe_model import SoftmaxRegression, training_pairs
from moeexp.traces.schema import RequestMeta
from moeexp.traces.synthetic import random_trace

J = 4


def meta(rid: int, task: str = "", prompt_len: int = 4) -> RequestMeta:
    return RequestMeta(request_id=rid, prompt="p", prompt_len=prompt_len, output_len=2,
                       split="test", dataset="x", task=task)


def routed_trace(layer0: list[int], layer1: list[int]):
    """Store of len(layer0) one-iteration requests (L=2, J=4, K=1, 3 tokens each): request r
    sends every token to layer0[r] at layer 0 and layer1[r] at layer 1."""
    tr = random_trace(num_layers=2, num_experts=J, top_k=1, num_requests=len(layer0),
                      prompt_len=3, output_len=1, store_fraction=1.0, seed=0)
    for r, (a, b) in enumerate(zip(layer0, layer1, strict=True)):
        tr.topk_idx[r * 3:(r + 1) * 3, 0] = a
        tr.topk_idx[r * 3:(r + 1) * 3, 1] = b
    return tr


def run_prompt(p, rid: int, experts: tuple[int, int], task: str = ""):
    """One prompt: 3 prefill tokens routed to experts[l] at layer l. Returns the predicted
    sets seen at start_request, start_iteration and per observed layer."""
    seen = {"request": p.start_request(RequestStart(meta(rid, task)))}
    seen["iteration"] = p.start_iteration(IterationStart(np.array([rid]), 0,
                                                         np.zeros((3, 2), np.float32),
                                                         np.full(3, rid)))
    for layer, e in enumerate(experts):
        probs = np.full((3, J), 0.1, np.float32)
        probs[:, e] = 0.7
        counts = np.bincount(np.full(3, e), minlength=J)
        seen[f"layer{layer}"] = p.observe_layer(LayerObservation(layer, probs, np.array([e]),
                                                                 counts))
    p.end_iteration()
    p.end_request(rid)
    return seen


def test_expected_tokens_eq2_worked_example() -> None:
    """f = [.5, .3, .2, 0]. Running: two task-a prompts (10 + 6 tokens), one task-b (4).
    W_o: a = 5, b = 20. s_a = 1, s_b = 0 -> N = (16 + 2*5)*f = 26 f = [13, 7.8, 5.2, 0];
    with b sensitive too: + (4 + 20) f -> 50 f. Top-2 of N: experts 0, 1."""
    f = np.array([[0.5, 0.3, 0.2, 0.0]])
    running = [meta(0, "a", 10), meta(1, "a", 6), meta(2, "b", 4)]
    N = expected_tokens(f, running, {"a": 5, "b": 20}, 0.0,
                        {"a": np.ones(1), "b": np.zeros(1)}, np.ones(1))
    np.testing.assert_allclose(N, [[13, 7.8, 5.2, 0]])
    N2 = expected_tokens(f, running, {"a": 5, "b": 20}, 0.0, {}, np.ones(1))
    np.testing.assert_allclose(N2, 50 * f)
    assert select_top(N2[0], 2).tolist() == [0, 1]


def test_period_and_fallback_order() -> None:
    """period = 2: prompt 0 wants all 4 experts of both layers (predicted everywhere; layer
    0's 4 prefetched at the start, layer 1's 4 while layer 0 runs); the predictor runs at
    prompts 1, 3, 5 (1 + k*p) and prompts 2, 4 reuse the set chosen before them."""
    tr = routed_trace([0, 1, 2, 3] * 3, [0, 1, 2, 3] * 3)
    p = PREDICTORS.build("emoe", dims=tr.dims, period=2, experts_per_layer=1)
    p.fit(tr)
    first = run_prompt(p, 0, (2, 2))
    assert {(f.layer, f.expert) for f in first["request"].prefetch} == {(0, e) for e in range(J)}
    assert {(f.layer, f.expert) for f in first["layer0"].prefetch} == {(1, e) for e in range(J)}
    assert all(v.tolist() == [0, 1, 2, 3] for v in first["iteration"].predicted.values())
    invocations = []
    for rid in range(1, 6):
        before = [None if s is None else s.tolist() for s in p.sets]
        seen = run_prompt(p, rid, (rid % J, rid % J))
        invocations.append(p.invocations)
        if rid % 2 == 0:  # reuse: the set does not change and is what is predicted
            assert [s.tolist() for s in p.sets] == before
            assert {k: v.tolist() for k, v in seen["iteration"].predicted.items()} == {
                0: before[0], 1: before[1]}
    assert invocations == [1, 1, 2, 2, 3]


def test_emoe_l_layer_from_previous_layer_and_first_layer_from_previous_prompt() -> None:
    """Store: layer 1 always repeats layer 0's expert, and each prompt's layer-0 expert is
    the previous prompt's + 1 (mod 4). After prompt 0 (layer 0 -> expert 1), prompt 1 (a
    prediction prompt) selects expert 2 for layer 0 at start_request; when its layer 0 is
    observed on expert 3, layer 1 is predicted as expert 3."""
    seq = [0, 1, 2, 3] * 4
    tr = routed_trace(seq, seq)
    p = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_l", period=40, experts_per_layer=1)
    p.fit(tr)
    run_prompt(p, 0, (1, 1))
    seen = run_prompt(p, 1, (3, 0))
    assert seen["request"].predicted[0].tolist() == [2]
    assert seen["layer0"].predicted[1].tolist() == [3]
    assert [s.tolist() for s in p.sets] == [[2], [3]]
    assert p.stats()["params"] == 2 * (J * J + J)


def test_emoe_a_predicts_all_layers_from_the_previous_prompt() -> None:
    """Store: prompt r+1 uses (e+1) % 4 at both layers when prompt r used e. After prompt 0
    on expert 1 everywhere, the prediction prompt 1 selects expert 2 for both layers at
    start_request; experts_per_layer=0.5 -> 2 of 4 experts are kept per layer."""
    seq = [0, 1, 2, 3] * 4
    tr = routed_trace(seq, seq)
    p = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_a", experts_per_layer=1)
    p.fit(tr)
    run_prompt(p, 0, (1, 1))
    out = run_prompt(p, 1, (0, 0))["request"]
    assert {k: v.tolist() for k, v in out.predicted.items()} == {0: [2], 1: [2]}
    assert out.scores[0][2] > 0 and out.scores[0][[0, 1, 3]].max() == 0
    half = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_a", experts_per_layer=0.5)
    half.fit(tr)
    run_prompt(half, 0, (1, 1))
    assert len(run_prompt(half, 1, (0, 0))["request"].predicted[0]) == 2


def test_insensitive_layer_skips_prediction() -> None:
    """sensitivity [1, 0]: layer 1 has N = 0, so its prediction is skipped and, with no
    previous set (prompt 0 had all experts), it keeps the store's most used expert of layer
    1 (expert 3: 3 of 4 store prompts use it) whatever the history says."""
    tr = routed_trace([0, 1, 2, 0], [3, 3, 3, 1])
    p = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_a", experts_per_layer=1,
                         sensitivity=[1.0, 0.0])
    p.fit(tr)
    run_prompt(p, 0, (2, 1))
    out = run_prompt(p, 1, (0, 0))["request"]
    assert out.predicted[1].tolist() == [3]


def test_bad_keys() -> None:
    """Unknown variant, period 0, a fraction above 1 and a sensitivity of wrong length fail."""
    tr = routed_trace([0, 1], [0, 1])
    for kw in ({"variant": "emoe_x"}, {"period": 0}, {"experts_per_layer": 1.5},
               {"sensitivity": [1.0]}):
        with pytest.raises(ConfigError):
            PREDICTORS.build("emoe", dims=tr.dims, **kw)


def test_training_pairs_of_each_variant() -> None:
    """R = 3 requests, L = 2, J = 4. emoe_a: x = request r's flattened L*J history, y =
    request r+1's row of that layer (R-1 pairs); emoe_l: layer 0 from the previous
    request's layer 0 (R-1 pairs), layer 1 from the same request's prefill at layer 0."""
    rng = np.random.default_rng(0)
    full, prefill = rng.dirichlet(np.ones(J), (3, 2)), rng.dirichlet(np.ones(J), (3, 2))
    x, y = training_pairs(full, prefill, "emoe_a", 1)
    np.testing.assert_array_equal(x, full[:2].reshape(2, 8))
    np.testing.assert_array_equal(y, full[1:, 1])
    x, y = training_pairs(full, prefill, "emoe_l", 0)
    np.testing.assert_array_equal(x, full[:2, 0])
    np.testing.assert_array_equal(y, full[1:, 0])
    x, y = training_pairs(full, prefill, "emoe_l", 1)
    np.testing.assert_array_equal(x, prefill[:, 0])
    np.testing.assert_array_equal(y, full[:, 1])


def test_softmax_regression_reaches_the_soft_cross_entropy_optimum() -> None:
    """Soft targets (rows of a Dirichlet), l2 = 1e-3: the default 300 Adam steps bring the
    gradient of mean CE + l2·|W|² from 0.17 (b) and 0.06 (W) at the prior to below 5e-4,
    the optimum scikit-learn's L-BFGS finds too (see emoe_model's docstring); before any
    data the model predicts the prior; the same seed gives the same weights."""
    rng = np.random.default_rng(1)
    x, y = rng.dirichlet(np.ones(J), 40), rng.dirichlet(np.full(J, 0.5), 40)
    prior = np.array([0.4, 0.3, 0.2, 0.1])
    m = SoftmaxRegression(J, J, prior, np.random.default_rng(0))
    np.testing.assert_allclose(m.predict(x[:2]), [prior, prior], atol=1e-2)
    m.fit(x, y, steps=300, lr=0.05, l2=1e-3)
    g = (m.predict(x) - y) / len(x)
    assert np.abs(x.T @ g + 2e-3 * m.W).max() < 5e-4
    assert np.abs(g.sum(axis=0)).max() < 5e-4
    assert m.final_loss == pytest.approx(m.loss(x, y))
    same = SoftmaxRegression(J, J, prior, np.random.default_rng(0))
    same.fit(x, y, steps=300, lr=0.05, l2=1e-3)
    np.testing.assert_array_equal(same.W, m.W)


def test_task_agnostic_uses_one_task_for_all() -> None:
    """task_aware=false: no per-task W_o is learned and a per-task sensitivity is ignored, so
    a task whose own sensitivity is 0 at layer 1 is predicted there (the default s = 1)."""
    tr = routed_trace([0, 1, 2, 0], [3, 3, 3, 1])
    sens = {"t": [1.0, 0.0], "default": [1.0, 1.0]}
    aware = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_a", experts_per_layer=1,
                             sensitivity=sens)
    agnostic = PREDICTORS.build("emoe", dims=tr.dims, variant="emoe_a", experts_per_layer=1,
                                sensitivity=sens, task_aware=False)
    aware.fit(tr)
    agnostic.fit(tr)
    assert set(aware.w_out) == {r.task for r in tr.requests} and agnostic.w_out == {}
    assert agnostic.w_default == aware.w_default
    for p in (aware, agnostic):
        run_prompt(p, 0, (2, 1), task="t")
    # task t is insensitive at layer 1 for the aware predictor: it keeps the store's top
    # expert (3); the agnostic one predicts layer 1 from the history like any layer
    assert run_prompt(aware, 1, (0, 0), task="t")["request"].predicted[1].tolist() == [3]
    assert 1 in run_prompt(agnostic, 1, (0, 0), task="t")["request"].predicted
    with pytest.raises(ConfigError, match="task_aware"):
        PREDICTORS.build("emoe", dims=tr.dims, task_aware="yes")
