"""MoE-Infinity's expert cache (algorithms.md §4).

``variant: paper`` (Algorithm 1 of MoE-Infinity v3): the priority of a resident expert
``(l, e)`` is ``(pEAM[l][e] + ε) / Σ_j pEAM[l][j] · (1 − l/L)``; evict the lowest. Early layers
are favoured because prefetching helps them least. ``pEAM`` rows come from the predictor
(:meth:`observe_scores`, the ``eam`` predictor's pEAM); a layer never scored, or scored with
an all-zero row, counts as uniform (``1/J`` each).

``variant: oss`` (the public code): least in-cache visit count over all layers (LFU; the
count resets when the expert leaves the device). It ranks by no pEAM, so it ignores the
predictor's rows (:meth:`observe_scores` returns at once: ``peam`` stays uniform).

Ties: lowest (layer, expert).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError


@CACHES.register("moe_infinity")
class MoEInfinityCache(CachePolicy):
    """Config keys: ``variant`` (``paper`` | ``oss``), ``epsilon`` (Algorithm 1's ε)."""

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 variant: Literal["paper", "oss"] = "paper", epsilon: float = 1e-6) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if variant not in ("paper", "oss"):
            raise ConfigError(f"cache=moe_infinity: variant={variant!r}; valid: paper, oss")
        if epsilon < 0:
            raise ConfigError(f"cache=moe_infinity: epsilon={epsilon} must be >= 0")
        self.variant = variant
        self.epsilon = float(epsilon)
        self.peam = np.full((num_layers, num_experts), 1.0 / num_experts)
        # in-cache visit counts (oss's rank), whole numbers kept as float64: what victim()
        # ranks by, updated per access with no int -> float copy (exact below 2^53)
        self.visits = np.zeros((num_layers, num_experts))
        self._decay = 1.0 - np.arange(num_layers) / num_layers
        # paper: Algorithm 1's matrix, what victim() ranks by (recomputed after new scores)
        self._prio: np.ndarray | None = None

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        """Keep the pEAM rows ``scores`` (layer -> float[J], non-negative) for Algorithm 1;
        ``oss`` ignores them (its LFU reads no pEAM; the ``eam`` predictor sends rows at
        every new match: checking and storing them was ~6 % of a moe_infinity_oss replay)."""
        if not scores or self.variant == "oss":
            return
        layers = list(scores)
        rows = np.asarray([scores[i] for i in layers], dtype=np.float64)
        if rows.shape != (len(layers), self.num_experts) or not rows.min() >= 0:  # NaN fails
            raise ValueError(f"moe_infinity cache: scores must be {self.num_experts} "
                             f"non-negative values per layer, got {rows.shape} for {layers}")
        rows[rows.sum(axis=1) <= 0] = 1.0 / self.num_experts
        self.peam[layers] = rows
        self._prio = None

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self.visits[key] += 1.0

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self.visits[key] = 0.0

    def priorities(self) -> np.ndarray:
        """float[L, J]: Algorithm 1's priority (paper: (PEAM + ε) / row sum × layer decay)
        or the visit count (oss) of every (layer, expert); the lowest is evicted."""
        if self.variant == "oss":
            return self.visits.copy()
        return ((self.peam + self.epsilon) / self.peam.sum(axis=1, keepdims=True)
                * self._decay[:, None])

    def priority(self, key: Key) -> float:
        """:meth:`priorities` of one key."""
        return float(self.priorities()[key])

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        """:meth:`choose` over every unprotected resident, on the (L, J) matrices at once."""
        if self.has_room(incoming):
            return None
        if self.variant == "oss":
            prio = self.visits
        else:
            if self._prio is None:
                self._prio = self.priorities()
            prio = self._prio
        return self.lowest_priority(incoming, protected, prio)

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        """The same rule on an explicit candidate list (the base class's path)."""
        prio = self.priorities()
        return min(candidates, key=lambda k: (prio[k], k))
