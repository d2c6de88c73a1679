"""HybriMoE's prefetch (DAC'25, algorithms.md §11): the next layer's highest "minus recent
score" experts, and the router scores that HybriMoE's MRS cache (``cache=mrs``) ranks by.

At ``observe_layer(l)`` (layer l's router has run) the predictor

1. takes the router scores of the pass's first token (HybriMoE's ``top_p_scores[0]``: the
   one token of a batch-1 decode), cut to their ``top_p`` largest (others 0), and sends
   them as layer l's ``scores`` (the ``mrs`` cache folds them into its S);
2. folds them into its own copy of S (:func:`moeexp.cache.mrs.mrs_update`, same alpha);
3. in a one-token pass (decode), prefetches the ``prefetch_size`` experts of layer l+1 with
   the highest S[l+1] (scores of layer l+1's earlier passes: its router has not run yet).

Read from HybriMoE's released code (github PKU-SEC-Lab/HybriMoE at 508a85b,
``ktransformers/operators/experts.py``: ``KExpertsCache.prefetch_expert`` ->
``KScoreAwareCache.get_experts_to_prefetch``, issued in the decode path only). The paper
calls its prefetch "impact-driven" (it simulates the gain of preloading each candidate of
the next layers); the released code ranks the next layer's candidates by MRS score alone,
and that is what is modelled here (a score-ranked next-layer prefetch, not the paper's
impact simulation, which the code does not contain). Its command line defaults to
``--prefetch_size 0``; ``null`` here means K.
"""

from __future__ import annotations

import numpy as np

from moeexp.cache.mrs import check_mrs, mrs_update
from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    EMPTY,
    PREDICTORS,
    LayerObservation,
    Prediction,
    Predictor,
    topk_prefetch,
)
from moeexp.traces.schema import TraceDims


@PREDICTORS.register("mrs")
class MrsPrefetch(Predictor):
    """Router scores to the cache; next-layer prefetch by MRS score in decode.

    Args:
        dims: trace dimensions.
        alpha: weight of the newest scores (HybriMoE: 0.5).
        top_p: router scores kept per update (``None``: 2K, HybriMoE's ``2 * top_k``).
        prefetch_size: experts of layer l+1 prefetched per decode layer (``None``: K;
            0: scores only, no prefetch).
    """

    def __init__(self, *, dims: TraceDims, alpha: float = 0.5, top_p: int | None = None,
                 prefetch_size: int | None = None) -> None:
        super().__init__(dims=dims)
        J = dims.num_experts
        top_p = min(2 * dims.top_k, J) if top_p is None else top_p
        check_mrs(f"predictor={self.name}", alpha, top_p, J)
        k = dims.top_k if prefetch_size is None else prefetch_size
        if not 0 <= int(k) <= J:
            raise ConfigError(f"predictor={self.name}: prefetch_size={prefetch_size} must be "
                              f"in 0..J={J} or null (K)")
        self.alpha, self.top_p, self.prefetch_size = float(alpha), int(top_p), int(k)
        #: float64[L, J]: S, as the cache keeps it
        self.scores = np.zeros((dims.num_layers, J))

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        layer, row = obs.layer, obs.probs[0]
        if not row.any():
            return EMPTY
        cut = np.zeros(row.shape[0])
        keep = np.argsort(-row.astype(np.float64), kind="stable")[: self.top_p]
        cut[keep] = row[keep]
        mrs_update(self.scores[layer], cut, self.alpha, self.top_p)
        pred = Prediction(scores={layer: cut})
        nxt = layer + 1
        if self.prefetch_size and obs.probs.shape[0] == 1 and nxt < self.dims.num_layers:
            pred.prefetch = topk_prefetch(nxt, self.scores[nxt], self.prefetch_size, 1.0)
            pred.predicted = {nxt: np.array([p.expert for p in pred.prefetch])}
        return pred
