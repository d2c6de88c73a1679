"""``belady``: evict the resident expert whose next use lies furthest in the future.

Belady's MIN is the optimal demand-paging policy; with the ``oracle`` predictor it gives
the hit-rate ceiling for a capacity. It needs the whole future access stream of
``(layer, expert)`` keys in replay order (``prepare_future``), and the mechanism's ``now``
is the index of the access being served (or, for a prefetch, of the next access to come).

Prefetching needs a rule, or an eager prefetcher makes Belady *worse* than demand
paging: a prefetch issued early evicts the key that is furthest *now*, not the one MIN
would evict when the prefetched key is needed, and on a saturated link the prefetched key
still arrives late. ``prefetch_rule`` (Cao, Felten, Karlin & Li, SIGMETRICS'95):

* ``conservative`` (default): ``prepare_future`` replays MIN on the access stream and
  records, for each miss at position p, MIN's victim V and V's last use before p (or that
  the miss found a free slot). A prefetch of that key may only evict V, and only once V's
  last use has passed (or take a free slot if MIN's miss did); anything else is refused
  (:class:`PrefetchRefused`, a ConfigError the mechanism turns into a dropped prefetch).
  The cache then makes exactly MIN's replacements, only earlier, so its residency at
  every access is MIN's and every MIN hit stays a hit: oracle >= MIN. (The real state can
  still leave MIN's where the mechanism protects MIN's victim, e.g. while streaming a
  prefill; demand loads then take the fallback below.)
* ``do_no_harm``: evict the furthest-next-use key only if it is needed after the
  prefetched key.
* ``any``: always evict the furthest-next-use key.
* ``aggressive`` (the Aggressive rule of Cao et al.: fetch the next missing expert as soon
  as the link is free, provided some resident one is next used later than it; with the
  ``oracle`` predictor, which asks for every upcoming access of the pass in access order,
  that is the ``oracle_aggressive`` system): prefetches as ``do_no_harm``; demand loads
  evict the resident key used furthest in the future, never MIN's planned victim. (MIN's
  plan assumes the accesses in stream order; the mechanism computes a layer's hits first,
  so the planned victim is often an expert of the running layer still to compute, and a
  demand load that waits for it serialises copies and compute: on the embedded model's
  prefill that made ``do_no_harm`` slower than on-demand LRU.) Measured on the embedded
  model's trace at 25 % of the experts: hit rate 0.980 against ``oracle``'s 0.810, TTFT
  1.51 ms (floor 1.50) against 2.20, TPOT on its floor. The gap: at tight budgets with
  batching (random traces, 25 %, batch 2) ``conservative``'s hit rate is up to ~0.1
  higher, while its latency is no better (within 1 %). Cao et al. bound Aggressive's
  elapsed time, not its fetch count: it evicts the furthest-used expert at the moment a
  copy can start, with the running layer's experts protected and a refused prefetch
  retried only at the next layer, so it makes more copies than MIN's minimum, and on an
  idle link those cost hits while costing no time.

Demand loads (recognised by their key being in ``protected``: the mechanism protects the
running layer's experts) evict MIN's victim when it is resident and evictable, else the
resident key used furthest in the future (``aggressive``: always the furthest); they are
never refused.

Implementation: the next use of every resident key is kept up to date on insert/access and
indexed by a lazy max-heap (the victim) and a lazy min-heap (to refresh a key whose next
use passed without an access, e.g. under restricted routing), so a victim costs
O(log C) instead of a scan of the C resident keys. The heaps are built from the next uses
at the first victim search that needs them (:meth:`_furthest`) and kept from then on:
the ``conservative`` rule's prefetches follow MIN's plan and the ``oracle``'s demand loads
find MIN's victim, so an ``oracle`` replay never searches and pays one dict store per
access instead of two heap pushes (issue 11).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError

_NEVER = float("inf")


class PrefetchRefused(ConfigError):
    """Evicting any candidate would hurt more than the prefetch helps.

    Raised as ``PrefetchRefused(format, *values)``: the message (``format % values``) is
    built only when read. The mechanism drops a refused prefetch without reading it, and
    an ``oracle`` replay refuses ~160k of them (issue 11: formatting each was ~2 % of it).
    """

    def __str__(self) -> str:
        if len(self.args) < 2:  # raised with a plain message (or none)
            return super().__str__()
        fmt, *values = self.args
        return str(fmt) % tuple(values)


@CACHES.register("belady")
class BeladyCache(CachePolicy):
    """Belady's MIN with the do-no-harm rule for prefetches.

    Args:
        prefetch_rule: ``conservative`` | ``do_no_harm`` | ``any`` | ``aggressive`` (see the
            module docstring).
    """

    needs_future = True
    RULES = ("conservative", "do_no_harm", "any", "aggressive")

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 prefetch_rule: str = "conservative") -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers, num_experts=num_experts)
        if prefetch_rule not in self.RULES:
            raise ConfigError(f"belady: prefetch_rule {prefetch_rule!r} is not one of {', '.join(self.RULES)}")
        self.prefetch_rule = prefetch_rule
        self._positions: dict[Key, list[int]] | None = None
        self._stream: list[Key] = []  # the access stream (prepare_future)
        self._after: list[float] = []  # position -> the next use of its key after it (or inf)
        self._schedule: dict[int, tuple[Key, int]] = {}  # MIN: miss position -> (victim, its last use)
        self._room_misses: set[int] = set()  # MIN: miss positions that found a free slot
        self._nu: dict[Key, float] = {}  # resident key -> its next use
        self._max: list[tuple[float, Key]] = []  # (-next use, key), lazy
        self._min: list[tuple[float, Key]] = []  # (next use, key), lazy
        self._heaps = False  # _max / _min built and kept (from the first _furthest on)

    def prepare_future(self, accesses: list[Key]) -> None:
        """Index the stream: for every key, the sorted positions where it is used."""
        pos: dict[Key, list[int]] = {}
        for i, key in enumerate(accesses):
            pos.setdefault(key, []).append(i)
        self._positions = pos
        after = [_NEVER] * len(accesses)
        for plist in pos.values():
            for a, b in zip(plist, plist[1:], strict=False):
                after[a] = b
        self._stream, self._after = accesses, after
        if self.prefetch_rule != "aggressive":  # the only rule that never follows MIN's plan
            self._schedule, self._room_misses = self._plan_min(accesses, pos)
        for key in self.resident:
            self._track(key, 0)

    @staticmethod
    def _runs(accesses: list[Key]) -> list[int]:
        """Start index of the (pass, layer) run each access belongs to.

        The mechanism lists a layer's experts in ascending order, so a run ends where the
        layer changes or the expert index does not increase.
        """
        start, out = 0, []
        for i, (layer, e) in enumerate(accesses):
            if i and (layer != accesses[i - 1][0] or e <= accesses[i - 1][1]):
                start = i
            out.append(start)
        return out

    def _plan_min(self, accesses: list[Key], pos: dict[Key, list[int]]
                  ) -> tuple[dict[int, tuple[Key, int]], set[int]]:
        """Replay MIN (residency only, no timing) from the current residents.

        As in the mechanism, a miss may not evict an expert of its own (pass, layer) run
        that is still to be served, unless only such experts are resident (a prefill
        streaming through a small budget).

        Returns ``{position: (victim, victim's last use before it, or -1)}`` for every miss
        that evicts, and the positions of the misses that found a free slot.
        """
        nu: dict[Key, float] = {}
        heap: list[tuple[float, Key]] = []
        for key in self.resident:
            p = pos.get(key)
            nu[key] = p[0] if p else _NEVER
            heap.append((-nu[key], key))
        heapq.heapify(heap)
        runs = self._runs(accesses)
        n = len(accesses)
        ptr: dict[Key, int] = {}
        last: dict[Key, int] = {}
        sched: dict[int, tuple[Key, int]] = {}
        room: set[int] = set()
        cap = self.capacity_slots
        for i, x in enumerate(accesses):
            k = ptr.get(x, 0)
            ptr[x] = k + 1
            plist = pos[x]
            nxt = plist[k + 1] if k + 1 < len(plist) else _NEVER
            if x not in nu and len(nu) >= cap:
                r0, r1 = runs[i], i + 1
                while r1 < n and runs[r1] == r0:
                    r1 += 1
                pending = set(accesses[i:r1])  # this run's experts not served yet
                aside: list[tuple[float, Key]] = []
                v: Key | None = None
                while heap:
                    neg, cand = heapq.heappop(heap)
                    if nu.get(cand) != -neg:
                        continue
                    aside.append((neg, cand))
                    if cand not in pending:
                        v = cand
                        break
                for entry in aside:
                    if entry[1] != v:
                        heapq.heappush(heap, entry)
                if v is None:  # streaming: only unserved experts of this run are resident
                    v = max((key for key in nu if key != x), key=lambda key: (nu[key], key))
                sched[i] = (v, last.get(v, -1))
                del nu[v]
            elif x not in nu:
                room.add(i)
            nu[x] = nxt
            heapq.heappush(heap, (-nxt, x))
            last[x] = i
            if len(heap) > 4 * len(nu) + 1024:
                heap = [(-val, key) for key, val in nu.items()]
                heapq.heapify(heap)
        return sched, room

    def next_use(self, key: Key, now: int) -> float:
        """Position of the first use of ``key`` at or after ``now`` (inf: never again)."""
        if self._positions is None:
            raise ConfigError("belady: prepare_future() was not called (the mechanism must pass the access stream)")
        p = self._positions.get(key)
        if not p:
            return _NEVER
        i = bisect_left(p, now)
        return p[i] if i < len(p) else _NEVER

    # ---- bookkeeping ------------------------------------------------------------------
    def _track(self, key: Key, now: int) -> None:
        if self._positions is None:
            return
        self._set(key, self.next_use(key, now))

    def _set(self, key: Key, nu: float) -> None:
        """Index ``key``'s next use ``nu``."""
        self._nu[key] = nu
        if not self._heaps:
            return
        heapq.heappush(self._max, (-nu, key))
        heapq.heappush(self._min, (nu, key))
        if len(self._max) > 4 * len(self._nu) + 1024:  # drop stale entries now and then
            self._build_heaps()

    def _build_heaps(self) -> None:
        """Both heaps afresh from the next uses (one entry per resident key)."""
        self._max = [(-v, k) for k, v in self._nu.items()]
        self._min = [(v, k) for k, v in self._nu.items()]
        heapq.heapify(self._max)
        heapq.heapify(self._min)
        self._heaps = True

    def _refresh(self, now: int) -> None:
        """Recompute next uses that lie in the past (a use passed without an access)."""
        mn, nus = self._min, self._nu
        while mn:
            nu, key = mn[0]
            if nus.get(key) != nu:
                heapq.heappop(mn)
            elif nu < now:
                heapq.heappop(mn)
                self._track(key, now)
            else:
                break

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._track(key, now)

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        nus = self._nu
        if key in nus:
            stream = self._stream
            if now < len(stream) and stream[now] == key:  # the access at ``now`` itself:
                if self._heaps:  # its next use is the next position
                    self._set(key, self._after[now])
                else:  # _set without heaps, inlined (once per access)
                    nus[key] = self._after[now]
            else:
                self._track(key, now + 1)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._nu.pop(key, None)

    # ---- decisions --------------------------------------------------------------------
    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        if self._positions is None:
            raise ConfigError("belady: prepare_future() was not called (the mechanism must pass the access stream)")
        plist = self._positions.get(incoming)  # next_use(incoming, now), inlined (hot)
        if plist:
            i = bisect_left(plist, now)
            p = plist[i] if i < len(plist) else _NEVER
        else:
            p = _NEVER
        # The mechanism protects the running layer's experts, a demand load's own key
        # included; a prefetch's key is never protected (even when it is the next access).
        prefetch = incoming not in protected
        if prefetch and self.prefetch_rule == "conservative":
            return self._conservative(incoming, p, protected, now)
        if self.has_room(incoming):
            return None
        if not prefetch and self.prefetch_rule != "aggressive":
            plan = self._schedule.get(p)  # type: ignore[arg-type]
            if plan is not None and plan[0] in self.resident:
                v = plan[0]
                if v not in protected:
                    return v
                # MIN's victim is an expert of this layer still computing: the mechanism
                # waits for it (it is released once computed) and asks again.
                raise ConfigError(f"{self.name}: wait until {v} is released")
        best, best_nu = self._furthest(protected, now)
        if best is None:
            raise ConfigError(
                f"{self.name}: no evictable expert for {incoming} (capacity "
                f"{self.capacity_slots} slots, {len(protected)} protected)"
            )
        if prefetch and self.prefetch_rule in ("do_no_harm", "aggressive") and best_nu <= p:
            raise PrefetchRefused("%s: prefetching %s would evict %s, needed no later",
                                  self.name, incoming, best)
        return best

    def _conservative(self, incoming: Key, p: float, protected: set[Key], now: int) -> Key | None:
        """A prefetch may only do what MIN does at ``incoming``'s next miss ``p``."""
        if self.has_room(incoming):
            if p in self._room_misses:
                return None
            raise PrefetchRefused("%s: MIN fills no free slot with %s", self.name, incoming)
        plan = self._schedule.get(p)  # type: ignore[call-overload]
        if plan is not None:
            v, last_use = plan
            if v in self.resident and v not in protected and last_use < now:
                return v
        raise PrefetchRefused("%s: MIN makes no room for %s now", self.name, incoming)

    def _furthest(self, protected: set[Key], now: int) -> tuple[Key | None, float]:
        """The unprotected resident key with the furthest next use (lazy max-heap)."""
        if not self._heaps:
            self._build_heaps()
        self._refresh(now)
        mx, nus = self._max, self._nu
        aside: list[tuple[float, Key]] = []
        best: Key | None = None
        best_nu = -1.0
        while mx:
            neg, key = mx[0]
            if nus.get(key) != -neg:
                heapq.heappop(mx)
            elif key in protected:
                aside.append(heapq.heappop(mx))
            else:
                best, best_nu = key, -neg
                break
        for entry in aside:
            heapq.heappush(mx, entry)
        return best, best_nu

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        return max(candidates, key=lambda k: (self.next_use(k, now), k))
