"""Global LFU: evict the resident expert used least often since it became resident.

"In-cache frequency": an expert's count starts at 0 when it is inserted (a prefetch or an
on-demand load does not count as a use) and grows by one per access (a layer using it in an
iteration); it is forgotten when the expert is evicted, so an expert that returns starts
from 0 again. Ties are broken by recency (least recently inserted-or-used first), then by
key. This is the eviction FineMoE's cache ablation calls "LFU" and MoE-Infinity's released
code uses (algorithms.md §4 ``variant: oss``, §9). The victim comes from
:class:`~moeexp.cache.base.RankedPolicy`'s heap: a key's rank (count, last use) changes only at its own insert
and accesses.
"""

from __future__ import annotations

from moeexp.cache.base import CACHES, Key, RankedRecencyPolicy


@CACHES.register("lfu")
class LFU(RankedRecencyPolicy):
    """Least in-cache frequency first; ties -> least recently used.

    Args:
        capacity_slots: total slots (all layers share one pool).
        num_layers: L.
        num_experts: J.
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        self._freq: dict[Key, int] = {}

    def rank(self, key: Key) -> tuple[int, int]:
        """(in-cache use count, last insert or access) of resident ``key``: lowest is evicted."""
        return (self._freq[key], self._last[key])

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        if key not in self.resident:
            self._freq[key] = 0
        super().on_insert(key, now, prefetched)  # last use; marks key to be re-ranked

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        super().on_access(key, now, hit)  # last use; marks key (if resident) to be re-ranked

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._freq.pop(key, None)

    def frequency(self, key: Key) -> int:
        """In-cache use count of ``key`` (0 if not resident)."""
        return self._freq.get(key, 0)
