"""The simulated device: expert slots, the prefetch queue, layer service, over one link.

Time is in seconds on one compute stream; the device's :class:`~moeexp.simulator.link.Link`
(its copy engine) moves one expert at a time (``cost.copy_s`` each, ``cost.copy_plan`` says
how it is cut) and overlaps compute. The cache policy decides every eviction; this class
only keeps the mechanism honest (the link keeps its own clock, pause, chunking state and
counters):

* ``ready[key]`` is the time ``key``'s copy finishes; a key is *resident* from the moment
  its copy starts (its slot is taken) and *ready* once the copy finished.
* Prefetches wait in the :class:`~moeexp.prefetching.PrefetchQueue` the engine uses too
  (its rules: higher priority first, FIFO among equals, one entry per key, requests for a
  layer that already ran dropped). They are started lazily: :meth:`advance` starts, in
  order, every queued prefetch whose start time (engine free, not paused, enqueued) falls
  before the next event; one the policy finds no victim for is dropped.
* A layer's missing experts are loaded on demand: after the copy in flight, before any
  queued prefetch. With chunked copies (``hardware.copy_chunk_mb > 0``,
  :mod:`moeexp.costmodel.copies`; every copy then costs one latency per chunk) a demand
  load waits only for the chunk in flight: the prefetch on the link (unless it is for the
  running layer) stops at that chunk boundary and its remaining chunks resume after the
  layer's demand loads, its ready time moving by as much. Experts compute one after another as soon as they are ready (resident
  hits first), so a layer's stall is the compute stream's idle time.
* When a layer needs more experts than fit (a prefill touching every expert), experts
  already computed in this layer are released for eviction and the rest stream through
  the budget; the resident count never exceeds ``cache.capacity_slots``.
* Counters for where the bytes and the stalls go (:mod:`moeexp.simulator.report`): every
  copy is a demand load or a started prefetch; a prefetched copy is *used* when a layer
  computes with it (a hit, or a wait for it in flight) before it leaves, else *wasted*.
  A layer's stall is split by what the compute stream waits for: a copy that was already
  in flight when the layer needed it (a late prefetch), a demand copy's own transfer, or,
  before that transfer starts, the other copies ahead of it on the link.
* ``protected`` (never evicted): for a demand load, the running layer's experts not yet
  computed, the loaded key included; for a prefetch, the running layer's experts. So a
  demand load's key is always protected and a prefetch's never is (policies such as
  Belady rely on that). If the policy raises ConfigError for a demand load, the load
  waits for the next expert of the layer to finish computing and asks again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from moeexp.cache.base import CachePolicy, Key
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.predictors.base import Prefetch
from moeexp.prefetching import PrefetchQueue
from moeexp.simulator.link import Link

_NEG_INF = float("-inf")


class Device:
    """Residency, the prefetch queue, layer service and counters of one device in a replay.

    Args:
        cache: the policy that decides this device's evictions (its ``capacity_slots`` is
            the device's slot budget).
        cost: compute and copy times.
        num_layers, num_experts: L and J of the model.
        link: the device's copy engine (default: a fresh :class:`Link` of ``cost``).
    """

    def __init__(self, cache: CachePolicy, cost: CostModel, num_layers: int, num_experts: int,
                 link: Link | None = None) -> None:
        self.cache = cache
        self.L, self.J = num_layers, num_experts
        self.link = Link(cost) if link is None else link
        self.expert_bytes = cost.expert_bytes
        self.capacity = cache.capacity_slots
        self.ready: dict[Key, float] = {}
        self.unused_prefetched: set[Key] = set()
        self.queue = PrefetchQueue(num_layers, num_experts)
        self.cur_layer = -1
        self.protected: set[Key] = set()
        self.next_access = 0
        # counters (moeexp.simulator.report turns them into the metrics); the bytes moved
        # are the link's (:attr:`h2d_bytes`)
        self.demand_loads = 0
        self.prefetches_issued = 0
        self.prefetches_used = 0  # prefetched copies a layer used before their eviction
        self.prefetches_wasted = 0  # prefetched copies evicted unused
        self.waste_bytes = 0
        self.peak_resident = 0
        #: restricted routing: when a list, each :meth:`serve_restricted` call appends the
        #: experts it found usable (sorted), in call order (L per forward pass): the
        #: residency the engine replays to score quality at this operating point
        self.usable_log: list[tuple[int, ...]] | None = None
        # stall seconds by cause: a demand copy's own transfer, a copy already in flight
        # when the layer needed it (a late prefetch), a demand copy queued behind others
        self.stall_demand_s = 0.0
        self.stall_inflight_s = 0.0
        self.stall_link_s = 0.0

    @property
    def members(self) -> list[Device]:
        """The devices of this replay (one: this; a :class:`~moeexp.simulator.device_group.
        DeviceGroup` has several)."""
        return [self]

    @property
    def h2d_bytes(self) -> int:
        """Bytes copied to this device (its link's: every copy is a demand load or a
        started prefetch of this device)."""
        return self.link.bytes

    # ------------------------------------------------------------------ residency
    def preload(self, keys: Iterable[Key]) -> None:
        """Load ``keys`` before serving starts (ready at once; not counted as traffic)."""
        for key in keys:
            if key in self.ready:
                continue
            if len(self.ready) >= self.capacity:
                raise ConfigError(
                    f"{self.cache.name}: initial residents exceed the capacity of {self.capacity} slots"
                )
            self.ready[key] = _NEG_INF
            self.cache.on_insert(key, 0, False)
        self.peak_resident = max(self.peak_resident, len(self.ready))

    def _evict(self, key: Key) -> None:
        if self.ready.pop(key, None) is None:
            raise RuntimeError(f"{self.cache.name}: victim {key} is not resident (policy bug)")
        if key in self.unused_prefetched:
            self.unused_prefetched.discard(key)
            self.waste_bytes += self.expert_bytes
            self.prefetches_wasted += 1
        self.cache.on_evict(key)

    def _insert(self, key: Key, ready_at: float, now: int, prefetched: bool) -> None:
        self.ready[key] = ready_at
        self.link.copies += 1
        self.cache.on_insert(key, now, prefetched)
        if prefetched:
            self.unused_prefetched.add(key)
        else:
            self.demand_loads += 1
        n = len(self.ready)
        if n > self.capacity:
            raise RuntimeError(
                f"{self.cache.name}: {n} experts resident, capacity {self.capacity} (policy bug)"
            )
        if n > self.peak_resident:
            self.peak_resident = n

    # ------------------------------------------------------------------ prefetch queue
    @property
    def prefetches_dropped(self) -> int:
        """Prefetch requests dropped (passed layer, no victim, left at a pass's end)."""
        return self.queue.dropped

    def enqueue(self, prefetches: list[Prefetch], t: float) -> None:
        """Queue prefetch requests made at time ``t`` (call :meth:`advance` to ``t`` first)."""
        self.queue.push(prefetches, self.cur_layer, self.ready, t)

    def advance(self, t: float) -> None:
        """Start every queued prefetch that the copy engine would start before ``t``.

        The hot path: :meth:`_evict` and :meth:`_insert` inlined, what the loop reads bound
        to locals (the cache's calls leave ``protected``, ``next_access`` and the pause as
        they are), but only once a first prefetch can start: most calls start none, and
        binding them all first made those calls slower (moe_infinity_oss, issue 11)."""
        queue = self.queue
        if not queue.pending:
            return
        link = self.link
        free, paused, cur = link.free, link.pause_until, self.cur_layer
        got = queue.pop(cur, free if free >= paused else paused, t)
        if got is None:
            return
        ready, cache, pop = self.ready, self.cache, queue.pop
        victim_of, on_insert, on_evict = cache.victim, cache.on_insert, cache.on_evict
        protected, now, copy_s = self.protected, self.next_access, link.copy_s
        unused, capacity, chunked = self.unused_prefetched, self.capacity, bool(link.chunk_s)
        host = link.host
        while True:
            if got is None:
                got = pop(cur, free if free >= paused else paused, t)
                if got is None:
                    return
            key, start = got
            got = None
            if key in ready:
                continue
            try:
                victim = victim_of(key, protected, now)
            except ConfigError:
                queue.drop()
                continue
            if victim is not None:
                if victim in unused:
                    self._evict(victim)
                elif ready.pop(victim, None) is None:
                    raise RuntimeError(f"{cache.name}: victim {victim} is not resident (policy bug)")
                else:
                    on_evict(victim)
            free = start + copy_s if host is None else link.finish(start)
            ready[key] = free
            link.copies += 1
            on_insert(key, now, True)
            unused.add(key)
            n = len(ready)
            if n > capacity:
                raise RuntimeError(f"{cache.name}: {n} experts resident, capacity {capacity} (policy bug)")
            if n > self.peak_resident:
                self.peak_resident = n
            link.free = free
            self.prefetches_issued += 1
            if chunked:
                link.onlink = (key, start, free)

    def begin_iteration(self) -> None:
        """A new forward pass: no layer has run, nothing is computing."""
        self.cur_layer = -1
        self.protected = set()

    def end_iteration(self) -> None:
        """Every prefetch still queued targets a layer that already ran: drop them."""
        self.queue.clear()

    def flush(self) -> None:
        """Every resident expert leaves the device (``Mechanics.flush_per_token``), in
        residency order; unused prefetched ones count as wasted."""
        for key in list(self.ready):
            self._evict(key)

    # ------------------------------------------------------------------ layer service
    def serve_layer(self, layer: int, keys: list[Key], key_set: set[Key], ce: list[float],
                    pos0: int, t: float) -> tuple[float, int, int, float]:
        """Run layer ``layer``'s experts starting at time ``t``.

        Args:
            keys: the layer's accesses ``(layer, expert)``, experts sorted
                (:meth:`GroupData.layer_keys`); key_set: the same as a set, protected while
                the layer runs (shared with later replays: never modified here).
            ce: seconds of each needed expert's FFN (same order).
            pos0: stream index of this layer's first access (the policy's ``now``).

        Returns:
            (time the layer's experts finished, hits, misses, stall seconds).
        """
        ready, on_access = self.ready, self.cache.on_access
        self.cur_layer = layer
        self.protected = key_set
        self.next_access = pos0 + len(keys)
        waits: list[int] = []
        absent: list[int] = []
        comp, stall, n_hits, used = t, 0.0, 0, 0
        finished: list[tuple[float, Key]] = []  # compute order == time order
        done = finished.append
        unused = self.unused_prefetched
        get = ready.get
        i = 0
        for k in keys:  # hits compute first, in expert order, as met
            r = get(k)
            if r is None:
                absent.append(i)
            elif r <= t:
                comp += ce[i]
                on_access(k, pos0 + i, True)
                if k in unused:
                    unused.remove(k)
                    used += 1
                done((comp, k))
                n_hits += 1
            else:
                waits.append(i)
            i += 1
        for i in waits:  # copies in flight since before the layer needed them: prefetches
            k = keys[i]
            r = ready[k]
            if r > comp:
                stall += r - comp
                self.stall_inflight_s += r - comp
                comp = r
            comp += ce[i]
            on_access(k, pos0 + i, False)
            if k in unused:
                unused.remove(k)
                used += 1
            done((comp, k))
        if used:
            self.prefetches_used += used
        if absent:
            comp, stall = self._demand(keys, absent, ce, pos0, t, comp, stall, finished)
        if (absent or waits) and self.cache.pause_prefetch_on_miss:
            self.link.pause_until = comp
        return comp, n_hits, len(waits) + len(absent), stall

    def _demand(self, keys: list[Key], absent: list[int], ce: list[float], pos0: int, t: float,
                comp: float, stall: float, finished: list[tuple[float, Key]]) -> tuple[float, float]:
        """Load ``absent`` experts on demand, ahead of queued prefetches; stream if needed."""
        cache, ready, link, capacity = self.cache, self.ready, self.link, self.capacity
        on_insert, on_access, copy_s = cache.on_insert, cache.on_access, link.copy_s
        copy_t = max(link.free, t)
        rest = 0.0  # chunked copies: link seconds left of the prefetch this load overtakes
        if link.chunk_s and copy_t > t:
            copy_t, rest = link.overtake(t, self.cur_layer)
        unreleased = set(self.protected)
        released = 0
        for i in absent:
            k = keys[i]
            while True:
                while released < len(finished) and finished[released][0] <= copy_t:
                    unreleased.discard(finished[released][1])
                    released += 1
                try:
                    victim = cache.victim(k, unreleased, pos0 + i)
                    break
                except ConfigError:
                    if released >= len(finished):
                        raise RuntimeError(
                            f"{cache.name}: cannot make room for {k}: capacity "
                            f"{self.capacity} slots, {len(unreleased)} experts of this layer pending"
                        ) from None
                    copy_t = max(copy_t, finished[released][0])  # wait for one to finish
            if victim is not None:
                self._evict(victim)
            done = copy_t + copy_s if link.host is None else link.finish(copy_t)
            ready[k] = done  # _insert inlined
            link.copies += 1
            on_insert(k, pos0 + i, False)
            self.demand_loads += 1
            n = len(ready)
            if n > capacity:
                raise RuntimeError(f"{cache.name}: {n} experts resident, capacity {capacity} (policy bug)")
            if n > self.peak_resident:
                self.peak_resident = n
            if done > comp:  # idle from comp: behind other copies until copy_t, then its own
                stall += done - comp
                if copy_t > comp:
                    self.stall_link_s += copy_t - comp
                    self.stall_demand_s += done - copy_t
                else:
                    self.stall_demand_s += done - comp
                comp = done
            copy_t = done
            comp += ce[i]
            on_access(k, pos0 + i, False)
            finished.append((comp, k))
        link.free = copy_t
        if rest:
            key, was, end = link.resume(copy_t, rest)
            if ready.get(key) == was:  # still resident with that copy (not evicted)
                ready[key] = end
        return comp, stall

    def serve_restricted(self, layer: int, needed: list[int], topk: np.ndarray, probs: np.ndarray,
                         pos0: int, t: float, expert_s: Callable[[int], float]) -> tuple[float, int, int, int, int]:
        """eMoE's restricted routing: tokens use only resident+ready experts; nothing loads.

        A token's chosen expert that is not ready is replaced by the next expert in the
        token's gate order (descending ``probs``) that is ready and not already used by it;
        with none left the assignment is dropped.

        Args:
            topk: int[T, K] the token's chosen experts; probs: float[T, J] gate scores.
            expert_s: seconds of one expert FFN over n tokens.

        Returns:
            (finish time, hits, misses, substituted assignments, dropped assignments), where
            hits/misses count the router's original experts of the layer (ready or not).
        """
        ready, J = self.ready, self.J
        self.cur_layer = layer
        self.protected = {(layer, e) for e in needed}
        self.next_access = pos0 + len(needed)
        usable: set[int] = set()
        for e in range(J):
            r = ready.get((layer, e))
            if r is not None and r <= t:
                usable.add(e)
        if self.usable_log is not None:
            self.usable_log.append(tuple(sorted(usable)))
        hits = 0
        for e in needed:
            if e in usable:
                hits += 1
        counts = [0] * J
        subs = drops = 0
        rows = topk.tolist()
        # a token's gate order, descending, ties by expert index (a stable argsort of
        # -probs): for a few tokens Python's stable sort of the row, else numpy's at once
        order: list[list[int]] | None = None
        scores: list[list[float]] | None = None
        few = len(rows) <= 4
        experts = range(J)
        for row, chosen in enumerate(rows):
            used = [e for e in chosen if e in usable]
            if len(used) < len(chosen):
                if few:
                    if scores is None:
                        scores = probs.tolist()
                    alts = sorted(experts, key=scores[row].__getitem__, reverse=True)
                else:
                    if order is None:
                        order = np.argsort(-probs, axis=1, kind="stable").tolist()
                    alts = order[row]
                for e in chosen:
                    if e in usable:
                        continue
                    for alt in alts:
                        if alt in usable and alt not in used and alt not in chosen:
                            used.append(alt)
                            subs += 1
                            break
                    else:
                        drops += 1
            for e in used:
                counts[e] += 1
        comp = t
        on_access, unused = self.cache.on_access, self.unused_prefetched
        protected = self.protected  # the substitutes compute too: no prefetch evicts them
        for e in experts:  # in expert order; ``needed`` holds an expert once
            n = counts[e]
            if not n:
                continue
            comp += expert_s(n)
            k = (layer, e)
            protected.add(k)
            on_access(k, pos0 + (needed.index(e) if e in needed else 0), True)
            if k in unused:
                unused.remove(k)
                self.prefetches_used += 1
        return comp, hits, len(needed) - hits, subs, drops
