"""N simulated devices serving one model: the :class:`~moeexp.simulator.device.Device`
interface the replay calls, over one Device (slots, queue, link, policy) per GPU.

The rules are :mod:`moeexp.simulator.topology`'s. What each member does is its own
Device's mechanism (prefetches start lazily in priority order on its link, victims come
from its policy, counters accumulate on it); this class routes every key to its device and
serves a layer whose experts are spread over several devices:

* hits compute first, in expert order, then copies in flight, then demand loads, on one
  compute stream (as one Device does);
* a demand load goes over its device's link, after the copy in flight there (or at its
  next chunk boundary with chunked copies), before that device's queued prefetches; with
  ``demand_concurrency=single`` it also waits for the previous demand copy of the layer to
  finish (one blocking demand thread); a wait behind other copies, on its link or for the
  demand thread, counts as ``stall_link``;
* a miss pauses prefetching on every link when the policy asks for it
  (``pause_prefetch_on_miss`` is the system's, not one device's).

Restricted routing (eMoE) runs on one device only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from moeexp.cache.base import CachePolicy, Key
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.predictors.base import Prefetch
from moeexp.simulator.device import Device
from moeexp.simulator.link import Link
from moeexp.simulator.topology import Topology, check_caches


class DeviceGroup:
    """Several devices behind the one-device interface of the replay loop.

    Args:
        caches: one policy per device (its ``capacity_slots`` = that device's budget).
        cost: compute and copy times (every link alike).
        num_layers, num_experts: L and J.
        topology: devices, placement and demand concurrency.
    """

    def __init__(self, caches: Sequence[CachePolicy], cost: CostModel, num_layers: int,
                 num_experts: int, topology: Topology) -> None:
        check_caches(caches, topology)
        self.topology = topology
        self.where: list[list[int]] = topology.device_map(num_layers, num_experts).tolist()
        self.members = [Device(c, cost, num_layers, num_experts) for c in caches]
        self.single_demand = topology.demand_concurrency == "single"
        self.pause_on_miss = any(c.pause_prefetch_on_miss for c in caches)
        self.usable_log: list[tuple[int, ...]] | None = None

    # ------------------------------------------------------------------ what report reads
    @property
    def links(self) -> list[Link]:
        return [d.link for d in self.members]

    def _sum(self, attr: str) -> int | float:
        return sum(getattr(d, attr) for d in self.members)

    h2d_bytes = property(lambda self: self._sum("h2d_bytes"))
    waste_bytes = property(lambda self: self._sum("waste_bytes"))
    demand_loads = property(lambda self: self._sum("demand_loads"))
    prefetches_issued = property(lambda self: self._sum("prefetches_issued"))
    prefetches_used = property(lambda self: self._sum("prefetches_used"))
    prefetches_wasted = property(lambda self: self._sum("prefetches_wasted"))
    prefetches_dropped = property(lambda self: self._sum("prefetches_dropped"))
    stall_demand_s = property(lambda self: self._sum("stall_demand_s"))
    stall_inflight_s = property(lambda self: self._sum("stall_inflight_s"))
    stall_link_s = property(lambda self: self._sum("stall_link_s"))

    @property
    def unused_prefetched(self) -> set[Key]:
        """Prefetched copies not used yet, over every device."""
        return set().union(*(d.unused_prefetched for d in self.members))

    @property
    def ready(self) -> dict[Key, float]:
        """Every device's residents and their ready times (a fresh dict)."""
        out: dict[Key, float] = {}
        for d in self.members:
            out.update(d.ready)
        return out

    # ------------------------------------------------------------------ the replay's calls
    def preload(self, keys: Iterable[Key]) -> None:
        """Each key onto its own device (ready at once, not counted as traffic)."""
        per: list[list[Key]] = [[] for _ in self.members]
        for k in keys:
            per[self.where[k[0]][k[1]]].append(k)
        for d, ks in zip(self.members, per, strict=True):
            d.preload(ks)

    def enqueue(self, prefetches: list[Prefetch], t: float) -> None:
        """Each request to its expert's device's queue (relative order kept)."""
        per: list[list[Prefetch]] = [[] for _ in self.members]
        where = self.where
        for p in prefetches:
            per[where[p.layer][p.expert]].append(p)
        for d, ps in zip(self.members, per, strict=True):
            if ps:
                d.enqueue(ps, t)

    def advance(self, t: float) -> None:
        """Every link starts the queued prefetches it would start before ``t``."""
        for d in self.members:
            d.advance(t)

    def begin_iteration(self) -> None:
        for d in self.members:
            d.begin_iteration()

    def end_iteration(self) -> None:
        for d in self.members:
            d.end_iteration()

    def flush(self) -> None:
        for d in self.members:
            d.flush()

    def serve_restricted(self, *args: object, **kwargs: object) -> tuple[float, int, int, int, int]:
        raise ConfigError("restricted routing (eMoE) is modelled on one device only; "
                          "set hardware.devices=1")

    def serve_layer(self, layer: int, keys: list[Key], key_set: set[Key], ce: list[float],
                    pos0: int, t: float) -> tuple[float, int, int, float]:
        """Run layer ``layer``'s experts from time ``t`` (arguments and result as
        :meth:`Device.serve_layer`), each key on its own device."""
        members, where = self.members, self.where[layer]
        nxt = pos0 + len(keys)
        for d in members:
            d.cur_layer, d.protected, d.next_access = layer, key_set, nxt
        waits: list[int] = []
        absent: list[int] = []
        comp, stall, n_hits = t, 0.0, 0
        finished: list[tuple[float, Key]] = []
        for i, k in enumerate(keys):  # hits compute first, in expert order, as met
            d = members[where[k[1]]]
            r = d.ready.get(k)
            if r is None:
                absent.append(i)
            elif r <= t:
                comp += ce[i]
                d.cache.on_access(k, pos0 + i, True)
                self._used(d, k)
                finished.append((comp, k))
                n_hits += 1
            else:
                waits.append(i)
        for i in waits:  # copies in flight since before the layer needed them
            k = keys[i]
            d = members[where[k[1]]]
            r = d.ready[k]
            if r > comp:
                stall += r - comp
                d.stall_inflight_s += r - comp
                comp = r
            comp += ce[i]
            d.cache.on_access(k, pos0 + i, False)
            self._used(d, k)
            finished.append((comp, k))
        if absent:
            comp, stall = self._demand(layer, keys, key_set, absent, ce, pos0, t, comp, stall,
                                       finished)
        if (absent or waits) and self.pause_on_miss:
            for d in members:
                d.link.pause_until = comp
        return comp, n_hits, len(waits) + len(absent), stall

    @staticmethod
    def _used(d: Device, k: Key) -> None:
        if k in d.unused_prefetched:
            d.unused_prefetched.remove(k)
            d.prefetches_used += 1

    def _demand(self, layer: int, keys: list[Key], key_set: set[Key], absent: list[int],
                ce: list[float], pos0: int, t: float, comp: float, stall: float,
                finished: list[tuple[float, Key]]) -> tuple[float, float]:
        """Load ``absent`` experts on demand over their devices' links; stream if needed."""
        members, where = self.members, self.where[layer]
        link_t: dict[int, float] = {}  # device -> when its link takes the next demand copy
        rests: dict[int, float] = {}  # device -> link seconds left of an overtaken prefetch
        demand_free = t  # single demand thread: when it may issue the next copy
        unreleased = set(key_set)
        released = 0
        for i in absent:
            k = keys[i]
            di = where[k[1]]
            d, link = members[di], members[di].link
            if di not in link_t:
                start = max(link.free, t)
                rests[di] = 0.0
                if link.chunk_s and start > t:
                    start, rests[di] = link.overtake(t, layer)
                link_t[di] = start
            copy_t = max(link_t[di], demand_free) if self.single_demand else link_t[di]
            victim, copy_t, released = self._victim(d, k, unreleased, pos0 + i, copy_t,
                                                    finished, released)
            if victim is not None:
                d._evict(victim)
            done = copy_t + link.copy_s if link.host is None else link.finish(copy_t)
            d.ready[k] = done
            link.copies += 1
            d.cache.on_insert(k, pos0 + i, False)
            d.demand_loads += 1
            n = len(d.ready)
            if n > d.capacity:
                raise RuntimeError(f"{d.cache.name}: {n} experts resident, capacity {d.capacity} (policy bug)")
            d.peak_resident = max(d.peak_resident, n)
            if done > comp:  # idle from comp: behind other copies until copy_t, then its own
                stall += done - comp
                if copy_t > comp:
                    d.stall_link_s += copy_t - comp
                    d.stall_demand_s += done - copy_t
                else:
                    d.stall_demand_s += done - comp
                comp = done
            link_t[di] = demand_free = done
            comp += ce[i]
            d.cache.on_access(k, pos0 + i, False)
            finished.append((comp, k))
        for di, at in link_t.items():
            d = members[di]
            d.link.free = at
            if rests[di]:
                key, was, end = d.link.resume(at, rests[di])
                if d.ready.get(key) == was:  # still resident with that copy (not evicted)
                    d.ready[key] = end
        return comp, stall

    @staticmethod
    def _victim(d: Device, k: Key, unreleased: set[Key], now: int, copy_t: float,
                finished: list[tuple[float, Key]], released: int) -> tuple[Key | None, float, int]:
        """``d``'s policy's victim for demand load ``k`` issued at ``copy_t``: experts of
        the layer computed by then are released; if none can go, the load waits for the
        next one to finish. Returns (victim, when the copy starts, released count)."""
        while True:
            while released < len(finished) and finished[released][0] <= copy_t:
                unreleased.discard(finished[released][1])
                released += 1
            try:
                return d.cache.victim(k, unreleased, now), copy_t, released
            except ConfigError:
                if released >= len(finished):
                    raise RuntimeError(
                        f"{d.cache.name}: cannot make room for {k}: capacity {d.capacity} "
                        f"slots, {len(unreleased)} experts of this layer pending") from None
                copy_t = max(copy_t, finished[released][0])  # wait for one to finish
