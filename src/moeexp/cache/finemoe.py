"""FineMoE's expert cache (algorithms.md §5): evict the lowest ``p · freq``, in floating point.

- ``p[l, j]``: the probability of expert j in the searched map that speaks for layer l,
  received through :meth:`observe_scores` (the ``expert_map`` predictor sends the uniform
  ``1/J`` for every layer no map speaks for at each iteration start; layers never scored
  start at ``1/J``).
- ``freq[l, j]``: visits of the expert while resident ("in-cache visit count"; reset when it
  is evicted). ``frequency: lifetime`` keeps counting across evictions (what the authors'
  code does).
- The product stays a float (the authors' first release truncated it to an integer: a bug
  this class must not reproduce). Recency is not used. Ties: lowest (layer, expert).
- A miss pauses prefetching (:attr:`pause_prefetch_on_miss`).

Choice where the paper is silent (``protect_prefetched``, default true): an expert that was
just prefetched has ``freq = 0``, so ``p · freq = 0`` would make it the next victim of the
following prefetch. Like the authors' code, a prefetched expert that has not been used yet
is only evicted when every other candidate is such an expert too, until its layer has run
once after its insertion (then, if unused, it is an ordinary ``freq = 0`` resident).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError


@CACHES.register("finemoe")
class FineMoECache(CachePolicy):
    """Config keys: ``protect_prefetched`` (bool), ``frequency`` (``in_cache`` | ``lifetime``)."""

    pause_prefetch_on_miss = True

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 protect_prefetched: bool = True,
                 frequency: Literal["in_cache", "lifetime"] = "in_cache") -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if frequency not in ("in_cache", "lifetime"):
            raise ConfigError(f"cache=finemoe: frequency={frequency!r}; valid: in_cache, lifetime")
        self.protect_prefetched = bool(protect_prefetched)
        self.frequency = frequency
        self.p = np.full((num_layers, num_experts), 1.0 / num_experts)
        self.freq = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._accesses = 0  # accesses seen so far (an event counter, not a clock)
        self._layer_ran = np.zeros(num_layers, dtype=np.int64)  # access number of latest use
        self._pending: dict[Key, int] = {}  # prefetched, not used yet -> accesses at insert

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        """Set ``p`` of the given layers (float[J] each; values outside [0, 1] are an error)."""
        if not scores:
            return
        layers = list(scores)
        rows = np.asarray([scores[i] for i in layers], dtype=np.float64)
        if (rows.shape != (len(layers), self.num_experts) or (rows < 0).any()
                or (rows > 1 + 1e-6).any()):
            raise ValueError(f"finemoe cache: scores must be {self.num_experts} probabilities "
                             f"per layer, got {rows.shape} for layers {layers}: {rows}")
        self.p[layers] = rows

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        if prefetched and self.protect_prefetched:
            self._pending[key] = self._accesses

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self._accesses += 1
        self._layer_ran[key[0]] = self._accesses
        self.freq[key] += 1
        self._pending.pop(key, None)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._pending.pop(key, None)
        if self.frequency == "in_cache":
            self.freq[key] = 0

    def priorities(self) -> np.ndarray:
        """float[L, J]: ``p · freq`` of every (layer, expert), the eviction order."""
        return self.p * self.freq

    def priority(self, key: Key) -> float:
        """``p · freq`` of a key (float)."""
        return float(self.priorities()[key])

    def _waiting(self) -> set[Key]:
        """Prefetched, unused keys whose layer has not run since they arrived (expired
        entries are dropped: they are ordinary ``freq = 0`` residents from now on)."""
        ran = self._layer_ran
        expired = [k for k, at in self._pending.items() if ran[k[0]] > at]
        for k in expired:
            del self._pending[k]
        return set(self._pending)

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        """:meth:`choose` over every unprotected resident, on the (L, J) matrices at once."""
        if self.has_room(incoming):
            return None
        waiting = self._waiting() if self._pending else None
        return self.lowest_priority(incoming, protected, self.priorities(), waiting)

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        """The same rule on an explicit candidate list (the base class's path)."""
        waiting = self._waiting() if self._pending else set()
        pool = [k for k in candidates if k not in waiting] or candidates
        prio = self.priorities()
        return min(pool, key=lambda k: (prio[k], k))
