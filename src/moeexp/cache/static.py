"""Static pinning: the most used experts of the store split stay resident for the whole run.

``fit`` ranks every (layer, expert) by how often the store split used it and pins the top
``capacity_slots - scratch`` keys; :meth:`initial_residents` returns them so the mechanism
loads them before the first request, and they are never evicted.

A miss on a non-pinned expert must still be served (the mechanism loads it on demand), so
``scratch`` slots stay unpinned and behave as an LRU among the non-pinned residents
(prefetched experts land there too). Default ``scratch_slots=None`` takes a quarter of the
cache, at least 1 and at most one layer's worth (J): one slot is enough for one-token
decode with K=1, but a layer touching several non-pinned experts at once needs as many
scratch slots as it holds protected at a time; raise ``scratch_slots`` if the mechanism
reports that every evictable expert is protected. The victim comes from
:class:`~moeexp.cache.base.RankedPolicy`'s heap: a scratch key's rank (its last use) changes only at its own
insert and accesses, and a pinned key has none (it is never a victim).
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from moeexp.cache.base import CACHES, Key, RankedRecencyPolicy
from moeexp.errors import ConfigError
from moeexp.traces.schema import Trace

log = logging.getLogger(__name__)

RankBy = Literal["accesses", "tokens"]


def usage_counts(store: Trace, rank_by: RankBy = "accesses") -> np.ndarray:
    """float64[L, J]: use of each expert over ``store``.

    ``accesses`` counts (iteration, layer, expert) triples with at least one token (the unit
    of ``hit_rate``); ``tokens`` counts routed tokens.
    """
    L, J = store.dims.num_layers, store.dims.num_experts
    out = np.zeros((L, J), dtype=np.float64)
    for it in range(store.num_iterations):
        c = store.iteration_counts(it)
        out += (c > 0) if rank_by == "accesses" else c
    return out


@CACHES.register("static")
class Static(RankedRecencyPolicy):
    """Pins the store split's most used experts; LRU scratch slots serve the rest.

    Args:
        capacity_slots: total slots.
        num_layers: L.
        num_experts: J.
        scratch_slots: unpinned LRU slots; ``None`` = max(1, min(J, capacity_slots // 4)).
            Must leave at least 0 pinned and be >= 1.
        rank_by: ``accesses`` (default) or ``tokens``: how "most used" is counted.
    """

    def __init__(
        self,
        *,
        capacity_slots: int,
        num_layers: int,
        num_experts: int,
        scratch_slots: int | None = None,
        rank_by: RankBy = "accesses",
    ) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if scratch_slots is None:
            scratch_slots = max(1, min(num_experts, capacity_slots // 4))
        if not 1 <= scratch_slots <= capacity_slots:
            raise ConfigError(
                f"static: scratch_slots must be in 1..capacity ({capacity_slots}), got "
                f"{scratch_slots}")
        if rank_by not in ("accesses", "tokens"):
            raise ConfigError(f"static: rank_by must be 'accesses' or 'tokens', got {rank_by!r}")
        self.scratch_slots = scratch_slots
        self.rank_by: RankBy = rank_by
        self.pinned: frozenset[Key] = frozenset()
        self._pinned_order: list[Key] = []

    def fit(self, store: Trace) -> None:
        """Pin the ``capacity_slots - scratch_slots`` most used keys of ``store``.

        Ties are broken by (layer, expert) order, so the result is deterministic.
        """
        if (store.dims.num_layers, store.dims.num_experts) != (self.num_layers, self.num_experts):
            raise ConfigError(
                f"static: store trace has L={store.dims.num_layers}, J={store.dims.num_experts} "
                f"but the cache was built for L={self.num_layers}, J={self.num_experts}")
        use = usage_counts(store, self.rank_by).reshape(-1)
        n_pin = min(self.capacity_slots - self.scratch_slots, use.size)
        order = np.lexsort((np.arange(use.size), -use))[:n_pin]
        J = self.num_experts
        self._pinned_order = [(int(i) // J, int(i) % J) for i in order]
        self.pinned = frozenset(self._pinned_order)
        self.rerank(self.resident)  # residents before a (re)fit may have changed sides
        log.info("static: pinned %d experts, %d scratch slots", len(self.pinned),
                 self.scratch_slots)

    def initial_residents(self) -> list[Key]:
        """The pinned keys, most used first."""
        return list(self._pinned_order)

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        try:
            return super().victim(incoming, protected, now)
        except ConfigError as e:
            raise ConfigError(
                f"{e}; static keeps {len(self.pinned)} pinned experts and "
                f"{self.scratch_slots} scratch slots: raise cache.scratch_slots") from None

    def candidates(self, incoming: Key) -> list[Key]:
        return sorted(k for k in self.resident if k not in self.pinned)

    def rank(self, key: Key) -> int | None:
        """Last insert or access of a scratch key (least recent is evicted); None if pinned."""
        return None if key in self.pinned else self._last[key]

    def on_evict(self, key: Key) -> None:
        if key in self.pinned:
            log.warning("static: the mechanism evicted pinned expert %s", key)
        super().on_evict(key)
