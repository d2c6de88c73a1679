"""Whether feeding the predictor pays: the part of ``prefetch_if_pays`` that weighs running
its predictor at all (issue 27's eleventh stage; algorithms.md §12).

On a host-bound engine, handing every MoE layer to a predictor costs host time on the
critical path: f seconds per layer fed (the simulator's ``predictor_feed_s``; on the engine
the cost :func:`moeexp.engine.profile.profile_feed` measures, every expert resident, with the
predictor against without). The predictor earns it back only through the misses it removes.
The gate weighs the two per layer, in seconds:

* **saving** B: the misses an on-demand LRU cache of the same capacity would have had on the
  same accesses (the *shadow*, kept here) minus this cache's misses, times m, what a miss
  costs (the copy time, or the cheaper CPU computation where the execution may compute a
  miss there: ``NextUseCache.set_miss_cost``; since issue 27's nineteenth stage less the GPU
  time such a miss takes off the GPU's chain, ``feed_overlap``), per layer, over a window of :data:`WINDOW`
  fed passes after :data:`WARMUP` passes in which the predictor's state catches up;
* **bound** b: the shadow's misses per layer times m: the most that any predictor could
  save; b_short averages recent passes (decay :data:`DECAY` per pass), b_long the run
  (decay :data:`DECAY_LONG`). Both count from the first pass that begins with the shadow
  full: a cold cache's compulsory misses happen once a run and would inflate b_long for
  hundreds of passes.

At each pass's start (:meth:`FeedGate.pass_begins`), starting at rest until the bound has
been measured (the shadow full, then :data:`WARMUP` passes; a predictor no miss could pay
for is never fed):

* fed, with a window complete: rest if B < f, else feed on (a new window); the share of
  the bound that the predictor removes, r = ΣB / Σb over every window so far, is kept;
* resting: feed again when ρ⁺ · r · b_short > f (that share of the present bound would pay,
  discounted by what such promises have delivered: ρ⁺ below), or, after ``WINDOW · 2^k``
  passes of rest (k the windows in a row that did not pay, at most
  :data:`MAX_BACKOFF`), to measure again, if r⁺ · b_long > f, with r⁺ an optimistic share:
  1 before two windows, then min(1, r + 2 s / √n), s the standard deviation of the n
  windows' own shares (an upper confidence bound on r: the first windows are bought
  wherever b_long > f, later ones only while the share could still pay; a burst of misses,
  as at a request's start, does not buy one).

**The short route keeps its word** (issue 27's fifteenth stage). r · b_short is a promise
made at a window's opening; a burst of misses (a request's start) lifts b_short, and the
burst fades while the window runs. So a window the short route opens records its promise
P = r · b_short · m, and when it closes, the ratio B / P of what it saved to what it
promised. ρ⁺ is 1 before two such windows, then min(1, ρ), ρ the mean of their ratios: a
discount on an estimate, not an exploration bound (the long route, with its doubling rest
and r⁺, is what measures again, and it is unchanged). A predictor whose windows keep saving
what the short route promised is not slowed; one whose bursts deliver a fraction of it
stops being fed by them (on the embedded trace at 0.2 GB/s and a 600 µs feed, windows
opened at r · b_short ≈ 850 µs saved 180–500 µs, and the route reopened one every request
or so: 42 switches a run). The upper confidence bound min(1, ρ + 2 s / √n) was tried first:
it let 6 such windows through where the mean lets 2 (seed 0: +0.9 % against LRU, the mean
+0.45 %).

A window is **cut short** (closed as one that did not pay) once it has run :data:`EARLY_MIN`
passes and an upper confidence bound on its passes' mean saving, mean + 2 s / √n (s the
standard deviation of the n passes' own savings B_p), is below f: a predictor that saves a
fifth of its cost stops being bought after 4 passes, not 16 (issue 27's thirteenth stage:
the measuring windows were the whole loss where a miss costs barely more than the feed).
A window whose passes could still pay runs its 16 passes.

While it rests the cache evicts the least recently used expert (:meth:`FeedGate.lru`: the
cache's residents in the order of their last insert or use, as ``lru`` keeps them; the
predictor's probabilities are stale), or, as an option, the resident of least resting
probability, LRU among equals (:meth:`FeedGate.rest_victim`, ``rest_evict: prob``; below,
eighteenth stage). With ``rest_prefetch`` off it is LRU, so a resting ``prefetch_if_pays``
is on-demand LRU exactly, decision for decision, on the simulator and on the engine (whose access clock is
not the order of events: a layer's hits are used before its demand loads but ranked by
expert). It also keeps the routing of the last :data:`HISTORY` rested passes
(:meth:`FeedGate.rested`: bool[L, J] each, from the accesses it sees anyway), which the
predictor takes when it is fed again to bring its running state up to date: without it,
recency and averages are stale after a rest and the next window measures a predictor worse
than LRU.
With f = 0 there is no gate: every pass is fed and nothing is kept (every run without a
feed cost is bit-identical to the policy before the gate).

**What a resting policy may still prefetch** (issue 27's seventeenth stage). While it
rests, the gate also keeps each expert's use at the last :data:`REST_BITS` rested runs of
its layer, a bit pattern h (bit i: used at the (i+1)-th latest; "used": the layer's routing,
which the mechanism hands over in the rested pass whether the GPU or the CPU computes the
expert; :meth:`FeedGate.rest_observe`). Its probability of use at the layer's next run is
a table over the 2^:data:`REST_BITS` patterns, P(h), fitted on the store split's
consecutive decode passes (:func:`fit_rest_table`: the share of (pass, layer, expert)
cells with that pattern whose expert was used, Laplace-smoothed; one table for every layer
and expert). It is model-free (a lookup, no feed), calibrated as the predictor's
probabilities are, and ranks as HybriMoE's "minus recent score" on routing alone would, a
recency-weighted use rate, where the store agrees. Without a table (a gate made without a
fit) P(h) is that score itself, sum over bits of 2^-(i+1) (HybriMoE's alpha 0.5).
:meth:`FeedGate.rest_offers` ranks a layer's experts by it; the ``next_use`` cache takes
them as the resting predictor's next-layer offers, under its own cost rule with P(h) as the
probabilities (``NextUseCache.rest_layer``). On the real CPU map HybriMoE's whole lead over
on-demand LRU is that prefetch (its MRS eviction alone is LRU to 0.4 %:
``experiments/regime_map/README.md``, seventeenth stage).

**Store-frequency buckets** (eighteenth stage). The table may have a row per bucket b of
the experts' store-split use (:func:`store_buckets`: quarters of the L·J experts by rank
with the ``next_use`` option ``rest_buckets: 4``), P(b, h), so an expert the store used
often keeps a higher probability through a few idle runs (kTransformers' frequency pinning)
and a rarely used one a lower one after a single use. Under ``rest_evict: prob`` the
resting victim is the resident of least P(b, h). Measured (with the feed charged): ahead of
every other system at all 8 points of the embedded CPU map and 2.5–8.5 % faster than LRU
eviction at 25 % of the real CPU map, but up to 4 % slower at 50 % of it: six runs of
pattern cannot tell an expert idle for 7 runs from one idle for 100, and at a large budget
that long recency is what LRU keeps and the bucket overrides. So it stayed an option, off,
until the age classes below.

**Age classes** (issue 27's nineteenth stage; the ``next_use`` option ``rest_ages: A``,
here 0 by default; ``next_use`` has 8, with 4 buckets and ``rest_evict: prob``). An expert unused for the last :data:`REST_BITS` runs (h = 0) reads, in place
of the one column P(b, 0), the column of its age class: its runs since its last use, a,
in doubling classes, c = min(A − 1, ⌊log2(a − REST_BITS + 1)⌋) (a = 6: class 0; 7–8: 1;
9–12: 2; ...; never used: A − 1), so the table has 2^REST_BITS + A columns, the first
(h = 0) unread. The fit counts the same classes on the store passes. An expert idle for
7 runs and one idle for 100 then have the probabilities the store gives them, and the
``prob`` victim among a bucket's idle experts is the one idle longest, as LRU's would be.
Measured (the feed charged): ahead of every other system at all 8 points of the real CPU map
(−3.0 to −8.9 %, 1.2–8.9 % faster than the policy before) and of the embedded one
(``experiments/regime_map/README.md``, nineteenth stage).

**A pass of many tokens** (issue 27's twentieth stage; the ``next_use`` option
``rest_within_pass``, on by default, where a miss is a copy). A prefill runs every layer
once over T tokens and uses nearly every expert of each: a resident of a layer the pass
has still to run is used within the pass with probability 1 - (1 - P(h))^T (P(h) its
resting probability per run, tokens taken as independent draws), while one of a layer
already run (or the running one) is next used at the next pass, with P(h). The resting
victim (:meth:`FeedGate.rest_victim`) weighs each by that: in a prefill it evicts the
layers behind first, Belady's choice on a loop, where LRU evicts the layers ahead, whose
experts the pass needs next (a loop longer than the cache is LRU's worst case). A
one-token pass is as before. Measured, with every predictor's feed priced: TTFT 8–29 %
lower at every point of the embedded feed map, TPOT within 0.05 %
(``experiments/regime_map/README.md``, twentieth stage). Not where the execution computes
a miss on the CPU for less than a copy: there a miss need not come in at all, and on the
embedded CPU map the rule cut TTFT by 1–15 % but cost 1–4 % of TPOT at 5 of 8 points (the
prefill evicted the layers behind, the store's hot experts among them, which the decode
steps then missed).

**Against the resting policy, not LRU** (issue 27's eighteenth stage; ``rest_baseline``, here and
as the ``next_use`` option, off by default: on the embedded CPU map it rested the predictor
where feeding it paid, +1.7 % and +2.1 % TPOT at two points, and moved the other six by at
most 0.5 %; ``experiments/regime_map/README.md``). With resting offers
the policy the predictor would replace is no longer on-demand LRU: the offers save misses of
their own. So the gate also measures what resting saves, g, the shadow's misses minus this
cache's per layer over rested passes, decayed as b_long is (:data:`DECAY_LONG`), counted
from the :data:`SETTLE`-th pass of a rest that follows a fed one (before it this cache still
holds what the fed predictor left, which is not the resting policy's doing); the first
window waits until g has :data:`WINDOW` passes (a predictor that pays against LRU would
otherwise be fed for good before g is ever measured). Every test weighs the fed saving
beyond it: a window pays if B − g·m ≥ f, it is cut short when its upper bound less
g·m is below f, and the routes feed when ρ⁺ · r · b_short · m − g·m > f and r⁺ · b_long ·
m − g·m > f. Without resting offers g is 0 (resting is LRU, and the difference a rest sees
is the fed window's leftovers), and so is every run without them: bit-identical.

B is an estimate that errs towards feeding: a prefetched hit counts a whole miss saved,
though a late copy saves only part of one, and the link time that prefetches take from
demand loads is not charged (the prefetch gate weighs that per prefetch).

Why hand-written: a counter, an ordered dict and five numbers; nothing to fit.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

from moeexp.errors import ConfigError
from moeexp.traces.schema import Trace

Key = tuple[int, int]

WINDOW = 16  #: fed passes a saving is measured over
EARLY_MIN = 4  #: fed passes a window runs before it may be cut short (module doc)
WARMUP = 2  #: fed passes after a rest before the window counts
MAX_BACKOFF = 8  #: most doublings of a rest before the gate measures again
DECAY = 0.9  #: per-pass decay of the bound's short average
DECAY_LONG = 0.99  #: per-pass decay of the bound's long average
HISTORY = 64  #: rested passes whose routing is kept for the predictor's catch-up
REST_BITS = 6  #: rested runs of a layer whose use the resting probability reads (module doc)
NEVER = 2 ** 30  #: the age of an expert not used since the gate began (runs)
SETTLE = WINDOW  #: passes of a rest before its savings count towards g (module doc)


class FeedGate:
    """The shadow LRU, the window's counts and the decision (module doc).

    Args:
        capacity_slots: the cache's capacity (the shadow's).
        num_layers, num_experts: L, J.
        feed_s: f, seconds per MoE layer fed (> 0).
        miss_s: m, seconds a miss costs (> 0; the cache updates :attr:`miss_s` when its
            execution's miss cost changes).
        initial: keys resident before the first request (a warm cache), oldest first: the
            shadow's start.
        rest_table: float64[2^REST_BITS] or float64[B, 2^REST_BITS], the resting
            probability of each use pattern (in each of B store-frequency buckets:
            :func:`fit_rest_table`); None: the decayed score (module doc).
        rest_bucket: int[L, J], each expert's store-frequency bucket (:func:`store_buckets`),
            the row of ``rest_table`` it reads; None: bucket 0 for all.
        rest_baseline: measure g, what resting saves against the shadow, and weigh the fed
            saving beyond it (module doc, Against the resting policy); False (a resting
            policy that is LRU): g = 0.
        rest_ages: A, the age classes of an expert idle for :data:`REST_BITS` runs or more
            (module doc, Age classes): ``rest_table`` then has 2^REST_BITS + A columns;
            0: none (2^REST_BITS columns).
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 feed_s: float, miss_s: float, initial: list[Key] | None = None,
                 rest_table: np.ndarray | None = None, rest_baseline: bool = False,
                 rest_bucket: np.ndarray | None = None, rest_ages: int = 0) -> None:
        for name, v in (("feed_s", feed_s), ("miss_s", miss_s)):
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"feed gate: {name} must be a finite number > 0 s, got {v}")
        self.capacity, self.feed_s, self.miss_s = capacity_slots, float(feed_s), float(miss_s)
        self.shadow: OrderedDict[Key, None] = OrderedDict((k, None) for k in initial or [])
        #: the cache's residents, least recently inserted or used first (:meth:`lru`; the
        #: cache's inserts fill it, a warm cache's preload included)
        self.order: OrderedDict[Key, None] = OrderedDict()
        self.num_layers, self.num_experts = num_layers, num_experts
        self.fed = False  # it starts resting: the first passes measure the bound
        self.resting_passes = self.fed_passes = self.switches = 0
        self.windows = 0  # complete measuring windows
        self.saving_s = math.nan  # B of the last complete window, s per layer
        self.share = 0.0  # r, over every complete window
        self.bound = math.nan  # shadow misses per layer, short average (b_short / m)
        self.bound_long = math.nan  # the same, long average (b_long / m)
        self._pooled = [0, 0]  # every complete window's shadow misses saved, shadow misses
        self._shares = [0.0, 0.0]  # sum and sum of squares of the windows' own shares
        self._since = 0  # passes in the present state, the one that begins included
        self._backoff = 0  # k
        self._rest = WARMUP  # passes of the running rest before the gate measures again
        self._win = [0, 0, 0]  # the window's shadow misses, own misses, layers
        self._wpass = [0, 0.0, 0.0]  # the window's passes, sum and sum of squares of their B
        self.cut = 0  # windows cut short (module doc)
        self._promise = 0.0  # P of the running window if the short route opened it, else 0
        self._kept = [0, 0.0]  # the short route's windows: n, and the sum of their B / P
        self._pass = [0, 0, 0]  # the running pass's
        self._layer = -1  # layer of the latest access (-1: a pass began)
        self._started = False
        self._warm = len(self.shadow) >= capacity_slots  # the shadow is full: b counts
        self._used: list[Key] = []  # the resting pass's accesses
        self._rested: deque[list[Key]] = deque(maxlen=HISTORY)  # rested passes' accesses
        #: uint8[L, J]: each expert's use pattern over its layer's last rested runs
        self.history = np.zeros((num_layers, num_experts), dtype=np.uint8)
        _check_ages(rest_ages)
        self.rest_ages = rest_ages
        if rest_table is None:
            rest_table = decayed_table(rest_ages)
        table = np.asarray(rest_table, dtype=np.float64)
        if table.ndim == 1:
            table = table[None, :]
        width = 2 ** REST_BITS + rest_ages
        if table.ndim != 2 or table.shape[1] != width:
            raise ConfigError(f"feed gate: rest_table must have {width} entries (per bucket: "
                              f"2^{REST_BITS} patterns and {rest_ages} age classes), got "
                              f"shape {np.shape(rest_table)}")
        #: float64[B, 2^REST_BITS]: P(used at the next run | bucket, pattern) (module doc)
        self.rest_table = table
        bucket = (np.zeros((num_layers, num_experts), dtype=np.intp) if rest_bucket is None
                  else np.asarray(rest_bucket, dtype=np.intp))
        if bucket.shape != (num_layers, num_experts) or not (
                (bucket >= 0) & (bucket < table.shape[0])).all():
            raise ConfigError(f"feed gate: rest_bucket must be int[{num_layers}, "
                              f"{num_experts}] in [0, {table.shape[0]}), got shape "
                              f"{bucket.shape}")
        #: int[L, J]: each expert's row of :attr:`rest_table`
        self.rest_bucket = bucket
        #: int[L, J]: runs of its layer since each expert's last use (:data:`NEVER` before
        #: it); kept only with age classes
        self.age = np.full((num_layers, num_experts), NEVER, dtype=np.int64)
        #: int[L, J]: each expert's column of :attr:`rest_table` (:attr:`history` itself
        #: without age classes)
        self.column = (self.history if not rest_ages else
                       rest_column(self.history, self.age, rest_ages))
        self.tokens = 1  # token rows of the running pass (pass_begins)
        self.measure_rest = bool(rest_baseline)
        #: g: misses per layer resting saves against the shadow, decayed (0 until measured)
        self.rest_gain = 0.0
        self._gain_avg = 0.0  # g before the clip at 0
        self._gain_n = 0  # rested passes measured into g
        self._gain_needed = WINDOW if self.measure_rest else 0  # before the first window

    # ---- events (the cache forwards them) -------------------------------------------
    def insert(self, key: Key) -> None:
        """``key`` became resident in the cache (a demand load or a prefetch)."""
        order = self.order
        order[key] = None
        order.move_to_end(key)

    def evict(self, key: Key) -> None:
        """``key`` left the cache."""
        self.order.pop(key, None)

    def access(self, key: Key, hit: bool) -> None:
        """A layer used ``key``; ``hit``: it was resident (and ready) in this cache."""
        order = self.order
        if key in order:
            order.move_to_end(key)
        if not self.fed:
            self._used.append(key)
        p = self._pass
        if key[0] != self._layer:
            self._layer = key[0]
            p[2] += 1
        if not hit:
            p[1] += 1
        shadow = self.shadow
        if key in shadow:
            shadow.move_to_end(key)
            return
        p[0] += 1
        shadow[key] = None
        if len(shadow) > self.capacity:
            shadow.popitem(last=False)

    def lru(self, allowed: Callable[[Key], bool]) -> Key | None:
        """The least recently inserted or used resident for which ``allowed`` holds (the
        resting cache's victim, as ``lru`` picks it); None if there is none."""
        for key in self.order:
            if allowed(key):
                return key
        return None

    def rest_observe(self, layer: int, experts: np.ndarray) -> None:
        """A rested run of ``layer`` routed to ``experts`` (int[n]): each expert's use
        pattern moves on by one run (module doc, What a resting policy may still
        prefetch)."""
        row = self.history[layer]
        row <<= 1
        row &= 2 ** REST_BITS - 1
        row[experts] |= 1
        if self.rest_ages:
            age = self.age[layer]
            np.minimum(age + 1, NEVER, out=age)
            age[experts] = 0
            self.column[layer] = rest_column(row, age, self.rest_ages)

    def rest_prob(self, key: Key) -> float:
        """P(h): the resting probability that ``key`` is used at its layer's next run."""
        return float(self.rest_table[self.rest_bucket[key], self.column[key]])

    def rest_victim(self, allowed: Callable[[Key], bool], within_pass: bool = False
                    ) -> Key | None:
        """The resident for which ``allowed`` holds of least resting probability, the least
        recently inserted or used among equals (the resting cache's victim under
        ``rest_evict: prob``); None if there is none. With ``within_pass``, in a pass of T
        > 1 tokens a resident of a layer the pass has still to run (beyond the layer of the
        latest access) weighs 1 - (1 - P(h))^T, its use within this pass (module doc, A
        pass of many tokens); a one-token pass reads P(h) alone either way."""
        best, best_p = None, math.inf
        table, bucket, column = self.rest_table, self.rest_bucket, self.column
        T, cur = self.tokens, self._layer
        ahead = within_pass and T > 1
        for key in self.order:
            if allowed(key):
                p = table[bucket[key], column[key]]
                if ahead and key[0] > cur:
                    p = 1.0 - (1.0 - p) ** T
                if p < best_p:
                    best, best_p = key, p
        return best

    def rest_offers(self, layer: int, k: int) -> np.ndarray:
        """int64[<= k]: of layer ``layer``'s k experts of highest resting probability (best
        first; ties: the lower expert), those used at one of its last :data:`REST_BITS`
        rested runs (module doc, What a resting policy may still prefetch). With
        store-frequency buckets a hot expert idle that long may rank among the k; it is
        not offered (under ``rest_evict: prob`` it is most likely resident anyway), so a
        layer may get fewer than k offers."""
        hist = self.history[layer]
        p = self.rest_table[self.rest_bucket[layer], self.column[layer]]
        order = np.argsort(-p, kind="stable")[:k]
        return order[hist[order] > 0]

    # ---- the decision ---------------------------------------------------------------
    def pass_begins(self, tokens: int = 1) -> bool:
        """Fold the pass that ended into the counts; True: feed the pass that begins, of
        ``tokens`` token rows (a prefill, or a decode pass of several requests, has more
        than one: :meth:`rest_victim` reads it)."""
        self.tokens = int(tokens)
        if self._started:
            self._fold()
        self._started = True
        self._since += 1
        f, m = self.feed_s, self.miss_s
        if self.fed:
            if self._win[2] and (self._since > WARMUP + WINDOW or self._hopeless()):
                self._close_window()
        elif math.isfinite(self.bound) and self._gain_n >= self._gain_needed:
            promise = self.share * self.bound * m
            g = self.rest_gain * m
            if promise * self._kept_word() - g > f:
                self._promise = promise
                self._switch(True)
            elif self._since > self._rest and self._hope() * self.bound_long * m - g > f:
                self._switch(True)
        if self.fed:
            self.fed_passes += 1
        else:
            self.resting_passes += 1
        return self.fed

    def _close_window(self) -> None:
        """A window is complete: its saving B, the shares r (pooled) and the window's own,
        then rest ``WINDOW * 2^k`` passes if B < f (k the failed windows in a row), else a
        new window."""
        shadow, own, layers = self._win
        saving = (shadow - own) * self.miss_s / layers
        self.saving_s = saving
        self.windows += 1
        r_win = max(0.0, (shadow - own) / shadow) if shadow else 0.0
        self._shares[0] += r_win  # the windows' own shares: sum, sum of squares
        self._shares[1] += r_win * r_win
        pooled = self._pooled
        pooled[0] += shadow - own
        pooled[1] += shadow
        self.share = max(0.0, pooled[0] / pooled[1]) if pooled[1] else 0.0
        if self._since <= WARMUP + WINDOW:
            self.cut += 1
        if self._promise > 0:  # the short route opened it: what it kept of its promise
            ratio = max(0.0, saving) / self._promise
            self._kept[0] += 1
            self._kept[1] += ratio
            self._promise = 0.0
        self._win = [0, 0, 0]
        self._wpass = [0, 0.0, 0.0]
        self._since = WARMUP + 1  # the pass that begins is the next window's first
        if saving - self.rest_gain * self.miss_s < self.feed_s:
            self._rest = WINDOW * 2 ** self._backoff
            self._backoff = min(MAX_BACKOFF, self._backoff + 1)
            self._switch(False)
        else:
            self._backoff = 0

    def _hopeless(self) -> bool:
        """The running window cannot pay: after :data:`EARLY_MIN` passes, an upper
        confidence bound on its passes' mean saving, mean + 2 s / √n (s their standard
        deviation), is below f (module doc)."""
        n = self._wpass[0]
        if n < EARLY_MIN:
            return False
        mean, margin = _margin(n, *self._wpass[1:])
        return mean + margin - self.rest_gain * self.miss_s < self.feed_s

    def _hope(self) -> float:
        """r⁺: 1 before two windows, then min(1, r + 2 s / √n) (module doc)."""
        n = self.windows
        if n < 2:
            return 1.0
        return min(1.0, self.share + _margin(n, *self._shares)[1])

    def _kept_word(self) -> float:
        """ρ⁺: 1 before two windows of the short route, then min(1, ρ), ρ the mean of their
        ratios of saving to promise (module doc)."""
        n = self._kept[0]
        if n < 2:
            return 1.0
        return min(1.0, self._kept[1] / n)

    def _fold(self) -> None:
        """The pass that ended: into the window (fed, past the warm-up) and the bound."""
        p = self._pass
        if p[2] and self._warm:
            rate = p[0] / p[2]
            if not math.isfinite(self.bound):
                self.bound = self.bound_long = rate
            else:
                self.bound = DECAY * self.bound + (1.0 - DECAY) * rate
                self.bound_long = DECAY_LONG * self.bound_long + (1.0 - DECAY_LONG) * rate
        if self.fed and self._since > WARMUP:
            for i in range(3):
                self._win[i] += p[i]
            if p[2]:
                b = (p[0] - p[1]) * self.miss_s / p[2]  # this pass's saving, s per layer
                w = self._wpass
                w[0] += 1
                w[1] += b
                w[2] += b * b
        if not self.fed and p[2]:  # a rested pass: its routing, for the catch-up
            self._rested.append(self._used)
            if self.measure_rest and self._warm and (not self.fed_passes
                                                     or self._since > SETTLE):
                self._gain((p[0] - p[1]) / p[2])
            self._used = []
        self._pass = [0, 0, 0]
        self._layer = -1
        if not self._warm and len(self.shadow) >= self.capacity:
            self._warm, self._since = True, 0  # at rest since the start: WARMUP passes of b

    def _gain(self, rate: float) -> None:
        """A settled rested pass saved ``rate`` misses per layer against the shadow: into g
        (module doc, Against the resting policy), never below 0."""
        self._gain_n += 1
        if self._gain_n == 1:
            self._gain_avg = rate
        else:
            self._gain_avg = DECAY_LONG * self._gain_avg + (1.0 - DECAY_LONG) * rate
        self.rest_gain = max(0.0, self._gain_avg)

    def rested(self) -> list[np.ndarray]:
        """The routing of the rested passes kept since the last call, oldest first (bool[L,
        J] each, at most :data:`HISTORY`); the predictor takes it when it is fed again."""
        out = []
        for keys in self._rested:
            used = np.zeros((self.num_layers, self.num_experts), dtype=bool)
            if keys:
                used[tuple(np.asarray(keys).T)] = True
            out.append(used)
        self._rested.clear()
        return out

    def _switch(self, fed: bool) -> None:
        self.fed, self._since = fed, 1  # the pass that begins is the new state's first
        self.switches += 1

    def stats(self) -> dict[str, float]:
        """Flat metrics (``predictor_feed_*`` in a run's metrics)."""
        n = self.fed_passes + self.resting_passes
        return {"feed_s_per_layer": self.feed_s, "feed_rested_share":
                self.resting_passes / n if n else math.nan,
                "feed_switches": float(self.switches),
                "feed_windows_cut": float(self.cut),
                "feed_saving_us_per_layer": self.saving_s * 1e6,
                "feed_rest_gain_us_per_layer": self.rest_gain * self.miss_s * 1e6}


def decayed_table(ages: int = 0) -> np.ndarray:
    """float64[2^REST_BITS + ages]: each use pattern's decayed score, sum over its bits i of
    2^-(i+1) (HybriMoE's score with alpha 0.5 on routing alone; the table without a fit),
    and 0 for every age class."""
    pats = np.arange(2 ** REST_BITS)
    score = sum(((pats >> i) & 1) * 0.5 ** (i + 1) for i in range(REST_BITS))
    return np.concatenate([score, np.zeros(ages)])


def _check_ages(ages: int) -> None:
    if isinstance(ages, bool) or not isinstance(ages, int) or ages < 0:
        raise ConfigError(f"feed gate: rest ages must be an integer >= 0, got {ages!r}")


def rest_column(history: np.ndarray, age: np.ndarray, ages: int) -> np.ndarray:
    """int[...]: the resting table's column of each expert (module doc, Age classes): its
    use pattern ``history`` where it is not 0, else 2^REST_BITS plus its age class,
    min(ages − 1, ⌊log2(age − REST_BITS + 1)⌋), ``age`` its runs since its last use (≥
    REST_BITS where the pattern is 0)."""
    hist = np.asarray(history, dtype=np.int64)
    idle = np.maximum(np.asarray(age, dtype=np.int64) - REST_BITS + 1, 1)
    cls = np.minimum(ages - 1, np.frexp(idle.astype(np.float64))[1] - 1)
    return np.where(hist > 0, hist, 2 ** REST_BITS + cls)


def store_buckets(counts: np.ndarray, buckets: int) -> np.ndarray:
    """int[L, J]: each expert's store-frequency bucket, 0 the most used: its rank among all
    L·J experts by ``counts`` (float[L, J], the store split's uses; ties: the lower layer,
    then expert, first) times ``buckets`` over L·J."""
    if not (isinstance(buckets, int) and buckets >= 1):
        raise ConfigError(f"feed gate: rest buckets must be an integer >= 1, got {buckets!r}")
    flat = np.asarray(counts, dtype=np.float64).reshape(-1)
    rank = np.empty(flat.size, dtype=np.intp)
    rank[np.argsort(-flat, kind="stable")] = np.arange(flat.size)
    return (rank * buckets // flat.size).reshape(np.shape(counts))


def fit_rest_table(store: Trace, bucket: np.ndarray | None = None,
                   ages: int = 0) -> np.ndarray:
    """float64[B, 2^REST_BITS + ages]: P(used at a layer's next run | its store-frequency
    bucket, its use pattern over the layer's last :data:`REST_BITS` runs, or its age class
    where that is 0), from the store split's single-token passes in order (the runs of one
    layer, consecutive across requests, as the gate sees them), over every layer and expert
    of the bucket: (uses + 1) / (cells + 2) per column. ``bucket``: int[L, J]
    (:func:`store_buckets`); None: one bucket (B = 1). ``ages``: the age classes (module
    doc, Age classes; 0: none). Store split only (ConfigError otherwise)."""
    _check_ages(ages)
    bad = [r.request_id for r in store.requests if r.split != "store"]
    if bad:
        raise ConfigError(f"feed gate: fit_rest_table() got {len(bad)} request(s) outside the "
                          f"store split (e.g. {bad[:3]}): pass trace.split('store')")
    L, J = store.dims.num_layers, store.dims.num_experts
    if bucket is None:
        bucket = np.zeros((L, J), dtype=np.intp)
    B = int(bucket.max()) + 1
    sizes = np.diff(store.iter_offsets)
    idx = store.topk_idx[np.repeat(sizes == 1, sizes)]  # [N, L, K]
    n = idx.shape[0]
    size = 2 ** REST_BITS + ages
    cells, uses = np.zeros(B * size), np.zeros(B * size)
    runs = np.arange(n, dtype=np.int64)[:, None]
    for layer in range(idx.shape[1]):  # one layer at a time: [N, J] arrays
        used = np.zeros((n, J), dtype=np.int64)
        np.put_along_axis(used, idx[:, layer].astype(np.int64), 1, axis=1)
        pats = np.zeros((max(0, n - REST_BITS), J), dtype=np.int64)
        for i in range(REST_BITS):  # bit i: used i + 1 runs before
            pats |= used[REST_BITS - 1 - i:n - 1 - i] << i
        if ages and n > REST_BITS:  # the age at run t: t - 1 - the last use before t
            last = np.maximum.accumulate(np.where(used > 0, runs, -NEVER), axis=0)
            age = np.minimum(runs[REST_BITS - 1:n - 1] - last[REST_BITS - 1:n - 1], NEVER)
            pats = rest_column(pats, age, ages)
        pats += np.asarray(bucket[layer], dtype=np.int64)[None, :] * size  # the bucket's row
        cells += np.bincount(pats.ravel(), minlength=B * size)
        uses += np.bincount(pats.ravel(), weights=used[REST_BITS:].ravel(), minlength=B * size)
    return ((uses + 1.0) / (cells + 2.0)).reshape(B, size)


def _margin(n: int, total: float, squares: float) -> tuple[float, float]:
    """The mean of n ≥ 2 values from their sum and sum of squares, and the margin 2 s / √n
    (s their sample standard deviation) that the gate's upper confidence bounds add."""
    mean = total / n
    var = max(0.0, (squares - n * mean * mean) / (n - 1))
    return mean, 2.0 * math.sqrt(var / n)
