"""eMoE's cache policy: keep the predicted resident set (algorithms.md §6).

eMoE decides *which* experts are resident (the predictor's set, refreshed every p prompts)
and loads that set; no existing policy keeps it: when a new set is prefetched, LRU or LFU
may evict members of the new set that were merely unused lately while keeping experts the
predictor dropped. This policy reads the predictor's per-layer ``scores`` (the eMoE
predictor sends N normalised per layer, 0 for unselected experts) and evicts:

1. resident experts outside the predicted set (score 0, or a layer without scores yet),
   least recently used first;
2. only if every candidate is in the set, the one with the lowest score, then LRU.

With restricted routing nothing is loaded on demand, so the set stays resident between
predictions; without it (``backend.restricted_routing=false``), on-demand loads land
outside the set and are the first to go. With any other predictor it is "lowest predicted
probability first, ties LRU".
"""

from __future__ import annotations

import numpy as np

from moeexp.cache.base import CACHES, Key, RecencyPolicy


@CACHES.register("emoe")
class EMoECache(RecencyPolicy):
    """Evict outside the predicted set first (LRU), then the lowest predicted score.

    Args:
        capacity_slots: total slots.
        num_layers: L.
        num_experts: J.
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        self._scores: dict[int, np.ndarray] = {}

    def score(self, key: Key) -> float:
        """The predictor's latest score of ``key`` (0 when its layer has none)."""
        s = self._scores.get(key[0])
        return 0.0 if s is None else float(s[key[1]])

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        def rank(k: Key) -> tuple[bool, float, int, Key]:
            s = self.score(k)
            return (s > 0, s, self.last_use(k), k)

        return min(candidates, key=rank)

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        for layer, s in scores.items():
            self._scores[int(layer)] = np.asarray(s, dtype=np.float64).copy()
