"""FineMoE's expert-map predictor: δ selection, priorities, store replacement, search."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation, Prediction
from moeexp.predictors.expert_map import ExpertMapPredictor, select_experts
from moeexp.predictors.expert_map_select import V1_EPSILON
from moeexp.predictors.expert_map_store import ExpertMapStore
from moeexp.traces.schema import Trace, TraceDims
from moeexp.traces.synthetic import random_trace


def dims(L: int = 4, J: int = 4, K: int = 1, H: int = 2) -> TraceDims:
    return TraceDims(num_layers=L, num_experts=J, top_k=K, hidden_size=H, spec_depth=0,
                     expert_bytes=1)


def start(pred: ExpertMapPredictor, embed: list[list[float]], rid: int = 0,
          step: int = 1) -> Prediction:
    e = np.asarray(embed, dtype=np.float32)
    return pred.start_iteration(IterationStart(
        request_ids=np.array([rid]), step=step, embed=e, token_request=np.full(len(e), rid)))


def observe(pred: ExpertMapPredictor, layer: int, probs: np.ndarray) -> Prediction:
    probs = np.atleast_2d(np.asarray(probs, dtype=np.float32))
    J = probs.shape[1]
    return pred.observe_layer(LayerObservation(
        layer=layer, probs=probs, experts=np.argsort(-probs[0])[:1],
        counts=np.zeros(J, dtype=np.int64)))


def pairs(pred: Prediction) -> list[tuple[int, int, float]]:
    return [(f.layer, f.expert, round(f.priority, 6)) for f in pred.prefetch]


# ---------------------------------------------------------------------- δ selection
def test_delta_selection_stops_when_cumulative_reaches_delta() -> None:
    """probs [0.1, 0.5, 0.3, 0.1] sorted: experts 1 (0.5), 2 (0.3), 0, 3 (0.1 each).

    score 0.3 → δ 0.7: 0.5 < 0.7, 0.8 ≥ 0.7 → [1, 2]. score 0.05 → δ 0.95: 0.5, 0.8, 0.9,
    1.0 → all four. score 0.5 → δ 0.5: the first expert reaches it exactly → [1].
    score −0.5 → δ clipped to 1 → all four.
    """
    p = np.array([0.1, 0.5, 0.3, 0.1])
    assert select_experts(p, 0.3, k=1).tolist() == [1, 2]
    assert select_experts(p, 0.05, k=1).tolist() == [1, 2, 0, 3]
    assert select_experts(p, 0.5, k=1).tolist() == [1]
    assert select_experts(p, -0.5, k=1).tolist() == [1, 2, 0, 3]


def test_delta_selection_never_fewer_than_k() -> None:
    """score 1 → δ 0: one expert reaches it, but K = 2 forces [1, 2]; score 0.3 with K = 3 →
    δ needs 2 experts, K raises it to 3; use_delta=False → exactly K whatever the score."""
    p = np.array([0.1, 0.5, 0.3, 0.1])
    assert select_experts(p, 1.0, k=2).tolist() == [1, 2]
    assert select_experts(p, 0.3, k=3).tolist() == [1, 2, 0]
    assert select_experts(p, -1.0, k=2, use_delta=False).tolist() == [1, 2]


def test_delta_one_on_a_float16_map_skips_zero_probability_experts() -> None:
    """A map stored in float16 (the offline store's trace) whose six non-zero probabilities
    [.4, .2, .15, .11, .09, .05] round to a sum of 0.99988: with δ = 1 (score ≤ 0) the
    running sum never reaches δ, yet the two experts of probability 0 are never needed:
    six experts, not eight. The same through the predictor: a query key with cosine
    −0.71 to both stored keys matches row 0 (δ = 1) and predicts its six experts."""
    row = np.array([0.4, 0.2, 0.15, 0.11, 0.09, 0.05, 0.0, 0.0]).astype(np.float16)
    p = row.astype(np.float64)  # what the store holds
    assert p.sum() < 1.0 - 1e-6
    assert select_experts(p, -0.5, k=2).tolist() == [0, 1, 2, 3, 4, 5]
    assert select_experts(p, 0.0, k=2).tolist() == [0, 1, 2, 3, 4, 5]
    assert select_experts(p, -0.5, k=7).tolist() == [0, 1, 2, 3, 4, 5, 6]  # K still rules
    pred = ExpertMapPredictor(dims=dims(L=2, J=8, K=2), prefetch_distance=1)
    maps = np.stack([np.stack([row, row]), np.stack([row[::-1], row[::-1]])])
    pred.store.add(np.array([[1.0, 0.0], [0.0, 1.0]]), maps.astype(np.float64), np.array([0, 1]))
    assert start(pred, [[-1.0, -1.0]]).predicted[0].tolist() == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------------- priorities
MAP0 = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1],
                 [0.1, 0.1, 0.5, 0.3], [0.25, 0.25, 0.1, 0.4]])
MAP1 = np.array([[0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1],
                 [0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])


def two_row_predictor(**kw: object) -> ExpertMapPredictor:
    pred = ExpertMapPredictor(dims=dims(), prefetch_distance=2, **kw)  # type: ignore[arg-type]
    pred.store.add(np.array([[1.0, 0.0], [0.0, 1.0]]), np.stack([MAP0, MAP1]), np.array([7, 8]))
    return pred


def test_priority_is_p_over_layer_distance() -> None:
    """d = 2, K = 1, the query key equals row 0's key (cosine 1 → δ 0 → one expert).

    Iteration start (l_now = −1): layer 0 → expert 0, priority 0.7 / (0 − (−1)) = 0.7;
    layer 1 → expert 1, 0.6 / 2 = 0.3; layers 2, 3: no map speaks → scores 1/J = 0.25.
    After layer 0 (row 0's own probabilities, prefix cosine 1): layer 2 → expert 2,
    0.5 / (2 − 0) = 0.25. After layer 1: layer 3 → expert 3, 0.4 / 2 = 0.2. Layers 2 and 3
    have no layer l + 2 < L to predict.
    """
    pred = two_row_predictor()
    first = start(pred, [[2.0, 0.0]])
    assert pairs(first) == [(0, 0, 0.7), (1, 1, 0.3)]
    assert np.allclose(first.scores[0], MAP0[0]) and np.allclose(first.scores[2], 0.25)
    assert pairs(observe(pred, 0, MAP0[0])) == [(2, 2, 0.25)]
    second = observe(pred, 1, MAP0[1])
    assert pairs(second) == [(3, 3, 0.2)]
    assert second.predicted[3].tolist() == [3] and np.allclose(second.scores[3], MAP0[3])
    assert observe(pred, 2, MAP0[2]).prefetch == []
    assert observe(pred, 3, MAP0[3]).prefetch == []


def test_delta_widens_prefetch_when_match_is_weak() -> None:
    """Key (0.6, 0.8): cosine 0.6 with row 0, 0.8 with row 1 → row 1, δ = 0.2; MAP1 layer 0 =
    [.1, .1, .1, .7]: 0.7 ≥ 0.2 → expert 3 alone, priority 0.7 / 1.
    Key (1, −6.5): cosine 0.152 with row 0 (−0.988 with row 1) → δ = 0.848; MAP0 layer 1 =
    [.1, .6, .2, .1]: 0.6, 0.8 < 0.848, 0.9 ≥ 0.848 → experts {1, 2, 0}. Without δ: K = 1 → {1}.
    """
    pred = two_row_predictor()
    assert pairs(start(pred, [[0.6, 0.8]]))[0] == (0, 3, 0.7)
    assert start(pred, [[1.0, -6.5]]).predicted[1].tolist() == [0, 1, 2]
    pred_k = two_row_predictor(use_delta=False)
    assert start(pred_k, [[1.0, -6.5]]).predicted[1].tolist() == [1]


def test_semantic_and_trajectory_switches() -> None:
    """use_semantic=False: nothing at iteration start and every score uniform; the
    trajectory still predicts layer 2 after layer 0. use_trajectory=False: the semantic
    match (row 1 for key (0, 1)) speaks for layer 2 after layer 0, whatever was observed."""
    pred = two_row_predictor(use_semantic=False)
    first = start(pred, [[1.0, 0.0]])
    assert first.prefetch == [] and all(np.allclose(s, 0.25) for s in first.scores.values())
    assert pairs(observe(pred, 0, MAP0[0])) == [(2, 2, 0.25)]
    pred = two_row_predictor(use_trajectory=False)
    start(pred, [[0.0, 1.0]])
    assert pairs(observe(pred, 0, MAP0[0])) == [(2, 0, 0.35)]  # MAP1[2][0] = 0.7, / d = 2


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="map_granularity"):
        ExpertMapPredictor(dims=dims(), map_granularity="request")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="both false"):
        ExpertMapPredictor(dims=dims(), use_semantic=False, use_trajectory=False)
    with pytest.raises(ConfigError, match="prefetch_distance"):
        PREDICTORS.build("expert_map", dims=dims(), prefetch_distance=9)
    pred = two_row_predictor()
    start(pred, [[1.0, 0.0]])
    with pytest.raises(RuntimeError, match="out of order"):
        observe(pred, 1, MAP0[1])


# ---------------------------------------------------------------------- store
def test_redundancy_replacement_picks_most_redundant_row() -> None:
    """L = 4, J = 2; rows A: key (1,0), map [1,0] per layer; B: key (0,1), map [0,1];
    C: key (1,1)/√2, map [.5,.5]. New x: key (1,0), map [0,1] per layer.
    cos_sem(x, ·) = A 1, B 0, C .7071; cos_traj(x, ·) = A 0, B 1, C .7071.
    d = 1: RDY = .25·sem + .75·traj = A .25, B .75, C .7071 → B replaced.
    d = 3: RDY = .75·sem + .25·traj = A .75, B .25, C .7071 → A replaced."""
    key = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    maps = np.stack([np.tile(m, (4, 1)) for m in ([1.0, 0.0], [0.0, 1.0], [0.5, 0.5])])
    x_key, x_map = np.array([[1.0, 0.0]]), np.tile([0.0, 1.0], (1, 4, 1))
    for d, replaced in [(1, 1), (3, 0)]:
        store = ExpertMapStore(3, 4, 2, 2, prefetch_distance=d)
        store.add(key, maps, np.array([0, 1, 2]))
        assert np.allclose(store.redundancy(x_key[0], x_map[0])[[0, 1, 2]],
                           [[0.25, 0.75, 0.70711], [0.75, 0.25, 0.70711]][d // 2], atol=1e-5)
        store.add(x_key, x_map, np.array([9]))
        assert store.request.tolist() == [[0, 1, 2][i] if i != replaced else 9 for i in range(3)]
        assert np.allclose(store.map(replaced), x_map[0])


def test_blocked_insertion_equals_row_by_row() -> None:
    """200 random rows into C = 20 with blocks of 7 (rows may replace rows of their own
    block) end in exactly the store of the one-row-at-a-time reference."""
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(200, 5))
    maps = rng.dirichlet(np.ones(4), size=(200, 3))
    a = ExpertMapStore(20, 3, 4, 5, prefetch_distance=1, block=7)
    a.add(keys, maps, np.arange(200))
    b = ExpertMapStore(20, 3, 4, 5, prefetch_distance=1)
    b.add_sequential(keys, maps, np.arange(200))
    assert a.request.tolist() == b.request.tolist()
    assert np.allclose(a.maps, b.maps) and np.allclose(a.prefix_norm, b.prefix_norm)


def test_incremental_cosines_equal_direct_computation() -> None:
    """After every observe_layer, the incremental prefix cosines of each query (two
    requests in one batch: their tokens' mean probabilities) equal the direct cosine of
    the flattened prefix with every stored row's same prefix."""
    rng = np.random.default_rng(1)
    L, J, H = 6, 5, 3
    pred = ExpertMapPredictor(dims=dims(L, J, 2, H), prefetch_distance=2)
    pred.store.add(rng.normal(size=(50, H)), rng.dirichlet(np.ones(J), size=(50, L)),
                   np.arange(50))
    tok_req = np.array([3, 3, 5])
    pred.start_iteration(IterationStart(request_ids=np.array([3, 5]), step=0,
                                        embed=rng.normal(size=(3, H)).astype(np.float32),
                                        token_request=tok_req))
    seen = []
    for layer in range(L):
        probs = rng.dirichlet(np.ones(J), size=3).astype(np.float32)
        seen.append(np.stack([probs[:2].astype(np.float64).mean(0), probs[2]]))
        pred.observe_layer(LayerObservation(layer=layer, probs=probs, experts=np.arange(2),
                                            counts=np.zeros(J, dtype=np.int64)))
        for b in range(2):
            direct = pred.store.prefix_cosines(np.stack([s[b] for s in seen]))
            np.testing.assert_allclose(pred.last_cosines[b], direct, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------- modes and splits
def replay(trace: Trace, pred: ExpertMapPredictor) -> list[tuple[int, int, float, bool]]:
    """(step, layer, recall, float16-tie) per (iteration, layer) of ``trace``; recall of the
    experts predicted for that layer against the trace's selected experts."""
    out = []
    for it in range(trace.num_iterations):
        sl, rid = trace.token_slice(it), int(trace.iter_request[it])
        T = sl.stop - sl.start
        got: dict[int, np.ndarray] = {}
        got.update(pred.start_iteration(IterationStart(
            request_ids=np.array([rid]), step=int(trace.iter_step[it]),
            embed=trace.embed[sl].astype(np.float32), token_request=np.full(T, rid))).predicted)
        for layer in range(trace.dims.num_layers):
            used = set(np.unique(trace.topk_idx[sl, layer]).tolist())
            ranked = -np.sort(-trace.probs[sl, layer], axis=-1)
            tie = bool((ranked[:, trace.dims.top_k - 1] == ranked[:, trace.dims.top_k]).any())
            hit = len(used & set(got.get(layer, np.zeros(0)).tolist())) / len(used)
            out.append((int(trace.iter_step[it]), layer, hit, tie))
            got.update(pred.observe_layer(LayerObservation(
                layer=layer, probs=trace.probs[sl, layer].astype(np.float32),
                experts=np.array(sorted(used)), counts=np.zeros(trace.dims.num_experts))).predicted)
        pred.end_iteration()
    return out


def test_offline_store_never_holds_test_requests() -> None:
    """fit() on a whole trace keeps only store-split rows, even when the capacity forces
    replacements (token rows: 7 store requests × (4 + 3) = 49 candidates for 30 slots)."""
    trace = random_trace(num_requests=10, prompt_len=4, output_len=4, seed=3)
    store_ids = {r.request_id for r in trace.requests if r.split == "store"}
    test_ids = {r.request_id for r in trace.requests if r.split == "test"}
    for granularity in ("token", "iteration"):
        pred = ExpertMapPredictor(dims=trace.dims, prefetch_distance=2, store_capacity=30,
                                  map_granularity=granularity)  # type: ignore[arg-type]
        pred.fit(trace)
        held = set(pred.store.request[: pred.store.size].tolist())
        assert held and held <= store_ids and not held & test_ids
        if granularity == "token":
            assert pred.store.size == 30 and pred.store.replacements == 19


def test_iteration_granularity_rows() -> None:
    """One row per iteration: key = the last token's embedding (last_token) or the mean;
    map = the mean of the iteration's token probabilities."""
    trace = random_trace(num_requests=3, prompt_len=5, output_len=3, store_fraction=1.0, seed=4)
    for pooling in ("last_token", "mean"):
        pred = ExpertMapPredictor(dims=trace.dims, prefetch_distance=2,
                                  map_granularity="iteration",
                                  embed_pooling=pooling)  # type: ignore[arg-type]
        pred.fit(trace)
        assert pred.store.size == trace.num_iterations
        sl = trace.token_slice(0)
        np.testing.assert_allclose(pred.store.map(0), trace.probs[sl].astype(np.float64).mean(0))
        e = trace.embed[sl].astype(np.float64)
        key = e[-1] if pooling == "last_token" else e.mean(0)
        np.testing.assert_allclose(pred.store.keys_n[0], key / np.linalg.norm(key), rtol=1e-4)


def test_online_mode_starts_empty_and_grows() -> None:
    """Online: fit() leaves the store empty; the first iteration predicts nothing; token
    granularity adds one row per token after each iteration (prefill 4, decode 1 each),
    until the capacity (10) caps it."""
    trace = random_trace(num_requests=3, prompt_len=4, output_len=4, seed=5)
    pred = ExpertMapPredictor(dims=trace.dims, prefetch_distance=2, mode="online",
                              store_capacity=10)
    pred.fit(trace.split("store"))
    assert pred.store.size == 0
    sizes, out = [], replay(trace, pred)
    assert all(hit == 0 for _, _, hit, _ in out[: trace.dims.num_layers])  # empty store
    pred2 = ExpertMapPredictor(dims=trace.dims, prefetch_distance=2, mode="online",
                               store_capacity=10)
    for it in range(4):
        replay(_one_iteration(trace, it), pred2)
        sizes.append(pred2.store.size)
    assert sizes == [4, 5, 6, 7]
    assert pred.store.size == 10


def _one_iteration(trace: Trace, it: int) -> Trace:
    """The sub-trace of iteration ``it`` alone (same arrays, one iteration)."""
    sl = trace.token_slice(it)
    return dataclasses.replace(
        trace, iter_request=trace.iter_request[it : it + 1], iter_step=trace.iter_step[it : it + 1],
        iter_offsets=np.array([0, sl.stop - sl.start]), probs=trace.probs[sl],
        topk_idx=trace.topk_idx[sl], topk_weight=trace.topk_weight[sl], embed=trace.embed[sl],
        token_ids=trace.token_ids[sl], spec_probs=None)


def test_perfect_store_recalls_every_decode_expert() -> None:
    """A store holding the test requests' own token maps: every decode token's key and
    trajectory find its own row (cosine 1 → δ 0 → its top-K), so the recall is 1 at every
    layer (semantic for layers < d, trajectory for the rest), except where float16
    rounding tied the K-th and (K+1)-th probabilities (excluded). (The l + d alignment
    itself is pinned by test_priority_is_p_over_layer_distance.)"""
    trace = random_trace(num_layers=6, num_requests=6, prompt_len=4, output_len=6, seed=6)
    test = trace.split("test")
    as_store = dataclasses.replace(
        test, requests=[dataclasses.replace(r, split="store") for r in test.requests])
    pred = ExpertMapPredictor(dims=trace.dims, prefetch_distance=2)
    pred.fit(as_store)
    rows = [(layer, hit) for step, layer, hit, tie in replay(test, pred) if step > 0 and not tie]
    assert len(rows) > 30 and all(hit == 1.0 for _, hit in rows)
    assert {layer for layer, _ in rows} == set(range(6))


# ---------------------------------------------------------------------- V2 / prefill variants
def test_prefill_none_predicts_nothing_in_prefill_only() -> None:
    """prefill=none (the authors' V2): a prefill (step 0) gets only the uniform scores and
    no prefetch, at the start or after any layer; a decode iteration is predicted as usual."""
    pred = two_row_predictor(prefill="none")
    first = start(pred, [[2.0, 0.0], [2.0, 0.1]], step=0)
    assert first.prefetch == [] and np.allclose(first.scores[0], 0.25)
    assert observe(pred, 0, np.stack([MAP0[0], MAP0[0]])).prefetch == []
    assert pairs(start(pred, [[2.0, 0.0]], step=1)) == [(0, 0, 0.7), (1, 1, 0.3)]


def test_token_union_is_the_union_of_one_query_per_token() -> None:
    """prefill=token_union: each prompt token's own key and trajectory select experts as a
    one-token iteration would; the prefill predicts their union with the per-expert max p.
    Token A matches row 0 (MAP0), token B row 1 (MAP1): layer 0 → {0} ∪ {3}."""
    keys, probs = [[2.0, 0.0], [0.0, 3.0]], [MAP0[0], MAP1[0]]
    union = two_row_predictor(prefill="token_union")
    got = start(union, keys, step=0)
    singles = [start(two_row_predictor(), [k], step=0) for k in keys]
    for layer in (0, 1):
        want = sorted(set().union(*(s.predicted[layer].tolist() for s in singles)))
        assert got.predicted[layer].tolist() == want
        assert np.array_equal(got.scores[layer],
                              np.max([s.scores[layer] for s in singles], axis=0))
    assert got.predicted[0].tolist() == [0, 3]
    after = observe(union, 0, np.stack(probs))
    one = [two_row_predictor() for _ in keys]
    expect = set()
    for p, k, row in zip(one, keys, probs, strict=True):
        start(p, [k], step=0)
        expect |= set(observe(p, 0, row).predicted[2].tolist())
    assert set(after.predicted[2].tolist()) == expect
    paper = two_row_predictor()
    assert len(start(paper, keys, step=0).predicted[0]) <= len(got.predicted[0])
    with pytest.raises(ConfigError, match="prefill"):
        two_row_predictor(prefill="tokens")


def test_decode_layer0_off_leaves_layer0_of_decode_unpredicted() -> None:
    """predict_decode_layer0=false (the authors' V2 GPU path): a decode iteration's start
    predicts layer 1 only (layer 0's p stays uniform); a prefill still predicts layer 0."""
    pred = two_row_predictor(predict_decode_layer0=False)
    dec = start(pred, [[2.0, 0.0]], step=3)
    assert pairs(dec) == [(1, 1, 0.3)] and 0 not in dec.predicted
    assert np.allclose(dec.scores[0], 0.25)
    assert pairs(start(pred, [[2.0, 0.0]], step=0)) == [(0, 0, 0.7), (1, 1, 0.3)]


def test_row_selection_takes_what_select_experts_takes() -> None:
    """The memoised selection (argsort and running sums once, bisection per score) takes the
    same experts in the same order as select_experts, on random, float16-rounded and tied
    rows, every score in [-1, 1], both δ modes and every K."""
    from moeexp.predictors.expert_map import RowSelection

    rng = np.random.default_rng(3)
    for t in range(300):
        p = rng.dirichlet(np.ones(8) * (0.3 if t % 2 else 3.0))
        if t % 3 == 0:
            p = p.astype(np.float16).astype(np.float64)
        if t % 5 == 0:
            p[:4] = p[0]
        sel = RowSelection.of(p)
        for score in (-1.0, -0.2, 0.0, 0.3, 0.71, 0.99, 1.0, float(rng.uniform(-1, 1))):
            for k in (1, 2, 3):
                for use_delta in (True, False):
                    want = select_experts(p, score, k, use_delta).tolist()
                    assert sel.order[: sel.num_selected(score, k, use_delta)].tolist() == want


def _v1_head(p: np.ndarray, score: float, k: int) -> set[int]:
    """V1's selected head, directly: the experts whose running sum (descending, stable) is
    <= δ, clamped to [k, J]; none for a row with no positive probability."""
    order = np.argsort(-p, kind="stable")
    delta = min(max(1.0 - float(score), 0.0), 1.0)
    n = min(max(int(np.sum(np.cumsum(p[order]) <= delta + 1e-9)), k), len(p))
    return set(order[:n].tolist()) if (p > 0).any() else set()


@pytest.mark.parametrize("selection", ["paper", "v0_tail", "v1_window"])
def test_batch_emit_is_the_union_of_each_querys_select_experts(selection: str) -> None:
    """Several queries (a batch, a token_union prefill): the experts predicted are the
    union of select_experts on each matched row, the hint is the per-expert max of the
    rows, the priorities p / distance best first by expert; the offline path (every
    query's δ selection at once on the store-wide tables) and the online one (row by row)
    give the same, on random, float16-rounded, tied and zero-padded rows, every score in
    [-1, 1]."""
    rng = np.random.default_rng(4)
    L, J, C = 3, 8, 40
    maps = rng.dirichlet(np.ones(J) * 0.4, size=(C, L))
    maps[::3] = maps[::3].astype(np.float16).astype(np.float64)
    maps[1::5, :, :4] = maps[1::5, :, :1]
    maps[2::7, :, 5:] = 0.0  # rows with zero-probability experts, one all zero
    maps[3, 1] = 0.0
    keys = rng.normal(size=(C, 2))
    queries = []
    for t in range(60):
        rows = rng.integers(0, C, size=int(rng.integers(2, 6)))
        score = rng.uniform(-1, 1, size=len(rows))
        score[t % len(rows)] = (-1.0, 0.0, 1.0)[t % 3]
        queries.append((t % L, rows, score))
    for k, use_delta in ((1, True), (2, True), (3, False)):
        if selection != "paper" and not use_delta:
            continue  # an artifact rule needs δ
        got = []
        for mode in ("offline", "online"):
            pred = ExpertMapPredictor(dims=dims(L, J, k, 2), prefetch_distance=1, mode=mode,
                                      store_capacity=C, use_delta=use_delta,
                                      selection=selection)  # type: ignore[arg-type]
            pred.store.add(keys, maps, np.arange(C))
            out = []
            for layer, rows, score in queries:
                pred_t = Prediction()
                pred._emit(pred_t, layer, rows, score, distance=2)
                stored = pred.store.maps[layer, rows]
                want = sorted(set().union(*(select_experts(
                    stored[i], score[i], k, use_delta, selection).tolist()  # type: ignore
                    for i in range(len(rows)))))
                assert pred_t.predicted[layer].tolist() == want
                assert np.array_equal(pred_t.scores[layer], stored.max(axis=0))
                # v1_window: every expert, the heads' union at p / 2 + 1e-6, the rest at 1e-6
                head = set().union(*(_v1_head(stored[i], score[i], k)
                                     for i in range(len(rows)))) if selection == "v1_window" \
                    else set(want)
                assert pairs(pred_t) == [
                    (layer, e, round((float(stored.max(axis=0)[e]) / 2 if e in head else 0.0)
                                     + (V1_EPSILON if selection == "v1_window" else 0.0), 6))
                    for e in want]
                out.append(pairs(pred_t))
            got.append(out)
        assert got[0] == got[1]


def _hook_keys(pred: ExpertMapPredictor, trace: Trace, fresh: bool) -> list[tuple]:
    """Every hook's Prediction over ``trace`` (one request per iteration, previewed as the
    simulator does), as plain values; ``fresh``: every memo dropped before each hook."""
    from moeexp.predictors.base import layer_observations

    def key(p: Prediction) -> tuple:
        return ([(f.priority, f.layer, f.expert) for f in p.prefetch],
                {k: v.tolist() for k, v in p.scores.items()},
                {k: np.asarray(v).tolist() for k, v in p.predicted.items()})

    out = []
    assert trace.embed is not None and trace.probs is not None
    for it in range(trace.num_iterations):
        sl, rid = trace.token_slice(it), int(trace.iter_request[it])
        if fresh:
            pred._sel_version = -1
        out.append(key(pred.start_iteration(IterationStart(
            request_ids=np.array([rid]), step=int(trace.iter_step[it]),
            embed=trace.embed[sl].astype(np.float32),
            token_request=np.full(sl.stop - sl.start, rid)))))
        probs = np.ascontiguousarray(np.swapaxes(trace.probs[sl], 0, 1), dtype=np.float32)
        counts = trace.iteration_counts(it)
        seen = layer_observations(probs, [np.flatnonzero(c) for c in counts], counts,
                                  None, None)
        if fresh:
            pred._sel_version = -1
        pred.preview_pass(seen)
        out.extend(key(pred.observe_layer(o)) for o in seen)
        pred.end_iteration()
    return out


@pytest.mark.parametrize("cfg", [{}, {"use_delta": False}, {"predict_decode_layer0": False},
                                 {"prefill": "token_union"}, {"selection": "v0_tail"},
                                 {"selection": "v1_window", "prefill": "token_union"}])
def test_memoised_predictions_equal_freshly_made_ones(cfg: dict) -> None:
    """The per-store-version memos (whole Predictions of one query's trajectory step and
    iteration start, emits, row selections, tables) return what a miss makes: a replay
    with warm memos (the test split twice) equals one that drops them before every hook."""
    def trace(seed: int) -> Trace:
        return random_trace(num_layers=6, num_experts=6, top_k=2, hidden_size=8,
                            num_requests=16, prompt_len=4, output_len=10, seed=seed)

    test = trace(6).split("test")  # another trace's store: weak matches, δ varies
    warm, cold = (ExpertMapPredictor(dims=test.dims, prefetch_distance=2, store_capacity=8,
                                     **cfg) for _ in range(2))
    warm.fit(trace(5).split("store"))
    cold.fit(trace(5).split("store"))
    first = _hook_keys(warm, test, fresh=False)
    assert _hook_keys(warm, test, fresh=False) == first
    assert _hook_keys(cold, test, fresh=True) == first
    assert warm._start_preds and warm._preds  # the memos were used
    sizes = {len(v) for _, _, predicted in first for v in predicted.values()}
    if cfg.get("selection") == "v1_window":  # every expert of every predicted layer
        assert sizes == {6}
    else:
        assert len(sizes) > (1 if cfg.get("use_delta", True) else 0)  # rows take 2, 3, ...
