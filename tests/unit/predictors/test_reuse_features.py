"""reuse_features: the reuse state, the chained transitions, the calibrated fits, store only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import reuse_features as rf
from moeexp.predictors.layer_transition import transition_counts
from moeexp.predictors.trajectory_index import TrajectoryIndex
from moeexp.traces.synthetic import random_trace


def _trans(tr):
    C = transition_counts(tr) + 1.0
    return C / C.sum(axis=-1, keepdims=True)


def test_state_update_keeps_last_use_and_two_averages() -> None:
    st = rf.ReuseState.zeros(2, 3)
    st.update(1, np.array([1.0, 0.0, 1.0]))
    st.update(1, np.array([0.0, 0.0, 1.0]))
    np.testing.assert_allclose(st.last[1], [0, 0, 1])
    np.testing.assert_allclose(st.fast[1], [rf.FAST * (1 - rf.FAST), 0, 1 - rf.FAST ** 2])
    np.testing.assert_allclose(st.slow[1], [rf.SLOW * (1 - rf.SLOW), 0, 1 - rf.SLOW ** 2])
    assert not st.last[0].any()
    both = rf.ReuseState.zeros(2, 3)
    both.update_all(np.array([[1.0, 0, 0], [0, 1.0, 0]]))
    np.testing.assert_allclose(both.fast, [[0.5, 0, 0], [0, 0.5, 0]])
    np.testing.assert_allclose(st.rec, [[rf.REC_CAP] * 3, [2, rf.REC_CAP, 1]])
    np.testing.assert_allclose(both.rec, [[1, rf.REC_CAP, rf.REC_CAP], [rf.REC_CAP, 1, rf.REC_CAP]])


def test_next_features_add_recency_and_look_one_unused_pass_ahead() -> None:
    """The next model's features: the ahead models' four plus log(passes since the last
    use); ``unused``: the state after a pass that leaves the expert unused."""
    st = rf.ReuseState.zeros(1, 2)
    st.update(0, np.array([1.0, 0.0]))
    st.update(0, np.array([0.0, 0.0]))
    logpop = np.log(np.array([[0.5, 0.25]]))
    x = rf.next_features(st, logpop, 0)
    np.testing.assert_allclose(x[:, :4], rf.state_features(st, logpop, 0))
    np.testing.assert_allclose(x[:, 4], np.log([2.0, rf.REC_CAP]))
    after = rf.ReuseState(st.feat.copy(), st.rec.copy())
    after.update(0, np.zeros(2))
    np.testing.assert_allclose(rf.next_features(st, logpop, 0, unused=True),
                               rf.next_features(after, logpop, 0))
    assert rf.next_features(st, logpop, 0, recency=False).shape == (2, 4)


def test_follow_counts_the_next_single_token_pass_of_the_same_layer() -> None:
    """The follow matrix: (e' at pass n, e at pass n + 1) per layer, rows smoothed toward
    the popularity with one pseudo pass; a pair into a multi-token pass is not counted;
    the feature is log(u M / |u|), the prior where u is empty, the prior for an unused
    pass in next_features."""
    a, b = np.array([[1.0, 0.0, 0.0]]), np.array([[0.0, 1.0, 0.0]])
    prefill = np.ones((1, 3))
    logpop = np.log(np.full((1, 3), 1 / 3))
    f = rf.follow_matrices([(a, 1), (b, 1), (a, 1), (b, 1), (a, 1), (prefill, 5)], logpop)
    # a -> b twice, b -> a twice, a -> prefill not counted: (counts + 1/3) / (2 + 1)
    np.testing.assert_allclose(f.matrix[0, 0], [1 / 9, 7 / 9, 1 / 9])
    np.testing.assert_allclose(f.matrix[0, 1], [7 / 9, 1 / 9, 1 / 9])
    np.testing.assert_allclose(f.matrix[0, 2], [1 / 3] * 3)  # never used: the popularity
    np.testing.assert_allclose(f.matrix.sum(axis=-1), 1.0)
    np.testing.assert_allclose(f.feature(a[0], 0), np.log(f.matrix[0, 0]))
    both = np.array([1.0, 1.0, 0.0])
    np.testing.assert_allclose(f.feature(both, 0), np.log((f.matrix[0, 0] + f.matrix[0, 1]) / 2))
    np.testing.assert_allclose(f.feature(np.zeros(3), 0), f.prior[0])
    st = rf.ReuseState.zeros(1, 3)
    st.update(0, a[0])
    x = rf.next_features(st, logpop, 0, follow=f)
    np.testing.assert_allclose(x[:, 5], np.log(f.matrix[0, 0]))
    np.testing.assert_allclose(rf.next_features(st, logpop, 0, unused=True, follow=f)[:, 5],
                               f.prior[0])


def test_chain_matrices_multiply_consecutive_layers() -> None:
    rng = np.random.default_rng(0)
    T = rng.random((3, 4, 4))
    T /= T.sum(axis=-1, keepdims=True)
    M = rf.chain_matrices(T, 2)
    assert M[0].shape == (3, 4, 4) and M[1].shape == (2, 4, 4)
    np.testing.assert_allclose(M[1][1], T[1] @ T[2])
    np.testing.assert_allclose(M[1].sum(axis=-1), 1.0)


def test_fit_is_calibrated_in_the_large_and_learns_a_sure_expert() -> None:
    """Expert 0 of every layer is used by every token: its next-pass probability is near 1 (> 0.9: the fit is regularised);
    the mean predicted probability over the training rows equals the use rate (a logistic
    regression with an intercept)."""
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=12, output_len=12,
                      store_fraction=1.0, seed=1)
    tr.topk_idx[:, :, 0] = 0
    tr.topk_idx[:, :, 1] = np.where(tr.topk_idx[:, :, 1] == 0, 1, tr.topk_idx[:, :, 1])
    m = rf.fit_models(tr, _trans(tr), 2)
    assert set(m.ahead) >= {(0, 1), (0, 2), (1, 1), (1, 2)}
    st = rf.ReuseState.zeros(3, 6)
    for _ in range(30):  # a used-every-pass history, as in the fit
        st.update_all(np.eye(6)[[0, 0, 0]] + 0.0)
    p_sure = m.next(rf.next_features(st, m.logpop, 1, follow=m.follow))
    assert p_sure[0] > 0.9 and p_sure[0] > p_sure[1:].max()
    X, y = [], []
    state = rf.ReuseState.zeros(3, 6)
    for it in rf.store_iterations(tr):
        used, _, T = rf._pass_used(tr, it)
        if T == 1:
            X.append(rf.next_features(state, m.logpop, follow=m.follow).reshape(-1, 6))
            y.append(used.reshape(-1))
        state.update_all(used)
    p = m.next(np.concatenate(X))
    assert abs(p.mean() - np.concatenate(y).mean()) < 0.01


def test_a_test_request_never_reaches_a_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store/test separation: a trace holding test requests is refused, and fitting
    the store split reads only store requests' iterations."""
    tr = random_trace(num_layers=3, num_experts=6, num_requests=10, output_len=6, seed=2)
    with pytest.raises(ConfigError, match="outside the store"):
        rf.fit_models(tr, _trans(tr), 1)
    store = tr.split("store")
    store_ids = {r.request_id for r in tr.requests if r.split == "store"}
    assert 0 < len(store_ids) < len(tr.requests)
    seen: list[int] = []
    real = rf._pass_used

    def spy(trace, it):
        seen.append(int(trace.iter_request[it]))
        return real(trace, it)

    monkeypatch.setattr(rf, "_pass_used", spy)
    m = rf.fit_models(store, _trans(store), 1, horizons=rf.HORIZONS)  # the within fits too
    assert set(m.within) == set(rf.HORIZONS)
    assert seen and set(seen) <= store_ids
    with pytest.raises(ConfigError, match="outside the store"):
        rf.fit_models(tr, _trans(tr), 1, horizons=rf.HORIZONS)


def test_a_relabelled_test_request_is_refused() -> None:
    tr = random_trace(num_layers=3, num_experts=6, num_requests=4, store_fraction=1.0, seed=3)
    bad = dataclasses.replace(tr, requests=[dataclasses.replace(tr.requests[0], split="test"),
                                            *tr.requests[1:]])
    with pytest.raises(ConfigError, match="store split"):
        rf.store_iterations(bad)


def test_spec_features_count_top_k_shares_and_mean_probability() -> None:
    spec = np.array([[[0.5, 0.3, 0.1, 0.1]], [[0.1, 0.5, 0.3, 0.1]]])  # [T=2, 1, J=4]
    f = rf.spec_features(spec, top_k=2)
    assert f.shape == (1, 4, 2)
    np.testing.assert_allclose(f[0, :, 0], [0.5, 1.0, 0.5, 0.0])
    np.testing.assert_allclose(f[0, :, 1], np.log([0.3, 0.4, 0.2, 0.1]))
    assert rf.spec_features(None, 2) is None


def test_spec_fit_reads_store_gates_only_and_refuses_test_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the speculative features the ahead models get 7 columns; the gates read are
    the store requests' (the separation holds for the new columns too)."""
    tr = random_trace(num_layers=3, num_experts=6, num_requests=10, output_len=6, seed=2)
    with pytest.raises(ConfigError, match="outside the store"):
        rf.fit_models(tr, _trans(tr), 2, use_spec=True)
    store = tr.split("store")
    store_ids = {r.request_id for r in tr.requests if r.split == "store"}
    seen: list[int] = []
    real = rf._spec_block

    def spy(trace, it, *a):
        seen.append(int(trace.iter_request[it]))
        return real(trace, it, *a)

    monkeypatch.setattr(rf, "_spec_block", spy)
    m = rf.fit_models(store, _trans(store), 2, use_spec=True)
    assert m.spec_depth == 2 and all(f.coef.shape == (7,) for f in m.ahead.values())
    assert seen and set(seen) <= store_ids
    plain = rf.fit_models(store, _trans(store), 2)
    assert plain.spec_depth == 0 and all(f.coef.shape == (5,) for f in plain.ahead.values())


def test_carried_steps_equals_the_chain_products() -> None:
    """One matrix at a time (prefill's every layer ahead) = the stored d-step products."""
    tr = random_trace(num_layers=5, num_experts=6, num_requests=6, seed=4)
    trans = _trans(tr)
    chains = rf.chain_matrices(trans, 4)
    counts = np.array([0, 3, 1, 0, 2, 0])
    got = rf.carried_steps(counts, trans[1:], 3)  # out of layer 1
    want = np.stack([rf.carried(counts, chains[d][1]) for d in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    every = rf._carried_all(np.tile(counts, (5, 1)), trans, 4)
    np.testing.assert_allclose(every[2][1], want[2], rtol=1e-12)


def test_passes_until_use_counts_to_the_first_use_from_each_row() -> None:
    """One layer, two experts over 5 passes: expert 0 used at passes 1 and 4, expert 1 never."""
    used = [np.array([[u, 0.0]]) for u in (0.0, 1.0, 0.0, 0.0, 1.0)]
    w = rf.passes_until_use(used, [0, 1, 2, 4])
    np.testing.assert_array_equal(w[0][0], [1.0, np.inf])
    np.testing.assert_array_equal(w[1][0], [0.0, np.inf])
    np.testing.assert_array_equal(w[2][0], [2.0, np.inf])
    np.testing.assert_array_equal(w[4][0], [0.0, np.inf])
    assert set(w) == {0, 1, 2, 4}


def test_within_models_rise_with_the_horizon_and_h_one_is_not_fitted_twice() -> None:
    """P(used within h passes) fitted on the next model's rows: the mean over those rows is
    the label rate of each h (calibrated in the large), and it grows with h."""
    tr = random_trace(num_layers=3, num_experts=6, top_k=2, num_requests=12, output_len=12,
                      store_fraction=1.0, seed=4)
    m = rf.fit_models(tr, _trans(tr), 1, horizons=(2, 4))
    assert set(m.within) == {2, 4}
    assert rf.fit_models(tr, _trans(tr), 1).within == {}
    state = rf.ReuseState.zeros(3, 6)
    its = rf.store_iterations(tr)
    passes = [rf._pass_used(tr, it) for it in its]
    waits = rf.passes_until_use([p[0] for p in passes], list(range(len(passes))))
    X, W = [], []
    for n, (used, _, T) in enumerate(passes):
        if T == 1:
            X.append(rf.next_features(state, m.logpop, follow=m.follow).reshape(-1, 6))
            W.append(waits[n].reshape(-1))
        state.update_all(used)
    X, w = np.concatenate(X), np.concatenate(W)
    means = [m.within[h](X).mean() for h in (2, 4)]
    for h, mean in zip((2, 4), means, strict=True):
        assert abs(mean - (w < h).mean()) < 0.01
    assert m.next(X).mean() < means[0] < means[1]


def test_the_knn_index_holds_store_tokens_only_and_a_row_never_sees_its_request() -> None:
    """``knn=True``: a trace with test requests is refused; the index holds exactly the
    store's decode tokens that have a next decode token of their request; and the fit's
    kNN feature of a store token excludes its own request (checked on the index)."""
    tr = random_trace(num_layers=3, num_experts=6, num_requests=10, output_len=6, seed=2)
    with pytest.raises(ConfigError, match="outside the store"):
        rf.fit_models(tr, _trans(tr), 1, knn=True)
    with pytest.raises(ConfigError, match="outside the store"):
        rf.fit_models(tr, _trans(tr), 1, knn=True, knn_ahead=True)
    store = tr.split("store")
    m = rf.fit_models(store, _trans(store), 1, knn=True)
    assert m.knn is not None and len(m.next.coef) == 7  # 4 state, rec, follow, kNN
    store_ids = {r.request_id for r in tr.requests if r.split == "store"}
    assert set(m.knn.request.tolist()) <= store_ids
    sizes = np.diff(store.iter_offsets)
    pairs = sum(1 for i in range(len(sizes) - 1) if sizes[i] == 1 and sizes[i + 1] == 1
                and store.iter_request[i] == store.iter_request[i + 1])
    assert len(m.knn) == pairs
    # a token's feature with its own request excluded never reads that request's rows
    idx = m.knn
    own = int(idx.request[0])
    used = np.moveaxis(idx.cols, -1, 0)[0] > 0  # [L, J], the first token's routing
    marked = TrajectoryIndex(used=np.moveaxis(idx.cols, -1, 0) > 0,
                                nxt=np.where((idx.request == own)[:, None, None], True,
                                             False) & np.ones_like(idx.tgt[:, :, 0], dtype=bool),
                                request=idx.request)
    assert not marked.features(used, own).any()  # only own-request rows carry a 1
    assert marked.features(used, -1).any()  # without the exclusion they are read


def test_the_knn_within_rows_count_the_next_h_decode_tokens_of_the_same_request() -> None:
    """``knn=True`` with horizons: each index token's within-h row is 1 exactly where the
    expert is used by one of its next h decode tokens of the same request (brute force
    over the store's passes; a request's end or a prefill stops the count); the within
    models read those rows (their kNN coefficient differs from the next model's)."""
    tr = random_trace(num_layers=2, num_experts=5, num_requests=8, output_len=9, seed=4)
    store = tr.split("store")
    m = rf.fit_models(store, _trans(store), 1, knn=True, horizons=(2, 4))
    idx = m.knn
    assert idx is not None and idx.horizons == (2, 4) and idx.tgt.shape[2] == 3
    its = rf.store_iterations(store)
    used = [rf._pass_used(store, it) for it in its]
    req = store.iter_request[its]
    want = []
    for n in range(1, len(used)):
        if not (used[n][2] == 1 and used[n - 1][2] == 1 and req[n] == req[n - 1]):
            continue
        run = [n]  # the next token, then the chained decode tokens after it
        while (run[-1] + 1 < len(used) and used[run[-1] + 1][2] == 1
               and req[run[-1] + 1] == req[n]):
            run.append(run[-1] + 1)
        rows = [used[n][0] > 0] + [np.logical_or.reduce([used[i][0] > 0 for i in run[:h]])
                                   for h in (2, 4)]
        want.append(np.stack(rows, axis=1))  # [L, H1, J]
    assert len(want) == len(idx) and np.array_equal(idx.tgt, np.stack(want).astype(np.uint8))
    off = rf.fit_models(store, _trans(store), 1, knn=True, horizons=(2, 4), knn_within=False)
    assert off.knn is not None and off.knn.tgt.shape[2] == 1
    assert not np.allclose(m.within[2].coef, off.within[2].coef)
    assert np.allclose(m.next.coef, off.next.coef)  # the next model reads the same rows
