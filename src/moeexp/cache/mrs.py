"""HybriMoE's "minus recent score" (MRS) cache (DAC'25, algorithms.md §11).

Every expert (l, j) carries a priority score S[l, j], updated whenever layer l's router runs
with that pass's router scores s (float[J], softmax probabilities)::

    S[l] = alpha * TopP(s) + (1 - alpha) * S[l]

where TopP keeps the ``top_p`` largest entries of s and zeroes the others (so an expert the
router no longer ranks decays by ``1 - alpha`` per pass of its layer). On a miss with no free
slot, the victim is the resident expert **of the incoming expert's layer** with the lowest S
(each layer owns ``slots_per_layer`` slots, as HybriMoE's per-layer ``load_size`` slots do);
ties go to the least recently used, then to the lowest key.

Read from HybriMoE's released code (github PKU-SEC-Lab/HybriMoE at 508a85b,
``ktransformers/operators/experts.py``: ``KScoreAwareCache.update_priority_scores`` and
``get_expert_to_unload``, called from ``KExpertsCache.load_expert_weights``; alpha 0.5,
top_p ``2 * top_k`` in ``modeling_deepseek.py``). Its update reads the router scores of the
pass's **first token** only (``top_p_scores[0]``: every token at batch-1 decode); the
``mrs`` predictor sends that row, so this cache sees the same.

The router scores reach this policy through :meth:`observe_scores`: the mechanism hands a
cache only keys (``on_access``) and the predictor's per-layer scores, so a predictor must
forward them (``predictor=mrs`` sends layer l's router row at ``observe_layer(l)``). On a
routing-only trace the row is the renormalised top-K weights, zeros elsewhere (the nearest
the trace allows: only the selected experts' scores are recorded). With a predictor that
sends nothing, S stays 0 and the policy is LRU within each layer (``lru_per_layer``).
"""

from __future__ import annotations

import numpy as np

from moeexp.cache.base import CACHES, Key
from moeexp.cache.lru_per_layer import LRUPerLayer
from moeexp.errors import ConfigError


def mrs_update(score_row: np.ndarray, router_row: np.ndarray, alpha: float, top_p: int) -> None:
    """In place: ``score_row`` (float64[J], S[l]) <- alpha * TopP(router_row) + (1 - alpha)
    * score_row, TopP keeping the ``top_p`` largest of ``router_row`` (float[J]; ties: the
    lower expert id), the rest 0."""
    keep = np.argsort(-np.asarray(router_row, dtype=np.float64), kind="stable")[:top_p]
    score_row *= 1.0 - alpha
    score_row[keep] += alpha * np.asarray(router_row, dtype=np.float64)[keep]


def check_mrs(name: str, alpha: float, top_p: int | None, num_experts: int) -> None:
    """ConfigError unless 0 < alpha <= 1 and top_p (when given) is in 1..J."""
    if not 0.0 < float(alpha) <= 1.0:
        raise ConfigError(f"{name}: alpha={alpha} must be in (0, 1] (HybriMoE: 0.5)")
    if top_p is not None and not 1 <= int(top_p) <= num_experts:
        raise ConfigError(f"{name}: top_p={top_p} must be in 1..J={num_experts} or null "
                          "(HybriMoE: 2 * top_k)")


@CACHES.register("mrs")
class MinusRecentScore(LRUPerLayer):
    """MRS eviction within each layer's slots.

    Args:
        capacity_slots, num_layers, num_experts: as every policy.
        slots_per_layer: slots each layer owns (``None``: ``capacity_slots // L``).
        alpha: weight of the newest router scores (HybriMoE: 0.5).
        top_p: router scores kept per update (``None``: every expert; the ``mrs``
            predictor sends rows already cut to its own ``top_p``, 2K by default).
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 slots_per_layer: int | None = None, alpha: float = 0.5,
                 top_p: int | None = None) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts, slots_per_layer=slots_per_layer)
        check_mrs(f"cache={self.name}", alpha, top_p, num_experts)
        self.alpha = float(alpha)
        self.top_p = num_experts if top_p is None else int(top_p)
        #: float64[L, J]: S, the priority scores
        self.scores = np.zeros((num_layers, num_experts))

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        """``scores``: layer -> float[J] router scores of that layer's latest pass."""
        for layer, row in scores.items():
            mrs_update(self.scores[layer], row, self.alpha, self.top_p)

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        s = self.scores
        return min(candidates, key=lambda k: (s[k], self.last_use(k), k))
