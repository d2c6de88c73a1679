"""The cache-policy interface: which expert to evict. Pure decisions, no bytes, no torch.

The mechanism (simulator or engine) owns the device slots and asks the policy::

    victim(incoming, protected, now) -> key | None   # None: there is room, nothing to evict
    on_insert(key, now, prefetched)                  # key became resident (copy issued)
    on_access(key, now, hit)                         # a layer used key (hit or after a load)
    on_evict(key)                                    # key left the device
    observe_scores(scores)                           # predictor hints, layer -> float[J]
    pause_prefetch_on_miss                           # FineMoE: a miss pauses prefetching

Keys are ``(layer, expert)`` tuples. ``now`` is a logical clock: the index of the current
access in the replay's access stream (Belady uses it to find next uses). ``protected``
holds keys that must not be evicted now (experts the running layer uses, copies in
flight). Capacity is in expert slots; the mechanism converts bytes to slots.

Victim choice, from the slowest to the fastest way to write a policy:

- override :meth:`CachePolicy.choose`: the generic :meth:`CachePolicy.victim` sorts every
  resident key into a candidate list on each eviction, O(n log n) for n residents (fine for
  a few dozen slots; a policy with hundreds of resident experts replayed over millions of
  accesses ran 5.5x slower than ``lru`` this way);
- subclass :class:`RankedPolicy` and define :meth:`RankedPolicy.rank`: when a key's rank
  changes only at that key's own events (its insert and its accesses), the victim comes from
  a lazy heap, O(log n) per key touched between two evictions (``lru2``, ``lfu``,
  ``static``);
- rank by a matrix that changes for many keys at once (predictor scores): keep a float[L, J]
  priority and call :meth:`CachePolicy.lowest_priority` (``finemoe``, ``moe_infinity``);
- keep an ordered structure yourself and override ``victim`` (``lru``: O(1)).
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heapify, heappop, heappush
from typing import Any, ClassVar

import numpy as np

from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.traces.schema import Trace

Key = tuple[int, int]


class CachePolicy:
    """Base class tracking the resident set; subclasses choose victims.

    Args:
        capacity_slots: experts that fit on the device (all layers together).
        num_layers: L.
        num_experts: J.
    """

    name: ClassVar[str] = "base"
    pause_prefetch_on_miss: ClassVar[bool] = False
    needs_future: ClassVar[bool] = False

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        if capacity_slots < 1:
            raise ConfigError(f"cache capacity must hold at least one expert, got {capacity_slots}")
        self.capacity_slots = capacity_slots
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.resident: set[Key] = set()
        # 0 where resident, +inf elsewhere: lowest_priority's mask in one addition
        self._absent = np.full((num_layers, num_experts), np.inf)
        self._work = np.empty((num_layers, num_experts))  # lowest_priority's scratch

    @property
    def resident_mask(self) -> np.ndarray:
        """bool[L, J]: True where the key is resident (a fresh array)."""
        return self._absent == 0.0

    # ---- learning -------------------------------------------------------------------
    def fit(self, store: Trace) -> None:
        """Learn from the store split (``static`` pins its most used experts)."""

    def prepare_future(self, accesses: list[Key]) -> None:
        """The whole future access stream (Belady only; ``needs_future``)."""

    def set_mechanics(self, *, demand_load: str) -> None:
        """The demand loading the run is served with (``activated`` or ``all_experts``,
        :mod:`moeexp.simulator.mechanics`), before the first request; the simulator and
        the engine call it. Default: nothing (``next_use`` reads it)."""

    def set_miss_cost(self, seconds: float, *, late_to_cpu: bool = False,
                      relief_s: float = 0.0) -> None:
        """What one decode miss costs the run when no prefetch hides it (seconds), where
        missed experts may run on the CPU (:meth:`moeexp.execution.base.ExecutionPolicy.miss_s`);
        ``late_to_cpu``: a copy still in flight when its layer runs may be computed on the
        CPU instead of waited for (the execution's key); ``relief_s``: the GPU seconds such
        a miss takes off the GPU's chain (:meth:`~moeexp.execution.base.ExecutionPolicy.
        miss_relief_s`). The simulator and the engine call it for such a run, after
        :meth:`set_mechanics`. Default: nothing (``next_use``'s gates read it)."""

    def initial_residents(self) -> list[Key]:
        """Experts to load before the first request (``static``). Default: none."""
        return []

    # ---- events ---------------------------------------------------------------------
    def has_room(self, incoming: Key) -> bool:
        return len(self.resident) < self.capacity_slots

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        """The key to evict so ``incoming`` fits, or None if there is room already.

        Raises ConfigError if every resident key is protected (capacity too small).
        """
        if self.has_room(incoming):
            return None
        candidates = [k for k in self.candidates(incoming) if k not in protected]
        if not candidates:
            raise ConfigError(
                f"{self.name}: no evictable expert for {incoming} (capacity "
                f"{self.capacity_slots} slots, {len(protected)} protected)"
            )
        return self.choose(candidates, incoming, now)

    def candidates(self, incoming: Key) -> list[Key]:
        """Resident keys that may make room for ``incoming`` (per-layer policies narrow it)."""
        return sorted(self.resident)

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        """Pick the victim among ``candidates`` (non-empty). Subclasses override."""
        raise NotImplementedError

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        self.resident.add(key)
        self._absent[key] = 0.0

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        """A layer used ``key`` (resident by now)."""

    def on_evict(self, key: Key) -> None:
        self.resident.discard(key)
        self._absent[key] = np.inf

    def lowest_priority(self, incoming: Key, protected: set[Key], prio: np.ndarray,
                        shielded: np.ndarray | None = None) -> Key:
        """The unprotected resident key of lowest ``prio`` (float[L, J], no NaN or -inf);
        ties go to the lowest (layer, expert), as ``choose`` over the sorted candidates
        does. With ``shielded`` (float[L, J]: +inf outside the resident set and at keys
        the policy shields, 0 elsewhere; ``prio`` then finite), shielded residents are
        taken only when nothing else is left. For policies that rank by a matrix
        (finemoe, moe_infinity): the simulator's hottest decision, done with one addition
        and one argmin (protected keys are masked one by one: they are few)."""
        resident, inf = self.resident, np.inf
        blocked = resident.intersection(protected)
        if len(resident) <= len(blocked):
            raise ConfigError(
                f"{self.name}: no evictable expert for {incoming} (capacity "
                f"{self.capacity_slots} slots, {len(protected)} protected)")
        if shielded is not None:  # a finite minimum is a resident that is not shielded
            work = np.add(prio, shielded, out=self._work)
            for k in blocked:
                work[k] = inf
            flat = int(work.argmin())
            if work.flat[flat] != inf:
                return divmod(flat, self.num_experts)
        work = np.add(prio, self._absent, out=self._work)  # +inf outside the resident set
        for k in blocked:
            work[k] = inf
        return divmod(int(work.argmin()), self.num_experts)  # (layer, expert)

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        """Per-layer expert probabilities from the predictor (FineMoE, MoE-Infinity)."""


class RecencyPolicy(CachePolicy):
    """A policy that ranks by recency, alone or to break ties (``lfu``, ``lru_per_layer``,
    ``static``, ``emoe``): it keeps each resident key's last use, the logical clock ``now``
    of its last insert or access. (``lru`` keeps an ordered list instead: O(1) victims.)
    :class:`RankedRecencyPolicy` puts one on :class:`RankedPolicy`'s heap."""

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        self._last: dict[Key, int] = {}

    def last_use(self, key: Key) -> int:
        """``now`` of ``key``'s last insert or access (-1 when never seen)."""
        return self._last.get(key, -1)

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._last[key] = now

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self._last[key] = now

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._last.pop(key, None)


class RankedPolicy(CachePolicy):
    """The fast generic path: evict the unprotected resident key of lowest ``rank(key)``,
    ties to the lowest ``(layer, expert)``, as :meth:`CachePolicy.choose` over the sorted
    candidates would, without sorting the residents on each eviction.

    Contract: a key's rank may change only at that key's own events. A subclass updates its
    state in ``on_insert`` / ``on_access`` / ``on_evict`` and then calls ``super()``, which
    marks the key for re-ranking; the next :meth:`victim` pushes ``(rank(key), key)`` of each
    marked key onto a heap (an older entry of the key becomes stale and is skipped when it
    reaches the top). A rank that moves with the clock or with another key's events
    (predictor scores, ``now`` - last use) breaks the contract: use
    :meth:`CachePolicy.lowest_priority` or :meth:`CachePolicy.choose` for those.
    Costs: O(log n) per key touched between two evictions, O(log n) amortised per victim,
    plus the protected keys met at the heap's top (they are few: the running layer's
    experts, copies in flight).
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        self._heap: list[tuple[Any, Key, int]] = []  # (rank, key, stamp); stale ones included
        self._stamp: dict[Key, int] = {}  # ranked resident key -> its current entry's stamp
        self._touched: set[Key] = set()  # resident keys whose rank may have changed
        self._pushes = 0

    def rank(self, key: Key) -> Any:
        """The eviction order of resident ``key``: lowest first (any value comparable with
        every other key's rank, e.g. a tuple of ints), or None for a key that is never a
        victim (``static``'s pinned experts; :meth:`CachePolicy.candidates` must then leave
        it out too). Subclasses define it."""
        raise NotImplementedError

    def rerank(self, keys: Iterable[Key]) -> None:
        """Re-rank the resident ``keys`` at the next :meth:`victim`: for a rank changed
        outside the keys' own events (``static``'s pinned set, fitted anew)."""
        self._touched.update(k for k in keys if k in self.resident)

    def _rerank_touched(self) -> None:
        heap, stamp, rank, n = self._heap, self._stamp, self.rank, self._pushes
        for key in self._touched:
            r = rank(key)
            if r is None:  # never a victim: no entry (an older one becomes stale)
                stamp.pop(key, None)
                continue
            n += 1
            stamp[key] = n
            heappush(heap, (r, key, n))
        self._pushes = n
        self._touched.clear()
        if len(heap) > 2 * len(stamp) + 64:  # drop stale entries: O(n), rarely
            self._heap = [e for e in heap if stamp.get(e[1]) == e[2]]
            heapify(self._heap)

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        if self.has_room(incoming):
            return None
        if self._touched:
            self._rerank_touched()
        heap, stamp, held = self._heap, self._stamp, []
        try:
            while heap:
                _, key, mark = heap[0]
                if stamp.get(key) != mark:
                    heappop(heap)  # stale: re-ranked or evicted since
                elif key in protected:
                    held.append(heappop(heap))
                else:
                    return key
        finally:
            for entry in held:
                heappush(heap, entry)
        raise ConfigError(
            f"{self.name}: no evictable expert for {incoming} (capacity "
            f"{self.capacity_slots} slots, {len(protected)} protected)")

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        """The slow path's answer (what :meth:`victim` must equal; tests compare them)."""
        return min(candidates, key=lambda k: (self.rank(k), k))

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._touched.add(key)

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        if key in self.resident:
            self._touched.add(key)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._stamp.pop(key, None)
        self._touched.discard(key)


class RankedRecencyPolicy(RecencyPolicy, RankedPolicy):
    """:class:`RecencyPolicy`'s last use on :class:`RankedPolicy`'s heap, for a rank that
    reads the last use and the key's own counts (``lfu``, ``static``); a subclass defines
    ``rank``. ``on_access`` records the last use and marks the key in one call (plain
    :class:`RecencyPolicy` ends its ``on_access`` there, so ``lru_per_layer`` and ``emoe``
    pay nothing for the heap); ``on_insert`` / ``on_evict`` run both bases' through
    ``super()``."""

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self._last[key] = now
        if key in self.resident:
            self._touched.add(key)


CACHES: Registry[CachePolicy] = Registry("cache")
