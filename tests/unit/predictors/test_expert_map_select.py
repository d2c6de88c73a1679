"""FineMoE's selections: the paper's δ rule beside the authors' artifact rules (V0 tail,
V1 window epsilon), on hand-built probability vectors, and the predictor's option."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors.base import IterationStart, LayerObservation, Prediction
from moeexp.predictors.expert_map import ExpertMapPredictor
from moeexp.predictors.expert_map_select import V1_EPSILON, RowSelection, select_experts
from moeexp.traces.schema import TraceDims

#: sorted: expert 1 (0.5), 2 (0.3), 0 (0.1), 3 (0.1); running sums 0.5, 0.8, 0.9, 1.0
P = np.array([0.1, 0.5, 0.3, 0.1])


def test_v0_tail_skips_the_head_that_reaches_delta_and_keeps_the_tail() -> None:
    """V0 keeps the ranks whose running sum is >= δ (plus the K most probable): score 0.15
    → δ 0.85: the sums reach it at rank 2 (0.9), so ranks 2, 3 (experts 0, 3) and the top
    K = 1 (expert 1) are prefetched, while the second most probable expert 2 (0.3) is not;
    the paper's rule takes the head [1, 2, 0] instead. δ 1 (score ≤ 0): only the last rank
    reaches it: [1, 3] with K = 1, [1, 2, 3] with K = 2."""
    assert select_experts(P, 0.15, k=1, selection="v0_tail").tolist() == [1, 0, 3]
    assert select_experts(P, 0.15, k=1).tolist() == [1, 2, 0]
    assert select_experts(P, -0.5, k=1, selection="v0_tail").tolist() == [1, 3]
    assert select_experts(P, -0.5, k=2, selection="v0_tail").tolist() == [1, 2, 3]


def test_v0_tail_takes_every_nonzero_expert_on_a_close_match() -> None:
    """A close match (score 0.9 → δ 0.1) is reached at rank 0, so the whole tail is every
    expert, where the paper takes one: V0 prefetches nearly everything. Experts of
    probability 0 are never taken (their priority would be 0, which V0's prefetcher
    skips), not even to make up K."""
    assert select_experts(P, 0.9, k=1, selection="v0_tail").tolist() == [1, 2, 0, 3]
    assert select_experts(P, 0.9, k=1).tolist() == [1]
    z = np.array([0.0, 0.6, 0.0, 0.4])
    assert select_experts(z, 0.9, k=1, selection="v0_tail").tolist() == [1, 3]
    assert select_experts(z, -1.0, k=3, selection="v0_tail").tolist() == [1, 3]


def test_v1_window_takes_every_expert_whatever_the_score() -> None:
    """V1 adds 1e-6 to every expert of the window: all J experts, best first, for a close
    match (δ 0) as for a far one (δ 1), zero-probability experts included."""
    z = np.array([0.0, 0.6, 0.0, 0.4])
    for score in (1.0, 0.5, -1.0):
        assert select_experts(P, score, k=1, selection="v1_window").tolist() == [1, 2, 0, 3]
        assert select_experts(z, score, k=1, selection="v1_window").tolist() == [1, 3, 0, 2]


def test_row_selection_counts_equal_the_reference_for_every_rule() -> None:
    """The memoised counts (bisection on the running sums) take the experts select_experts
    takes, for every rule, on random, float16-rounded, tied and zero-padded rows, every
    score in [-1, 1] and every K; V1's head is (running sums <= δ) clamped to [K, J], 0
    for an all-zero row."""
    rng = np.random.default_rng(5)
    for t in range(200):
        p = rng.dirichlet(np.ones(8) * (0.3 if t % 2 else 3.0))
        if t % 3 == 0:
            p = p.astype(np.float16).astype(np.float64)
        if t % 5 == 0:
            p[:4] = p[0]
        if t % 7 == 0:
            p[5:] = 0.0
        sel = RowSelection.of(p)
        for score in (-1.0, 0.0, 0.3, 0.71, 1.0, float(rng.uniform(-1, 1))):
            delta = min(max(1.0 - score, 0.0), 1.0)
            for k in (1, 2, 3):
                for rule in ("paper", "v0_tail", "v1_window"):
                    c = sel.num_selected(score, k, True, rule)  # type: ignore[arg-type]
                    assert sel.taken(c, k, rule).tolist() == select_experts(  # type: ignore
                        p, score, k, selection=rule).tolist()  # type: ignore[arg-type]
                v1 = sel.num_selected(score, k, True, "v1_window")
                assert v1 == min(max(int(np.sum(np.array(sel.csum) <= delta + 1e-9)), k), 8)
    assert RowSelection.of(np.zeros(4)).num_selected(0.5, 2, True, "v1_window") == 0


# ---------------------------------------------------------------------- the predictor
MAP0 = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1],
                 [0.1, 0.1, 0.5, 0.3], [0.25, 0.25, 0.1, 0.4]])
MAP1 = np.array([[0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1],
                 [0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])


def two_rows(selection: str, mode: str = "offline") -> ExpertMapPredictor:
    dims = TraceDims(num_layers=4, num_experts=4, top_k=1, hidden_size=2, spec_depth=0,
                     expert_bytes=1)
    pred = ExpertMapPredictor(dims=dims, prefetch_distance=2, selection=selection,  # type: ignore
                              mode=mode)  # type: ignore[arg-type]
    pred.store.add(np.array([[1.0, 0.0], [0.0, 1.0]]), np.stack([MAP0, MAP1]), np.array([7, 8]))
    return pred


def start(pred: ExpertMapPredictor, key: list[float]) -> Prediction:
    return pred.start_iteration(IterationStart(
        request_ids=np.array([0]), step=1, embed=np.array([key], dtype=np.float32),
        token_request=np.zeros(1, dtype=np.int64)))


def triples(pred: Prediction) -> list[tuple[int, int, float]]:
    return [(f.layer, f.expert, round(f.priority, 9)) for f in pred.prefetch]


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_v1_window_prefetches_all_experts_head_at_p_over_distance_plus_epsilon(mode: str
                                                                               ) -> None:
    """Key = row 0's key (cosine 1, δ 0): the paper predicts expert 0 of layer 0 at 0.7 / 1
    and expert 1 of layer 1 at 0.6 / 2. V1: every expert of both layers; the head (V1's
    count clamped to K = 1: the same experts) at p / distance + 1e-6, the others at
    1e-6, best first; every expert counts as predicted. V0: a close match takes the whole
    tail, each at its p / distance."""
    paper = start(two_rows("paper", mode), [2.0, 0.0])
    assert triples(paper) == [(0, 0, 0.7), (1, 1, 0.3)]
    v1 = start(two_rows("v1_window", mode), [2.0, 0.0])
    e = V1_EPSILON
    assert triples(v1) == [(0, 0, round(0.7 + e, 9)), (0, 1, e), (0, 2, e), (0, 3, e),
                           (1, 1, round(0.3 + e, 9)), (1, 2, e), (1, 0, e), (1, 3, e)]
    assert all(v1.predicted[layer].tolist() == [0, 1, 2, 3] for layer in (0, 1))
    v0 = start(two_rows("v0_tail", mode), [2.0, 0.0])
    assert triples(v0)[:4] == [(0, 0, 0.7), (0, 1, 0.1), (0, 2, 0.1), (0, 3, 0.1)]
    assert v0.predicted[1].tolist() == [0, 1, 2, 3]


def test_v1_window_batch_emit_gives_the_heads_union_its_p_and_the_rest_epsilon() -> None:
    """Two queries matched to rows 0 and 1 at cosine 1 (δ 0, heads of K = 1): layer 2's
    heads are expert 2 (row 0, 0.5) and expert 0 (row 1, 0.7); the hint is the per-expert
    max [0.7, 0.1, 0.5, 0.3]; heads at p / 2 + 1e-6, experts 1 and 3 at 1e-6; the offline
    (store-wide tables) and online (row by row) paths agree."""
    e = V1_EPSILON
    for mode in ("offline", "online"):
        pred = two_rows("v1_window", mode)
        out = Prediction()
        pred._emit(out, 2, np.array([0, 1]), np.array([1.0, 1.0]), distance=2)
        assert triples(out) == [(2, 0, round(0.35 + e, 9)), (2, 1, e), (2, 2, round(0.25 + e, 9)),
                                (2, 3, e)]


def test_selection_is_refused_on_a_misspelling_and_without_delta() -> None:
    """An unknown selection names the valid ones; an artifact rule with use_delta=false
    (exactly K, the paper's ablation) is refused rather than silently ignored."""
    with pytest.raises(ConfigError, match="selection='v0-tail'; valid: paper, v0_tail, v1_window"):
        two_rows("v0-tail")
    dims = TraceDims(num_layers=4, num_experts=4, top_k=1, hidden_size=2, spec_depth=0,
                     expert_bytes=1)
    with pytest.raises(ConfigError, match="use_delta=true"):
        ExpertMapPredictor(dims=dims, selection="v1_window", use_delta=False)


def test_observe_layer_under_v0_tail_uses_the_trajectory_match() -> None:
    """After layer 0 (row 0's own probabilities, prefix cosine 1 → δ 0), V0 predicts layer 2
    from row 0's map [.1, .1, .5, .3]: the whole tail, experts 2, 3, 0, 1 best first, each
    at p / 2."""
    pred = two_rows("v0_tail")
    start(pred, [2.0, 0.0])
    obs = pred.observe_layer(LayerObservation(
        layer=0, probs=MAP0[:1].astype(np.float32), experts=np.array([0]),
        counts=np.zeros(4, dtype=np.int64)))
    assert triples(obs) == [(2, 2, 0.25), (2, 3, 0.15), (2, 0, 0.05), (2, 1, 0.05)]
