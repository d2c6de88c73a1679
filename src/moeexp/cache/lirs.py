"""``lirs``: LIRS (Jiang & Zhang, SIGMETRICS 2002) over all layers' experts, written from
the paper's description, with the mechanism's protection rule.

Why it is here: in the eviction landscape (experiments/eviction_landscape) LIRS and
W-TinyLFU were the online policies above LRU at nearly every budget on demand, on the
embedded model's, a synthetic and the real gpt-oss-20b trace, and above FineMoE's p·freq
nearly everywhere; LIRS is the simpler (no frequency sketch) and deterministic one. An MoE
decode pass touches every layer in turn, a loop over more experts than a small cache holds,
on which LRU evicts exactly the experts the next pass needs; LIRS keeps the experts whose
reuse distance is short resident instead.

The algorithm. Each expert is LIR (low inter-reference recency, always resident) or HIR.
The cache has ``capacity - h`` LIR slots and ``h`` slots for resident HIR experts, with
``h = max(min_hir_slots, round(hir_ratio * capacity))`` (the paper: 1 % of a buffer cache).
Experts need ``min_hir_slots >= 2``: a layer loads its misses one after another and the
mechanism protects each until it has computed, so with one HIR slot the second miss of a
layer finds the only resident HIR expert protected and must evict an LIR one (measured:
no hit at all at 5 % of the experts on the synthetic and gpt-oss traces). The default 2
was chosen on the landscape's streams among 1, 2, 4 and hir_ratio 0.01, 0.05, 0.1. Two
lists:

* the stack S, in recency order: every LIR expert, and the HIR experts (resident or not)
  used more recently than the least recent LIR one (``prune`` keeps an LIR at the bottom);
  non-resident entries are capped at ``ghost_ratio * capacity`` (oldest dropped first);
* the queue Q of resident HIR experts, the eviction order (front = next victim).

A reference to X: if X is LIR, it moves to the top of S. If X is HIR and in S (its reuse
distance beat the oldest LIR's), X becomes LIR and the bottom LIR of S turns HIR, to the
end of Q. Otherwise X is HIR at the top of S and the end of Q. Until the LIR slots are
full, a new expert becomes LIR directly (the warm-up).

Mechanism rules: the victim is the first expert of Q that is not ``protected`` (the running
layer's experts, copies in flight); if every resident HIR expert is protected, the least
recent unprotected LIR expert goes instead (a budget that holds few more experts than one
layer, or a prefill streaming through it). A load's ``on_insert`` counts as its reference
(a demand load's following ``on_access`` is the same use); a prefetched expert is placed as
if referenced when it arrives.
"""

from __future__ import annotations

from collections import OrderedDict

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError


@CACHES.register("lirs")
class LIRSCache(CachePolicy):
    """LIRS with the running layer protected.

    Args:
        capacity_slots: total slots (all layers share one pool).
        num_layers: L.
        num_experts: J.
        hir_ratio: share of the slots for resident HIR experts.
        min_hir_slots: at least this many slots for resident HIR experts.
        ghost_ratio: non-resident HIR entries kept in the stack, per slot.
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 hir_ratio: float = 0.01, min_hir_slots: int = 2,
                 ghost_ratio: float = 2.0) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if not 0.0 < hir_ratio < 1.0:
            raise ConfigError(f"lirs: hir_ratio={hir_ratio} must lie in (0, 1)")
        if ghost_ratio < 0:
            raise ConfigError(f"lirs: ghost_ratio={ghost_ratio} must be >= 0")
        if min_hir_slots < 1:
            raise ConfigError(f"lirs: min_hir_slots={min_hir_slots} must be >= 1")
        self.hir_slots = min(capacity_slots,
                             max(min_hir_slots, round(hir_ratio * capacity_slots)))
        self.lir_limit = capacity_slots - self.hir_slots
        self.max_ghosts = int(ghost_ratio * capacity_slots)
        self._stack: OrderedDict[Key, None] = OrderedDict()  # S: bottom (oldest) first
        self._queue: OrderedDict[Key, None] = OrderedDict()  # Q: next victim first
        self._ghosts: OrderedDict[Key, None] = OrderedDict()  # non-resident HIR in S
        self.lir: set[Key] = set()
        self._fresh: set[Key] = set()  # inserted; their on_insert was the reference

    # ---- decisions ------------------------------------------------------------------
    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        if self.has_room(incoming):
            return None
        for key in self._queue:
            if key not in protected:
                return key
        for key in self._stack:  # every resident HIR is protected: the oldest LIR
            if key in self.lir and key not in protected:
                return key
        raise ConfigError(f"{self.name}: no evictable expert for {incoming} (capacity "
                          f"{self.capacity_slots} slots, {len(protected)} protected)")

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        allowed = set(candidates)
        for key in [*self._queue, *(k for k in self._stack if k in self.lir)]:
            if key in allowed:
                return key
        return candidates[0]

    # ---- events ---------------------------------------------------------------------
    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._fresh.add(key)
        if len(self.lir) < self.lir_limit and key not in self._stack:
            self._to_top(key)
            self.lir.add(key)
        elif key in self._ghosts:  # a reuse within the LIR set's recency: promote
            del self._ghosts[key]
            self._promote(key)
        else:
            self._to_top(key)
            self._queue[key] = None
        self._trim_ghosts()

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        if key in self._fresh:
            self._fresh.discard(key)
            return
        if key in self.lir:
            self._to_top(key)
            self._prune()
        elif key in self._stack:
            del self._queue[key]
            self._promote(key)
        else:
            self._to_top(key)
            self._queue.move_to_end(key)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._fresh.discard(key)
        if key in self.lir:  # the fallback victim: it leaves the stack too
            self.lir.discard(key)
            self._stack.pop(key, None)
            self._prune()
            return
        self._queue.pop(key, None)
        if key in self._stack:
            self._ghosts[key] = None
            self._trim_ghosts()

    # ---- the stack ------------------------------------------------------------------
    def _to_top(self, key: Key) -> None:
        self._stack[key] = None
        self._stack.move_to_end(key)

    def _promote(self, key: Key) -> None:
        """HIR ``key`` (resident now, out of Q) becomes LIR at the top of S; when the LIR
        slots are full the bottom LIR of S turns HIR, to the end of Q."""
        self._to_top(key)
        self.lir.add(key)
        if len(self.lir) > self.lir_limit:
            bottom = next(iter(self._stack))
            self.lir.discard(bottom)
            del self._stack[bottom]
            self._queue[bottom] = None
        self._prune()

    def _prune(self) -> None:
        """Drop HIR entries from the bottom of S until an LIR expert is there."""
        while self._stack:
            bottom = next(iter(self._stack))
            if bottom in self.lir:
                return
            del self._stack[bottom]
            self._ghosts.pop(bottom, None)

    def _trim_ghosts(self) -> None:
        while len(self._ghosts) > self.max_ghosts:
            old, _ = self._ghosts.popitem(last=False)
            self._stack.pop(old, None)
