"""``lru2``: LRU-2 (O'Neil, O'Neil and Weikum, SIGMOD 1993) over all layers' experts.

Evict the resident expert whose second-to-last use is oldest. A use is an access (a layer
computing with the expert); an insert (a prefetch or an on-demand load) is not a use. An
expert used fewer than two times has no second-to-last use and goes first; among those, the
least recently used (or, never used, least recently inserted) goes first; then the lowest
``(layer, expert)``. Every expert's last two uses are kept across evictions, as LRU-K's
history is (its "retained information period" unbounded here: there are only L * J
experts): an expert that returns is ranked by its uses before it left. (LRU-K's
"correlated reference period" is not modelled.) The victim comes from
:class:`RankedPolicy`'s heap: a key's rank changes only at its own insert and accesses.
"""

from __future__ import annotations

from moeexp.cache.base import CACHES, Key, RankedPolicy


@CACHES.register("lru2")
class LRU2Cache(RankedPolicy):
    """Least recent second-to-last use first.

    Args:
        capacity_slots: total slots (all layers share one pool).
        num_layers: L.
        num_experts: J.
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        self._uses: dict[Key, tuple[int, int]] = {}  # key -> ``now`` of its (second-to-last,
        #   last) use, -1 for none; kept across evictions
        self._inserted: dict[Key, int] = {}  # resident key -> ``now`` of its insert

    def rank(self, key: Key) -> tuple[int, int]:
        """(second-to-last use or -1, last use or else the insert): lowest is evicted."""
        second, last = self._uses[key]
        return (second, last if last >= 0 else self._inserted[key])

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        if key not in self.resident:
            self._uses.setdefault(key, (-1, -1))
            self._inserted[key] = now
        super().on_insert(key, now, prefetched)  # marks key to be re-ranked

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        if key not in self._inserted:
            return  # not resident: nothing to rank
        self._uses[key] = (self._uses[key][1], now)
        super().on_access(key, now, hit)  # marks key to be re-ranked

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._inserted.pop(key, None)  # its uses stay: they rank it when it returns
