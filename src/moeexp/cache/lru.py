"""``lru``: one global least-recently-used pool over all layers (DeepSpeed-style on-demand).

Recency is the order of events: a key becomes most recent when inserted (loaded or
prefetched) and again whenever a layer uses it. The victim is the least recent key that is
not protected.
"""

from __future__ import annotations

from collections import OrderedDict

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError


@CACHES.register("lru")
class LRUCache(CachePolicy):
    """Global LRU. ``victim`` walks the recency list from the oldest key: O(1) amortised."""

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers, num_experts=num_experts)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        if self.has_room(incoming):
            return None
        for key in self._order:
            if key not in protected:
                return key
        raise ConfigError(
            f"{self.name}: no evictable expert for {incoming} (capacity "
            f"{self.capacity_slots} slots, {len(protected)} protected)"
        )

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        allowed = set(candidates)
        for key in self._order:
            if key in allowed:
                return key
        raise ValueError("no candidate is resident")

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._order.pop(key, None)
