"""Layer-to-layer transition matrix P(e_{l+1} | e_l): the simplest pattern-history predictor.

ExFlow's "inter-layer affinity" (algorithms.md §7): from the store split, count for every
token and every pair (a selected at layer l, b selected at layer l+1) one co-occurrence,
add Laplace smoothing ``alpha`` and normalise each row into P_l[a, b] = P(e_{l+1}=b | e_l=a).

At layer l the observed routing gives a distribution over layer l's experts,
v_l = counts / sum(counts) (tokens routed to each expert this iteration); chaining the
matrices gives the distribution d layers ahead, v_{l+d} = v_l P_l P_{l+1} ... P_{l+d-1},
and the predictor prefetches its top experts for layer l+d. How many: ``top_n`` (default
K), raised to the number of distinct experts observed at layer l when more tokens than one
spread over more experts (a prefill typically touches many experts at every layer).
"""

from __future__ import annotations

import time

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import PREDICTORS, LayerObservation, Prediction, Predictor
from moeexp.predictors.speculative import layer_prediction
from moeexp.traces.schema import Trace, TraceDims


def transition_counts(store: Trace) -> np.ndarray:
    """float64[L-1, J, J]: C[l, a, b] = tokens with a in top-K at l and b in top-K at l+1."""
    L, J = store.dims.num_layers, store.dims.num_experts
    idx = store.topk_idx.astype(np.int64)  # [N, L, K]
    out = np.zeros((max(L - 1, 0), J, J), dtype=np.float64)
    for layer in range(L - 1):
        a = idx[:, layer, :, None]  # [N, K, 1]
        b = idx[:, layer + 1, None, :]  # [N, 1, K]
        flat = (a * J + b).reshape(-1)
        out[layer] = np.bincount(flat, minlength=J * J).reshape(J, J)
    return out


@PREDICTORS.register("layer_transition")
class LayerTransition(Predictor):
    """Predicts layer l+d from layer l's observed experts by chaining P(e_{l+1} | e_l).

    Args:
        dims: trace dimensions.
        distance: d >= 1 layers ahead (config default: the model's ``prefetch_distance``).
        alpha: Laplace smoothing added to every count (> 0 keeps unseen pairs possible).
        top_n: experts to prefetch per predicted layer (default: K).
    """

    def __init__(self, *, dims: TraceDims, distance: int = 1, alpha: float = 1.0,
                 top_n: int | None = None) -> None:
        super().__init__(dims=dims)
        if not 1 <= int(distance) <= dims.num_layers - 1:  # else it never predicts a layer
            raise ConfigError(f"layer_transition: distance must be in 1..{dims.num_layers - 1} "
                              f"(the model has {dims.num_layers} MoE layers), got {distance}")
        if alpha < 0:
            raise ConfigError(f"layer_transition: alpha must be >= 0, got {alpha}")
        self.distance = int(distance)
        self.alpha = float(alpha)
        self.top_n = dims.top_k if top_n is None else int(top_n)
        if self.top_n < 1:
            raise ConfigError(f"layer_transition: top_n must be >= 1, got {self.top_n}")
        L, J = dims.num_layers, dims.num_experts
        self.trans = np.full((max(L - 1, 0), J, J), 1.0 / J)  # P_l rows, uniform until fit
        self._chain: list[np.ndarray | None] = [None] * L
        self._query_ns = 0
        self._queries = 0

    def fit(self, store: Trace) -> None:
        """Count transitions on ``store`` and precompute the d-step chains."""
        C = transition_counts(store) + self.alpha
        rows = C.sum(axis=-1, keepdims=True)
        J = self.dims.num_experts
        self.trans = np.where(rows > 0, C / np.where(rows > 0, rows, 1.0), 1.0 / J)
        L, d = self.dims.num_layers, self.distance
        self._chain = [None] * L
        for layer in range(L - d):
            M = np.eye(J)
            for m in range(d):
                M = M @ self.trans[layer + m]
            self._chain[layer] = M

    def distribution(self, layer: int, counts: np.ndarray) -> np.ndarray | None:
        """float64[J]: predicted expert distribution at layer+d given layer's counts[J]."""
        M = self._chain[layer] if layer < len(self._chain) else None
        total = float(np.sum(counts))
        if M is None or total <= 0:
            return None
        return (np.asarray(counts, dtype=np.float64) / total) @ M

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        t0 = time.perf_counter_ns()
        target = obs.layer + self.distance
        if target >= self.dims.num_layers:
            return Prediction()
        dist = self.distribution(obs.layer, obs.counts)
        if dist is None:
            return Prediction()
        n = min(self.dims.num_experts, max(self.top_n, len(obs.experts)))
        order = np.lexsort((np.arange(len(dist)), -dist))[:n]
        out = layer_prediction(target, order, dist, self.dims.num_layers)
        self._query_ns += time.perf_counter_ns() - t0
        self._queries += 1
        return out

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        return {"params": float(self.trans.size), "query_us_mean": q}
