"""FineMoE's "hit count" ablation predictor: the most frequently activated experts per layer.

Counts token activations per (layer, expert): over the store split (``mode: offline``,
frozen after :meth:`fit`) or over everything observed so far (``mode: online``, starting
from zero). It prefetches on FineMoE's schedule so that only the predictor differs in the
ablation: at iteration start (``l_now = −1``) layers ``0..d−1`` with priority
``p / (l + 1)``; after layer ``l``'s router, layer ``l + d`` with priority ``p / d``;
``p`` = the layer's count share. It prefetches the ``num_prefetch`` most counted experts of
the layer (default K) and reports the count shares as ``scores`` for the layers it
predicts. Layers with no counts yet get no prediction.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    PREDICTORS,
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
)
from moeexp.traces.schema import Trace, TraceDims

log = logging.getLogger(__name__)


@PREDICTORS.register("hit_count")
class HitCountPredictor(Predictor):
    """Count-based prediction. Config keys:

    Args:
        dims: trace dimensions.
        prefetch_distance: d, as for ``expert_map``.
        mode: ``offline`` (counts from the store split, frozen) or ``online`` (counts of the
            history observed during the run).
        num_prefetch: experts prefetched per layer (None: K).
    """

    def __init__(self, *, dims: TraceDims, prefetch_distance: int = 3,
                 mode: Literal["offline", "online"] = "offline",
                 num_prefetch: int | None = None) -> None:
        super().__init__(dims=dims)
        L, J = dims.num_layers, dims.num_experts
        n = dims.top_k if num_prefetch is None else int(num_prefetch)
        if mode not in ("offline", "online") or not 1 <= prefetch_distance <= L or not 1 <= n <= J:
            raise ConfigError(
                f"predictor=hit_count: mode={mode!r} (valid: offline, online), "
                f"prefetch_distance={prefetch_distance} (valid: 1..{L}), "
                f"num_prefetch={n} (valid: 1..{J})")
        self.mode = mode
        self.d = int(prefetch_distance)
        self.n = n
        self.counts = np.zeros((L, J), dtype=np.float64)

    def fit(self, store: Trace) -> None:
        """Offline: count the selected experts of every store-split token."""
        if self.mode == "online":
            return
        if any(r.split != "store" for r in store.requests):
            log.warning("hit_count.fit: ignoring non-store requests")
            store = store.split("store")
        L, J = self.dims.num_layers, self.dims.num_experts
        if (store.dims.num_layers, store.dims.num_experts) != (L, J):
            raise ConfigError(f"hit_count: trace has L={store.dims.num_layers}, "
                              f"J={store.dims.num_experts}; predictor built for L={L}, J={J}")
        idx = store.topk_idx.astype(np.int64)
        flat = (np.arange(L)[None, :, None] * J + idx).reshape(-1)
        self.counts = np.bincount(flat, minlength=L * J).reshape(L, J).astype(np.float64)

    def _layer(self, pred: Prediction, layer: int, distance: int) -> None:
        c = self.counts[layer]
        total = c.sum()
        if total <= 0:
            return
        p = c / total
        top = np.argsort(-p, kind="stable")[: self.n]
        top = top[p[top] > 0]
        pred.scores[layer] = p
        pred.predicted[layer] = np.sort(top)
        pred.prefetch.extend(Prefetch(float(p[e]) / distance, layer, int(e)) for e in top)

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        pred = Prediction()
        for layer in range(min(self.d, self.dims.num_layers)):
            self._layer(pred, layer, distance=layer + 1)
        return pred

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        if self.mode == "online":
            self.counts[obs.layer] += np.asarray(obs.counts, dtype=np.float64)
        pred = Prediction()
        if obs.layer + self.d < self.dims.num_layers:
            self._layer(pred, obs.layer + self.d, distance=self.d)
        return pred
