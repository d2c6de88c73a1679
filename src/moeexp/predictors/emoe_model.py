"""eMoE's small routing-history model: per-layer softmax regression with soft targets (numpy).

The paper's predictor is an XLNet-sized transformer; moeexp uses a linear softmax model per
layer (``algorithms.md`` §6 allows a smaller model; its size is reported by ``stats()``).

Why it is hand-written and not scikit-learn's multinomial ``LogisticRegression`` (L-BFGS):
the targets are distributions (soft labels), which it does not take, so each row must
become J rows weighted by its target (the rows of weight 0 dropped). Both reach the same
optimum: test-split soft cross-entropy 2.7336 (emoe_l) and 2.7430 (emoe_a) for both on the
tiny model's ShareGPT trace, and ``system=emoe`` replays (periods 1 and 40, both variants)
moved hit rate by at most +0.0008. But the J-fold rows make it slower as J grows: at
Qwen1.5-MoE's shape (L = 24, J = 60, K = 4, synthetic) 0.69 s against 0.42 s (emoe_l) and
25.4 s against 6.8 s (emoe_a); at the tiny model's J = 16 it is faster (0.03-0.09 s
against 0.14-0.17 s), but importing scikit-learn costs 0.7-1.5 s per process, more than this
whole fit, so a run's ``fit_time_s`` would go from 0.18 s to 0.59 s. Prediction is a numpy
softmax either way (``predict_proba``: 70-110 us per query against 5-7 us). Measured with
BLAS on one thread: ``moeexp.bench.predictor_fit`` (``run(trace=...)`` for a recorded trace).
"""

from __future__ import annotations

import numpy as np

from moeexp.traces.schema import Trace


class SoftmaxRegression:
    """p = softmax(x W + b): float[N, D] -> float[N, J] distributions.

    W starts at 0 and b at log(prior), so with no data the model predicts ``prior``.
    Training minimises the mean soft cross-entropy -sum_j y_j log p_j plus ``l2``·|W|²
    by full-batch Adam.
    """

    def __init__(self, in_dim: int, num_out: int, prior: np.ndarray,
                 rng: np.random.Generator) -> None:
        self.W = rng.normal(0.0, 1e-3, (in_dim, num_out))
        self.b = np.log(np.asarray(prior, dtype=np.float64) + 1e-6)
        self.final_loss = float("nan")

    @property
    def num_params(self) -> int:
        return int(self.W.size + self.b.size)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """float64[N, J] rows summing to 1."""
        z = np.asarray(x, dtype=np.float64) @ self.W + self.b
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean soft cross-entropy (without the L2 term)."""
        p = self.predict(x)
        return float(-(y * np.log(p + 1e-12)).sum(axis=1).mean())

    def fit(self, x: np.ndarray, y: np.ndarray, *, steps: int, lr: float, l2: float) -> None:
        """x float[N, D], y float[N, J] target distributions; no-op when N == 0."""
        if len(x) == 0:
            return
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        mw, vw = np.zeros_like(self.W), np.zeros_like(self.W)
        mb, vb = np.zeros_like(self.b), np.zeros_like(self.b)
        b1, b2, eps = 0.9, 0.999, 1e-8
        for t in range(1, steps + 1):
            g = (self.predict(x) - y) / len(x)  # d(mean CE)/dz
            gw = x.T @ g + 2 * l2 * self.W
            gb = g.sum(axis=0)
            for p, gp, m, v in ((self.W, gw, mw, vw), (self.b, gb, mb, vb)):
                m *= b1
                m += (1 - b1) * gp
                v *= b2
                v += (1 - b2) * gp * gp
                p -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        self.final_loss = self.loss(x, y)


def _rows(a: np.ndarray) -> np.ndarray:
    s = a.sum(axis=-1, keepdims=True)
    return np.where(s > 0, a / np.where(s > 0, s, 1.0), 1.0 / a.shape[-1])


def training_pairs(full: np.ndarray, prefill: np.ndarray, variant: str,
                   layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) that layer ``layer``'s regression learns, from :func:`store_histories`.

    ``emoe_a``: x = a request's whole L*J distribution, y = the next request's layer row;
    ``emoe_l``: layer 0 from the previous request's layer 0, layer i >= 1 from the same
    request's prefill distribution at layer i-1 (y: its whole-request row at layer i).
    """
    _, L, J = full.shape
    if variant == "emoe_a":
        return full[:-1].reshape(-1, L * J), full[1:, layer]
    if layer == 0:
        return full[:-1, 0], full[1:, 0]
    return prefill[:, layer - 1], full[:, layer]


def store_histories(store: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per store request (trace order): float64[R, L, J] distributions of routed tokens.

    Returns (whole request: all iterations, prefill: its first iteration only); each layer's
    row sums to 1 (uniform for a layer that received no token).
    """
    L, J = store.dims.num_layers, store.dims.num_experts
    R = len(store.requests)
    full = np.zeros((R, L, J))
    first = np.zeros((R, L, J))
    for i, r in enumerate(store.requests):
        its = store.request_iterations(r.request_id)
        for k, it in enumerate(its):
            c = store.iteration_counts(int(it))
            full[i] += c
            if k == 0:
                first[i] = c
    return _rows(full), _rows(first)
