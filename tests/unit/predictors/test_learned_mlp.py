"""learned_mlp: per-layer numpy MLP from hidden states to the experts d layers ahead."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import LayerObservation
from moeexp.predictors.learned_mlp import k_hot, recall_at_k, train_mlp
from moeexp.traces.synthetic import random_trace


def test_learns_a_separable_toy_problem() -> None:
    """Expert 0 when x0 > 0, expert 1 otherwise (J=2, K=1): after training the top-1 of
    the MLP matches the rule on fresh points (recall@1 > 0.95)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3)).astype(np.float32)
    idx = (x[:, :1] <= 0).astype(np.int64)
    net = train_mlp(x, k_hot(idx, 2), [8, 8], epochs=40, batch_size=64, lr=1e-2,
                    weight_decay=0.0, rng=rng)
    xt = rng.normal(size=(200, 3)).astype(np.float32)
    assert recall_at_k(net.probs(xt), (xt[:, :1] <= 0).astype(np.int64)) > 0.95


def test_beats_the_frequency_baseline_on_a_random_trace() -> None:
    """random_trace routes by a per-request topic that the hidden state reveals, so the
    held-out recall@K must beat the store's per-layer most-used experts by a clear margin;
    parameter count = 3 source layers x ((16*8+8) + (8*8+8) + (8*8+8)) = 840."""
    tr = random_trace(num_requests=40, prompt_len=8, output_len=8, with_hidden=True, seed=1)
    p = PREDICTORS.build("learned_mlp", dims=tr.dims, distance=1, hidden_units=[8, 8],
                         holdout=0.25, progress=False)
    p.fit(tr.split("store"))
    s = p.stats()
    assert s["recall_at_k"] > s["baseline_recall_at_k"] + 0.1
    assert s["params"] == 840


def test_predicts_layer_l_plus_d_only_and_is_seeded() -> None:
    """d=2, L=4: layer 1 prefetches for layer 3; layer 2 has no target (2+2 >= 4). Two fits
    with the same seed give the same prediction."""
    tr = random_trace(num_requests=10, with_hidden=True, seed=2)
    store = tr.split("store")
    preds = []
    for _ in range(2):
        p = PREDICTORS.build("learned_mlp", dims=tr.dims, distance=2, epochs=3, progress=False)
        p.fit(store)
        h = tr.hidden[:3, 1].astype(np.float32)
        out = p.observe_layer(LayerObservation(1, tr.probs[:3, 1], np.array([0]),
                                               np.zeros(8, np.int64), hidden=h))
        assert set(out.predicted) == {3} and len(out.predicted[3]) >= tr.dims.top_k
        preds.append(out.predicted[3].tolist())
        assert p.observe_layer(LayerObservation(2, tr.probs[:3, 2], np.array([0]),
                                                np.zeros(8, np.int64), hidden=h)).prefetch == []
    assert preds[0] == preds[1]
    assert p.stats()["query_us_mean"] > 0


def test_needs_hidden_states() -> None:
    """A store without hidden states names the option trace.record_hidden=true."""
    tr = random_trace(num_requests=4)
    with pytest.raises(ConfigError, match="trace.record_hidden=true"):
        PREDICTORS.build("learned_mlp", dims=tr.dims, progress=False).fit(tr)


def test_split_rows_holds_out_whole_requests_and_caps_training_rows() -> None:
    """20 store requests, holdout 0.25 -> 5 whole requests held out, disjoint from the
    training rows; max_train_tokens=30 keeps a sorted random 30 of the rest; the same
    seed gives the same rows."""
    tr = random_trace(num_requests=20, store_fraction=1.0, with_hidden=True, seed=3)
    p = PREDICTORS.build("learned_mlp", dims=tr.dims, holdout=0.25, max_train_tokens=30,
                         progress=False)
    train, held = p.split_rows(tr, np.random.default_rng(0))
    tok_req = np.repeat(tr.iter_request, np.diff(tr.iter_offsets))
    assert len(set(tok_req[held].tolist())) == 5
    assert not set(tok_req[train].tolist()) & set(tok_req[held].tolist())
    assert len(train) == 30 and np.all(np.diff(train) > 0)
    again = p.split_rows(tr, np.random.default_rng(0))
    assert again[0].tolist() == train.tolist() and again[1].tolist() == held.tolist()
