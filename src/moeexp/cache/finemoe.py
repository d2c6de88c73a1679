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
following prefetch. A prefetched expert that has not been used yet is only evicted when
every other candidate is such an expert too, until its layer has run once after its
insertion (then, if unused, it is an ordinary ``freq = 0`` resident). ``true`` (ours)
applies this to every victim choice; ``v2`` (the authors' V2 code, ``csrc/cache.cpp``)
only to a prefetch's victim choice: an on-demand load may evict a waiting prefetched
expert; ``false`` never shields one.

``frequency``: ``in_cache`` (the paper's in-cache visit count, reset on eviction) or
``lifetime`` (the authors' V2 code never resets it).

``finemoe_v2`` is this policy with both of the authors' V2 rules (``protect_prefetched:
v2``, ``frequency: lifetime``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError
from moeexp.frozen_memo import FrozenMemo


@CACHES.register("finemoe")
class FineMoECache(CachePolicy):
    """Config keys: ``protect_prefetched`` (``true`` | ``false`` | ``v2``), ``frequency``
    (``in_cache`` | ``lifetime``); see the module docstring."""

    pause_prefetch_on_miss = True

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 protect_prefetched: bool | Literal["v2"] = True,
                 frequency: Literal["in_cache", "lifetime"] = "in_cache") -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if frequency not in ("in_cache", "lifetime"):
            raise ConfigError(f"cache={self.name}: frequency={frequency!r}; valid: in_cache, "
                              "lifetime")
        if not (isinstance(protect_prefetched, bool) or protect_prefetched == "v2"):
            raise ConfigError(f"cache={self.name}: protect_prefetched={protect_prefetched!r}; "
                              "valid: true, false, v2")
        #: whether a waiting prefetched expert is shielded at all, and also from demand loads
        self.protect_prefetched = protect_prefetched is not False
        self.protect_from_demand = protect_prefetched is True
        self.frequency = frequency
        self.p = np.full((num_layers, num_experts), 1.0 / num_experts)
        # visit counts (whole numbers, kept as float64: p · freq without an int cast)
        self.freq = np.zeros((num_layers, num_experts))
        # p · freq kept up to date entry by entry (victim reads it; priorities() recomputes)
        self._prio = self.p * self.freq
        # per-layer row views of freq and p · freq (a view per score update costs as much
        # as the product)
        self._freq_rows, self._prio_rows = list(self.freq), list(self._prio)
        self._checked: FrozenMemo[bool] = FrozenMemo()  # read-only score rows already checked
        # waiting prefetched experts (see the module docstring), per layer; any use of the
        # layer ends the wait of all of them (the used one is no longer unused, the others
        # saw their layer run). ``_shielded``: +inf at the waiting keys and outside the
        # resident set, else 0 (lowest_priority's ``shielded``).
        self._waiting_in: list[set[Key]] = [set() for _ in range(num_layers)]
        self._num_waiting = 0
        self._shielded = np.full((num_layers, num_experts), np.inf)

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        """Set ``p`` of the given layers (float[J] each; values outside [0, 1] are an error).

        A read-only array that owns its data and passed the check once is not checked
        again (the ``expert_map`` predictor resends the same memoised rows: one check per
        row instead of one per layer of every pass)."""
        if not scores:
            return
        if len(scores) == 1:  # one layer (each trajectory step): no stacking
            (layer, row), = scores.items()
            if self._checked.get(row) is None:
                self._check_row(row)
            self.p[layer] = row
            np.multiply(row, self._freq_rows[layer], out=self._prio_rows[layer])
            return
        checked, p, last = self._checked, self.p, None
        for row in scores.values():  # one check per distinct read-only row, as above
            if row is not last and checked.get(row) is None:  # (an iteration start
                self._check_row(row)  # sends one uniform row for most layers)
            last = row
        for layer, row in scores.items():  # row by row: cheaper than stacking them
            p[layer] = row
        if len(scores) == self.num_layers:  # every layer (each iteration start)
            np.multiply(p, self.freq, out=self._prio)
        else:
            layers = list(scores)
            self._prio[layers] = p[layers] * self.freq[layers]

    @staticmethod
    def _in_unit(row: np.ndarray) -> bool:
        """Every value of a float64[J] row in [0, 1 + 1e-6] (NaN fails both comparisons).
        On Python floats: for J values this beats two numpy reductions."""
        return all(0.0 <= v <= 1 + 1e-6 for v in row.tolist())

    def _check_row(self, row: np.ndarray) -> None:
        """Validate one layer's scores; remember the array when it cannot change."""
        a = np.asarray(row, dtype=np.float64)
        if a.shape != (self.num_experts,) or not self._in_unit(a):
            raise ValueError(f"finemoe cache: scores must be {self.num_experts} probabilities "
                             f"per layer, got {a.shape}: {a}")
        self._checked.put(row, True)  # a read-only row cannot change: checked once

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        if prefetched and self.protect_prefetched:
            self._waiting_in[key[0]].add(key)
            self._num_waiting += 1
        else:
            self._shielded[key] = 0.0

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        freq = self.freq
        f = freq.item(key) + 1.0  # Python floats: the same IEEE sum and product, fewer
        freq[key] = f  # numpy scalars
        self._prio[key] = self.p.item(key) * f
        if self._num_waiting:
            waiting = self._waiting_in[key[0]]
            if waiting:  # the layer ran: its waiting experts are ordinary residents now
                shielded = self._shielded
                for k in waiting:
                    shielded[k] = 0.0
                self._num_waiting -= len(waiting)
                waiting.clear()

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._shielded[key] = np.inf
        waiting = self._waiting_in[key[0]]
        if key in waiting:
            waiting.discard(key)
            self._num_waiting -= 1
        if self.frequency == "in_cache":
            self.freq[key] = 0
            self._prio[key] = 0.0  # p · 0: p is a finite probability

    def priorities(self) -> np.ndarray:
        """float[L, J]: ``p · freq`` of every (layer, expert), the eviction order."""
        return self.p * self.freq

    def priority(self, key: Key) -> float:
        """``p · freq`` of a key (float)."""
        return float(self.priorities()[key])

    def waiting(self) -> set[Key]:
        """Prefetched, unused keys whose layer has not run since they arrived (a new set)."""
        return set().union(*self._waiting_in) if self._num_waiting else set()

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        """:meth:`choose` over every unprotected resident, on the (L, J) matrices at once."""
        if self.has_room(incoming):
            return None
        # the device protects a demand load's own key, never a prefetch's
        shield = self._num_waiting and (self.protect_from_demand or incoming not in protected)
        return self.lowest_priority(incoming, protected, self._prio,
                                    shielded=self._shielded if shield else None)

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        """The same rule on an explicit candidate list (the base class's path, which does
        not say whether ``incoming`` is a demand load: ``v2`` shields as for a prefetch)."""
        waiting = self.waiting()
        pool = [k for k in candidates if k not in waiting] or candidates
        prio = self.priorities()
        return min(pool, key=lambda k: (prio[k], k))


@CACHES.register("finemoe_v2")
class FineMoEV2Cache(FineMoECache):
    """FineMoE's cache as the authors' V2 code runs it: a waiting prefetched expert is
    shielded from other prefetches only, and visit counts are never reset."""

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 protect_prefetched: bool | Literal["v2"] = "v2",
                 frequency: Literal["in_cache", "lifetime"] = "lifetime") -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts, protect_prefetched=protect_prefetched,
                         frequency=frequency)
