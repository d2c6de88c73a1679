"""lrb: the learned reuse-distance model's state, labels, store-only fit, and its use."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS, lrb
from moeexp.predictors import reuse_features as rf
from moeexp.predictors.base import IterationStart, LayerObservation
from moeexp.traces.synthetic import random_trace


def test_state_counts_recency_and_window() -> None:
    st = lrb.LrbState.zeros(2, 3)
    st.update(0, np.array([1.0, 0.0, 0.0]))
    for _ in range(3):
        st.update(0, np.array([0.0, 1.0, 0.0]))
    np.testing.assert_allclose(st.rec[0], [4, 1, lrb.REC_CAP])
    row = st.rows(np.zeros((2, 3)), 0)  # [J, F]
    assert row.shape == (3, len(lrb.FEATURES))
    np.testing.assert_allclose(row[:, lrb.FEATURES.index("win")], [1, 3, 0])
    np.testing.assert_allclose(row[:, lrb.FEATURES.index("last")], [0, 1, 0])
    for _ in range(lrb.WINDOW):  # the window forgets
        st.update(0, np.zeros(3))
    assert st.rows(np.zeros((2, 3)), 0)[:, lrb.FEATURES.index("win")].sum() == 0


def test_distances_count_passes_to_the_next_use() -> None:
    used = np.zeros((5, 1, 2), bool)
    used[[0, 3], 0, 0] = True
    d = lrb._distances(used)
    np.testing.assert_allclose(d[:, 0, 0], [1, 3, 2, 1, 2])  # censored: 5 - 4 + 1
    np.testing.assert_allclose(d[:, 0, 1], [6, 5, 4, 3, 2])


def test_fit_reads_only_store_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store/test separation of the learned model: a trace holding a test request is
    refused, and walking the store split reads only store requests' passes."""
    tr = random_trace(num_layers=3, num_experts=6, num_requests=10, output_len=6, seed=2)
    with pytest.raises(ConfigError, match="outside the store"):
        lrb.walk_rows(tr)
    store_ids = {r.request_id for r in tr.requests if r.split == "store"}
    assert 0 < len(store_ids) < len(tr.requests)
    seen: list[int] = []
    real = rf._pass_used

    def spy(trace, it):
        seen.append(int(trace.iter_request[it]))
        return real(trace, it)

    monkeypatch.setattr(lrb, "_pass_used", spy)
    X, rid, dist, _ = lrb.walk_rows(tr.split("store"))
    assert seen and set(seen) <= store_ids and set(rid.tolist()) <= store_ids
    assert X.shape == (len(dist), len(lrb.FEATURES)) and (dist >= 1).all()
    with pytest.raises(ConfigError, match="outside the store"):
        PREDICTORS.build("reuse_prob", dims=tr.dims, next_model="lrb").fit(tr)


def test_learned_distance_ranks_a_sure_expert_first_and_feeds_the_scores() -> None:
    """Expert 0 is used by every token: ``reuse_prob`` with ``next_model: lrb`` predicts it
    back within ~1 pass and scores the layer that ran with 1 / D, in (0, 1]."""
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=12, output_len=12,
                      seed=1)
    tr.topk_idx[:, :, 0] = 0
    tr.topk_idx[:, :, 1] = np.where(tr.topk_idx[:, :, 1] == 0, 1, tr.topk_idx[:, :, 1])
    p = PREDICTORS.build("reuse_prob", dims=tr.dims, next_model="lrb")
    p.fit(tr.split("store"))
    p.start_iteration(IterationStart(request_ids=np.array([0]), step=1, embed=None,
                                     token_request=np.array([0])))
    counts = np.bincount([0, 3], minlength=6)
    s = p.observe_layer(LayerObservation(layer=0, probs=np.zeros((1, 6), np.float32),
                                         experts=np.array([0, 3]), counts=counts)).scores[0]
    assert s.shape == (6,) and (s > 0).all() and (s <= 1).all()
    assert s[0] > 1 / 1.2 and s[0] == s.max() and s[1:].mean() < 1 / 1.2
    with pytest.raises(ConfigError, match="next_model"):
        PREDICTORS.build("reuse_prob", dims=tr.dims, next_model="belady")


def test_table_equals_the_model_on_its_discrete_features() -> None:
    """A lookup is the fitted model evaluated on the state's (logpop, recency, window,
    request position) row: the table is the model, not an approximation of it."""
    tr = random_trace(num_layers=2, num_experts=4, top_k=1, num_requests=8, output_len=20,
                      seed=4)
    X, _, dist, _ = lrb.walk_rows(tr.split("store"))
    logpop = X[:8, lrb.FEATURES.index("logpop")].reshape(2, 4)
    table = lrb.LrbTable.fit(X, dist, logpop)
    model = lrb.fit_lrb(lrb.table_rows(X), dist)
    st = lrb.LrbState.zeros(2, 4)
    rng = np.random.default_rng(0)
    for step in (0, 5, 100):
        st.step = step
        for _ in range(7):
            st.update(1, (rng.random(4) < 0.4).astype(float))
        want = lrb.predict_dist(model, lrb.table_rows(st.rows(logpop, 1)))
        np.testing.assert_allclose(table.lookup(st, 1), want, rtol=1e-5)
