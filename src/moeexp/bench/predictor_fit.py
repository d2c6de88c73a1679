"""Benchmark: the learned predictors' fit and query cost against scikit-learn's versions.

The three predictors that learn from the store split (``learned_mlp``, ``semantic_knn``,
``emoe``) are hand-written in numpy. Each is fitted and queried here as the replay does, and
held against the scikit-learn estimator that would do its job (issue 14, item 9) on the
same rows, so the reasons their docstrings give for staying hand-written can be re-measured
(``python -m moeexp.bench predictor_fit``):

- ``learned_mlp``: the numpy MLP (Adam on mean BCE) against ``MLPClassifier`` with the
  same architecture, standardised inputs, epochs, batch size, learning rate, L2 and K-hot
  multi-label targets (:func:`sklearn_mlp`): fit seconds, hold-out and test recall@K, and
  one token's layer query (``MLP.probs`` against ``predict_proba``).
- ``semantic_knn``: the numpy cosine search against ``NearestNeighbors`` (cosine, brute
  force) + the mean of the neighbours' profiles: query time per request, and whether both
  return the same neighbours.
- ``emoe_l`` / ``emoe_a``: the softmax regressions (full-batch Adam on soft targets)
  against multinomial ``LogisticRegression`` (L-BFGS) on the same targets as weighted
  rows (:func:`sklearn_soft_logistic`): fit seconds, test soft cross-entropy, query time;
  and ``sklearn_import_s``, what importing scikit-learn adds to a run's first fit.
  Also at Qwen1.5-MoE's shape (``emoe_l_qwen``: L = 24, J = 60, K = 4), where the J-fold
  rows that soft targets need cost the most.

Trace: by default a synthetic one (:func:`moeexp.traces.synthetic.random_trace`) with the
embedded tiny model's shape and the predictor ablation's protocol: L = 8, J = 16, K = 2,
H = 64, 64 requests (45 store / 19 test) of 43 prompt and 122 output tokens, hidden states,
and 384-dim prompt embeddings (MiniLM's width) from the prefill embeddings by a fixed random
projection. ``run(trace=PATH)`` takes a recorded trace instead (its path without the
suffix), e.g. the one ``python -m moeexp +experiment=predictor_ablation`` records from the
tiny model in ``results/traces``. Timings are the best of ``repeats`` runs with BLAS on one
thread (threadpoolctl). scikit-learn is not a dependency of moeexp (sentence-transformers
and lm-eval install it); without it the runner reports this benchmark as skipped.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import NearestNeighbors
from sklearn.neural_network import MLPClassifier
from threadpoolctl import threadpool_limits

from moeexp.bench import best_of
from moeexp.predictors import PREDICTORS
from moeexp.predictors.emoe import EMoE
from moeexp.predictors.emoe_model import store_histories, training_pairs
from moeexp.predictors.learned_mlp import MLP, LearnedMLP, k_hot, recall_at_k
from moeexp.predictors.semantic_knn import SemanticKNN, request_profiles
from moeexp.traces import io
from moeexp.traces.schema import Trace
from moeexp.traces.synthetic import random_trace

log = logging.getLogger(__name__)

#: The tiny model's shape and the ablation's protocol (conf/model/tiny.yaml, dataset sharegpt).
SHAPE: dict[str, int] = {"num_layers": 8, "num_experts": 16, "top_k": 2, "hidden_size": 64,
                         "num_requests": 64, "prompt_len": 43, "output_len": 122}
PROMPT_EMBED_DIM = 384
#: Qwen1.5-MoE-A2.7B's routing shape (algorithms.md §9), for eMoE's large-J comparison.
QWEN_SHAPE: dict[str, int] = {"num_layers": 24, "num_experts": 60, "top_k": 4,
                              "hidden_size": 8}


def _synthetic(shape: dict[str, int], *, with_hidden: bool, seed: int) -> Trace:
    """A seeded :func:`~moeexp.traces.synthetic.random_trace` of ``shape`` over
    :data:`SHAPE`'s protocol (64 requests of 43 + 122 tokens, 6 topics)."""
    d = {**SHAPE, **shape}
    return random_trace(num_layers=d["num_layers"], num_experts=d["num_experts"],
                        top_k=d["top_k"], hidden_size=d["hidden_size"], spec_depth=0,
                        num_requests=d["num_requests"], prompt_len=d["prompt_len"],
                        output_len=d["output_len"], num_topics=6, with_hidden=with_hidden,
                        seed=seed)


def synthetic_trace(seed: int = 0) -> Trace:
    """:data:`SHAPE`'s synthetic trace with hidden states and prompt embeddings."""
    tr = _synthetic(SHAPE, with_hidden=True, seed=seed)
    assert tr.embed is not None
    rng = np.random.default_rng(seed + 1)
    proj = rng.normal(size=(SHAPE["hidden_size"], PROMPT_EMBED_DIM))
    first = [int(tr.request_iterations(r.request_id)[0]) for r in tr.requests]
    pooled = np.stack([tr.embed[tr.token_slice(it)].astype(np.float64).mean(axis=0)
                       for it in first])
    tr.prompt_embed = (pooled @ proj).astype(np.float32)
    return tr



def _per_call_us(fn: Callable[[int], Any], calls: int, repeats: int) -> float:
    """Best over ``repeats`` of the mean microseconds of ``calls`` calls fn(i)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter_ns() - t0) / calls / 1e3)
    return best


def sklearn_import_s(repeats: int) -> float:
    """Best over ``repeats`` fresh interpreters of the seconds ``import sklearn.linear_model``
    takes once numpy is loaded: what the first scikit-learn fit of a run would add."""
    code = ("import time, numpy; t = time.perf_counter(); import sklearn.linear_model; "
            "print(time.perf_counter() - t)")
    return min(float(subprocess.run([sys.executable, "-c", code], check=True,
                                    capture_output=True, text=True).stdout)
               for _ in range(repeats))


def sklearn_mlp(x: np.ndarray, y: np.ndarray, p: LearnedMLP, seed: int) -> Any:
    """``MLPClassifier`` with ``p``'s settings on x float32[N, H] (standardised here as the
    predictor does), K-hot y float32[N, J]; returns (classifier, mu, sd).

    The predictor minimises BCE averaged over the N·J entries plus (weight_decay/2)·|W|²;
    scikit-learn sums BCE over the J labels, averages over the batch and adds
    alpha/(2·batch)·|W|², so alpha = weight_decay·J·batch_size gives the same objective
    up to the factor J (which Adam's normalisation removes). All ``epochs`` run
    (n_iter_no_change = epochs, tol = 0), as in the predictor.
    """
    mu = x.mean(axis=0)
    sd = x.std(axis=0) + 1e-5
    clf = MLPClassifier(tuple(p.hidden_units), alpha=p.weight_decay * y.shape[1] * p.batch_size,
                        batch_size=p.batch_size, learning_rate_init=p.lr, max_iter=p.epochs,
                        n_iter_no_change=p.epochs, tol=0.0, shuffle=True, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit((x - mu) / sd, y)
    return clf, mu, sd


def bench_learned_mlp(store: Trace, test: Trace, distance: int, repeats: int,
                      seed: int) -> dict[str, Any]:
    """Hand-written MLP (the predictor) against ``MLPClassifier`` on the same rows."""
    assert store.hidden is not None and test.hidden is not None
    sh, th = store.hidden, test.hidden
    L, J = store.dims.num_layers, store.dims.num_experts

    def fit_ours() -> LearnedMLP:
        p = LearnedMLP(dims=store.dims, distance=distance, seed=seed, progress=False)
        p.fit(store)
        return p

    fit_s, pred = best_of(fit_ours, repeats)
    train, held = pred.split_rows(store, np.random.default_rng(seed))

    def fit_theirs() -> list[Any]:
        rng = np.random.default_rng(seed)
        return [sklearn_mlp(sh[train, layer].astype(np.float32),
                            k_hot(store.topk_idx[train, layer + distance], J), pred,
                            int(rng.integers(2**31 - 1)))
                for layer in range(L - distance)]

    sk_fit_s, sk = best_of(fit_theirs, repeats)

    def recalls(score: Callable[[int, np.ndarray], np.ndarray]) -> tuple[float, float]:
        h, t = [], []
        for layer in range(L - distance):
            h.append(recall_at_k(score(layer, sh[held, layer]),
                                 store.topk_idx[held, layer + distance].astype(np.int64)))
            t.append(recall_at_k(score(layer, th[:, layer]),
                                 test.topk_idx[:, layer + distance].astype(np.int64)))
        return float(np.mean(h)), float(np.mean(t))

    def sk_probs(layer: int, x: np.ndarray) -> np.ndarray:
        clf, mu, sd = sk[layer]
        return clf.predict_proba((np.asarray(x, dtype=np.float32) - mu) / sd)

    ours_h, ours_t = recalls(lambda layer, x: pred.nets[layer].probs(x))
    sk_h, sk_t = recalls(sk_probs)
    rows = th[:, 0].astype(np.float32)
    net: MLP = pred.nets[0]
    n = len(rows)
    return {
        "fit_s": round(fit_s, 3), "sklearn_fit_s": round(sk_fit_s, 3),
        "holdout_recall_at_k": round(ours_h, 4), "sklearn_holdout_recall_at_k": round(sk_h, 4),
        "test_recall_at_k": round(ours_t, 4), "sklearn_test_recall_at_k": round(sk_t, 4),
        "query_us": round(_per_call_us(lambda i: net.probs(rows[i % n][None]), 2000,
                                       repeats), 1),
        "sklearn_query_us": round(_per_call_us(lambda i: sk_probs(0, rows[i % n][None]),
                                               2000, repeats), 1),
        "train_tokens": len(train), "params": int(pred.stats()["params"]),
    }


def bench_semantic_knn(store: Trace, test: Trace, k: int, repeats: int) -> dict[str, Any]:
    """Numpy cosine search (the predictor) against ``NearestNeighbors``."""
    assert store.prompt_embed is not None and test.prompt_embed is not None

    def fit_ours() -> SemanticKNN:
        p = SemanticKNN(dims=store.dims, embedding="minilm", k=k)
        p.fit(store)
        return p

    fit_s, pred = best_of(fit_ours, repeats)
    keys = np.asarray(store.prompt_embed, dtype=np.float64)
    _, profiles = request_profiles(store)
    nn_fit_s, nn = best_of(lambda: NearestNeighbors(n_neighbors=min(k, len(keys)),
                                                  metric="cosine", algorithm="brute").fit(keys),
                         repeats)
    queries = np.asarray(test.prompt_embed, dtype=np.float64)
    same = [pred.neighbours(q).tolist() == nn.kneighbors(q[None], return_distance=False)[0]
            .tolist() for q in queries]
    nq = len(queries)

    def theirs(i: int) -> np.ndarray:
        idx = nn.kneighbors(queries[i % nq][None], return_distance=False)[0]
        return profiles[idx].mean(axis=0)

    return {
        "fit_s": round(fit_s, 4), "sklearn_index_fit_s": round(nn_fit_s, 4),
        "same_neighbours": round(float(np.mean(same)), 4),
        "query_us": round(_per_call_us(lambda i: pred.profile(queries[i % nq]), 500,
                                       repeats), 1),
        "sklearn_query_us": round(_per_call_us(theirs, 500, repeats), 1),
    }


def sklearn_soft_logistic(x: np.ndarray, y: np.ndarray, *, steps: int,
                          l2: float) -> Callable[[np.ndarray], np.ndarray]:
    """``LogisticRegression`` (multinomial, L-BFGS) fitted to soft targets; returns its
    float[N, J] predictor (``predict_proba`` put back on all J columns).

    It takes hard labels only, so row i with target y_i becomes J rows (x_i, class j)
    weighted y_ij (rows of weight 0 dropped: the same objective on fewer rows), whose
    weighted log-loss is the soft cross-entropy; C = 1 / (2·l2·N) turns scikit-learn's
    C·sum(w·loss) + |W|²/2 into eMoE's mean cross-entropy + l2·|W|².
    """
    n, J = y.shape
    xs, cls, w = np.repeat(x, J, axis=0), np.tile(np.arange(J), n), y.reshape(-1)
    keep = w > 0
    est = LogisticRegression(C=1.0 / (2.0 * l2 * n), max_iter=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(xs[keep], cls[keep], sample_weight=w[keep])

    def predict(q: np.ndarray) -> np.ndarray:
        out = np.zeros((len(q), J))
        out[:, est.classes_] = est.predict_proba(q)
        return out

    return predict


def _soft_ce(p: np.ndarray, y: np.ndarray) -> float:
    return float(-(y * np.log(p + 1e-12)).sum(axis=1).mean())


def bench_emoe(store: Trace, test: Trace, variant: str, repeats: int) -> dict[str, Any]:
    """eMoE's hand-written softmax regressions against ``LogisticRegression``."""

    def fit_ours() -> EMoE:
        p = PREDICTORS.build("emoe", dims=store.dims, variant=variant)
        assert isinstance(p, EMoE)
        p.fit(store)
        return p

    fit_s, pred = best_of(fit_ours, repeats)
    L = store.dims.num_layers
    full, prefill = store_histories(store)
    pairs = [training_pairs(full, prefill, variant, layer) for layer in range(L)]
    sk_fit_s, sk = best_of(lambda: [sklearn_soft_logistic(x, y, steps=pred.steps, l2=pred.l2)
                                  for x, y in pairs], repeats)
    tfull, tprefill = store_histories(test)
    tests = [training_pairs(tfull, tprefill, variant, layer) for layer in range(L)]
    ce = np.mean([_soft_ce(m.predict(x), y) for m, (x, y) in zip(pred.models, tests,
                                                                 strict=True)])
    sk_ce = np.mean([_soft_ce(f(x), y) for f, (x, y) in zip(sk, tests, strict=True)])
    q = pairs[-1][0][:1]
    return {
        "fit_s": round(fit_s, 4), "sklearn_fit_s": round(sk_fit_s, 4),
        "test_soft_ce": round(float(ce), 4), "sklearn_test_soft_ce": round(float(sk_ce), 4),
        "uniform_ce": round(float(np.log(store.dims.num_experts)), 4),
        "query_us": round(_per_call_us(lambda i: pred.models[-1].predict(q), 2000, repeats), 1),
        "sklearn_query_us": round(_per_call_us(lambda i: sk[-1](q), 2000, repeats), 1),
        "params": int(pred.stats()["params"]),
    }


def measure(trace: str | None = None, distance: int = 2, k: int = 3, repeats: int = 3,
            seed: int = 0, large_j_variants: tuple[str, ...] = ("emoe_l",)) -> dict[str, Any]:
    """Every comparison on ``trace`` (default: :func:`synthetic_trace`), and eMoE's
    ``large_j_variants`` on a synthetic trace of Qwen1.5-MoE's shape."""
    if trace is None:
        tr, source = synthetic_trace(seed), "synthetic (tiny model's shape)"
    else:
        tr, source = io.load(trace), str(trace)
    store, test = tr.split("store"), tr.split("test")
    out: dict[str, Any] = {"trace": source, "requests_store": len(store.requests),
                           "requests_test": len(test.requests),
                           "sklearn_import_s": round(sklearn_import_s(repeats), 3)}
    out["learned_mlp"] = bench_learned_mlp(store, test, distance, repeats, seed)
    out["semantic_knn"] = bench_semantic_knn(store, test, k, repeats)
    for variant in ("emoe_l", "emoe_a"):
        out[variant] = bench_emoe(store, test, variant, repeats)
    big = _synthetic(QWEN_SHAPE, with_hidden=False, seed=seed)
    for variant in large_j_variants:
        out[f"{variant}_qwen"] = bench_emoe(big.split("store"), big.split("test"), variant,
                                            repeats)
    return out


def run(**kwargs: Any) -> dict[str, Any]:
    """:func:`measure` with BLAS on one thread."""
    with threadpool_limits(limits=1, user_api="blas"):
        return measure(**kwargs)
