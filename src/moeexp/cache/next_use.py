"""``next_use``: approximate Belady from predicted next use, and a prefetch gate that pays.

The cache half of the ``prefetch_if_pays`` system (algorithms.md §12).

**Eviction.** Each expert ``(l, e)`` has ``P[l, e]``, the probability that it is used the
next time layer l runs (the predictor's ``scores``: for a layer still ahead in the running
pass, this pass; otherwise the next pass; before any score, the store split's per-pass
popularity from :meth:`fit`). Layers run in a cycle of L, so with ``c`` the layer of the
latest access, layer l next runs ``Δ_l = ((l - c - 1) mod L) + 1`` layer steps from now.
If that run uses the expert with probability P, and each later pass (should it not) with
probability Q, its expected next use is ``E = Δ_l + L (1 - P) / Q`` layer steps away (a
geometric wait after the first chance). The predictor's per-pass probability *after* layer
l's next run (:meth:`observe_later`) is ``Q_later``; where none was given, Q = P (one
geometric wait). The two differ for a layer still ahead in the running pass: its P is this
pass's (the router's evidence says "not now"), while an expert it will not use now may be
as likely as ever to be used at the next pass; extrapolating P would evict it as if never.
That reload costs a copy only where the link has no slack to prefetch the expert back in
time, so Q = s Q_later + (1 - s) P with s the link's saturation below (1 without a cost
model): on a saturated link the next-pass estimate, on a free one this pass's use.
The victim is the unprotected resident expert of largest E (Belady's rule on the estimate).
Demand loads are never refused.

**Horizon** (:meth:`set_horizons`, issue 27's seventh stage). The next pass alone says little
when the next token will not route to an expert that the one after it will, and a cache
holds an expert for several passes. Where the predictor hands ``W[h][l, e]``, the probability
that the expert is used within the next h runs of its layer (:meth:`observe_within`), the
cache takes h from its own residence time: R = capacity / (copies per pass, counted since
the start), h the one of {1} and the handed horizons nearest R / 2 in log scale (h = 1 until
a pass has run). For h > 1, the per-pass rate q = 1 - (1 - W)^(1/h) (the geometric rate with
that chance in h tries) replaces P and Q: ``E = Δ_l + L (1 - q') / q'`` with q' = P + s (q -
P) (s the saturation below: on a free link this pass's use, as without a horizon). In
demand-only replays of the copy-bound maps this keeps more of what the next few tokens use
than the next-pass rule (``experiments/regime_map/README.md``).

**Prefetch gate.** A prefetch of ``k`` (recognised, as in ``belady``, by ``k`` not being
protected) whose victim would be ``v`` is taken only if

* ``E[v] > E[k]`` (the victim is expected to be needed later than ``k``: Cao et al.'s
  Aggressive condition, on estimates), and
* ``P_k min(m, w) - (1 - P_k) x s - (1 - P_k) P_v m > 0``: the stall a used prefetch
  hides (at most what the miss would cost, m, and at most the compute window w of a layer
  of this pass, which is all the link time a prefetch can overlap) against the link time a
  wasted one takes from demand loads (its copy time x times the link's saturation ``s``)
  and the miss of a victim evicted for nothing, P_v its use at its layer's next run. With
  ``victim_horizon: true`` (off by default; issue 27's twelfth stage) P_v is instead its
  chance of use while the prefetch holds its slot, as far as its reload costs a copy:
  P[v] + s (W_h[v] - P[v]), W_h[v] its use within the next h runs of its layer (the
  horizon in use below; P[v] where h = 1) and s the saturation below (on a free link a
  later use is prefetched back in time, as for Q). The two sides differ on purpose: a
  victim needed at any of those runs costs one more copy, while a prefetched expert used
  only at a later run just moves its own copy earlier, which saves nothing on a busy link.
  ``s = min(1, n x / w)``, with n the copies the link has made per layer lately (an
  average over the last layers): its demand loads and every prefetch it started, used or
  not (``saturation_counts: all``, the default since issue 27's twenty-first stage: a
  prefetch the gate takes occupies the link whether or not it is used, so a burst of
  offers taken while the link looked free raises s for the next ones; ``needed``: the
  demand loads and the used prefetches only, as before, which left s near 0 after a few
  layers of hits while the gate's own wasted prefetches kept the link busy). m = x where
  every miss is copied. That s (``saturation_model: load``) is the link's busy share of the
  window. Where every miss is a copy (``by_execution``, the default since issue 27's
  twenty-second stage; ``overflow`` everywhere) s is instead the share of one more copy's
  time that spills past the layer's compute window, ``clip(n + 1 - w / x, 0, 1)``: a wasted
  copy delays the demand loads of the next layer only by the part of the link's work that
  outlasts the window (on a free link, x < w, s = 0 until a layer's copies near w / x; on a
  busy one s >= 1 - w / x even before any copy is counted). Where the CPU may compute a
  miss no demand load waits on the link, only later prefetches, and ``by_execution`` keeps
  the load (measured: the spill there cost 4-6 % at 50 % of the embedded CPU map).

**Balance** (``balance``, the default; issue 27's twenty-fifth stage). A layer computes its
resident experts first, while its demand copies come in one after another, so its stall is
what of its demand chain outlasts its hits' compute: convex in its misses, not their sum. In
a batched pass (continuous batching: each expert computes many tokens) the first few misses
of a layer are hidden and the last ones stall whole, so Belady's rule on E, which keeps
whole layers resident on a cyclic stream and leaves others all misses, stalls more than a
spread of the same hits (measured on ``emoe_serving``: ``experiments/emoe_serving/README.md``).
With c one used expert's compute in the running pass (handed by the predictor), a layer is
*hidden* (:meth:`hidden_layers`) when its expected hits' compute less its expected demand
chain covers one more whole copy and its compute: ``c sum(P, resident) - x sum(P, absent) >=
x + c``. The victim is then the largest-E resident of a hidden layer (the largest E of all
where none is), a prefetch into a hidden layer is refused (its miss would be hidden: it
saves nothing), and a victim of a hidden layer costs the gate no miss (P_v = 0). With one
token a pass, ``sum(P)`` over a layer is about top-k, so a layer can be hidden only where
one expert's compute is at least a copy over top-k - 1: not on a copy-bound link. Where the
CPU may compute a miss the rule is off (a miss there is not a copy).

**Where the CPU may compute a miss** (:meth:`set_miss_cost`, from the run's execution policy,
issue 27's eighth stage) m is the cheaper of the copy and the CPU's computing it, and the first
term is replaced by what the prefetch buys there: ``P_k (m - max(0, x - d w))`` for its use in
this pass (d the layers ahead of the latest access: a copy that lands late makes the GPU wait
the rest of it, where the CPU would have taken m) plus ``max(0, Q_k - Q_v) R m``, the later
passes' uses it gains over its victim while it stays (Q the per-pass probabilities above, R
the cache's residence in passes, capacity / copies per pass, at most :data:`R_CAP`). With a
slow CPU (m = x) prefetches pay as on the copy maps; with a fast one only those whose
residence outweighs their late landing. Where the execution computes a late copy's expert
on the CPU (``late_to_cpu``, told by :meth:`set_miss_cost`) the late landing costs at most m:
``P_k (m - min(m, max(0, x - d w)))``.

x and w come from the cost model the run is priced with, handed over by the ``reuse_prob``
predictor (:meth:`set_link`): on a saturated link (x >> w) a prefetch pays only when P_k >
x / (x + w), so the policy degrades to on-demand loading with the eviction above; on a free
link (x < w, s -> 0) it prefetches whatever is more likely needed than its victim. Without
a cost model (another predictor, or an engine built without one) only the first condition
gates.

**Whether to run the predictor at all** (:meth:`set_feed_cost`, issue 27's eleventh stage):
where feeding the predictor costs the run host time per layer, :class:`moeexp.cache.feed_gate.
FeedGate` rests it for whole passes when the misses it removes (against a shadow on-demand LRU
on the same accesses; ``rest_baseline``: less what resting itself saves against it) are
worth less than that cost. Where the CPU computes a miss it prices it, under ``feed_overlap``
(the default since issue 27's nineteenth stage), at the CPU's time less the GPU's own
compute of the expert, which the CPU's runs beside (the miss's marginal cost, not its whole
one: with hqq3 experts at a 100 GB/s CPU a one-token miss is 1.95 ms on the CPU against
1.05 ms on the GPU, and priced whole the gate fed the predictor where resting was 6.5 %
faster). Resting, the cache evicts the resident of least model-free
probability of use, the least recently used among equals (``rest_evict: prob``, the default
since issue 27's nineteenth stage; ``lru``: the least recently used). No feed cost, no
gate. Resting, it still takes the next layer's experts of highest model-free probability of
use (the gate's lookup of each expert's use at its layer's last rested runs, or its age
class if unused in them, in its store-frequency bucket, calibrated on the store split:
:func:`moeexp.cache.feed_gate.fit_rest_table`; ``rest_buckets``, ``rest_ages``; offered as HybriMoE's score-ranked prefetch is) as prefetches under the gate
below with that probability (``rest_prefetch``, the default; :meth:`rest_layer`), so a
rested policy is LRU plus the prefetches that pay on that estimate, not LRU alone (with
``rest_prefetch`` off, it is LRU exactly).

**Warm start** (``warm``): the store split's most used experts fill the cache before the
first request (as kTransformers pins them at start-up; preloaded, not counted as traffic).

**Fill** (``fill``, the default; issue 27's sixteenth stage): while a slot is free the predictor also
offers fills, the experts of every layer ahead likely used within the longest horizon that
this pass's offers left out, below every offer (:meth:`fills`); a prefetch into a free slot
evicts nothing, so the gate counts a use at a later run of its layer as a whole miss saved:
P min(m, w) + (W - P) m > (1 - W) x s (W: used within the longest horizon). It acts only
while the cache has room: a cold start, or a budget that holds what the run uses (the
paper testbed's six devices). Once the cache is full nothing differs from ``fill=false``.

**Under the artifact's ``demand_load=all_experts``** (:meth:`set_mechanics`; the replay and
the engine tell it) every expert of a layer is touched, and copied if absent, each time the
layer runs, so the next use of ``(l, e)`` is exactly layer l's next run: ``E = Δ_l`` for all
experts (Belady's rule on that stream), and a prefetch for a layer ahead cannot be wasted
(its copy replaces a demand load the pass makes anyway): the gate then takes every offer
whose victim's next run comes later (the first condition alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.cache.belady import PrefetchRefused
from moeexp.cache.feed_gate import FeedGate, fit_rest_table, store_buckets
from moeexp.errors import ConfigError
from moeexp.traces.schema import Trace

P_MIN = 1e-3  #: floor of a probability before 1 / P
R_CAP = 16.0  #: most passes of residence a CPU-execution prefetch is credited with (module doc)
NEED_DECAY = 0.8  #: per-layer decay of the average of copies per layer (saturation)
#: ``saturation_counts`` values: every copy the link makes, or the copies a layer needed
SATURATION_COUNTS = ("all", "needed")
#: ``saturation_model`` values: the spill where every miss is a copy and the load where the CPU
#: may compute one, the link's load over the window, or the share of one more copy that
#: spills past it (module doc, Prefetch gate)
SATURATION_MODELS = ("by_execution", "load", "overflow")
FREE_MISS_S = 1e-9  #: the feed gate's m where a miss costs nothing beyond the GPU's work (s)


@CACHES.register("next_use")
class NextUseCache(CachePolicy):
    """Approximate Belady on predicted next use, with the cost-aware prefetch gate.

    Args:
        capacity_slots, num_layers, num_experts: as every policy.
        gate: False: take every prefetch that has a victim of later expected use (no cost
            rule; the ablation row of the gate).
        feed_gate: rest the predictor for whole passes where feeding it costs more than
            it saves (:meth:`set_feed_cost`; nothing happens without a feed cost); False:
            always fed (the ablation row of the feed gate).
        victim_horizon: the gate's victim term counts the victim's use within the horizon
            in use (module doc, Prefetch gate; issue 27's twelfth stage, measured and left
            off: ``experiments/regime_map/README.md``); False (default): at its layer's next
            run only.
        warm: load the store split's most used experts before the first request
            (:meth:`initial_residents`: the ``capacity_slots`` of highest popularity P,
            as kTransformers pins them); False: start empty (as LRU). Made for one
            device (the CPU systems'); with several, each device starts with those of the
            top ``capacity_slots`` it holds, not with its own budget's worth.
        rest_prefetch: while the feed gate rests the predictor, take the next layer's
            experts of highest model-free probability as prefetches where they pay (module
            doc, Whether to run the predictor at all); False: a resting policy is on-demand
            LRU exactly (the eleventh to sixteenth stages).
        fill: while a slot is free, ask the predictor for fills too (:meth:`fills`: experts
            likely used within a few passes, not only in this one; module doc, Fill; the
            default); False: this pass's offers alone.
        rest_buckets: the resting probability's store-frequency buckets (B of
            :func:`~moeexp.cache.feed_gate.fit_rest_table`); 4 (the default since issue 27's
            nineteenth stage, with ``rest_ages: 8`` and ``rest_evict: prob``); 1: one table
            for every expert (the seventeenth and eighteenth stages' default).
        rest_ages: the resting probability's age classes for experts idle for the table's
            whole pattern (A of :func:`~moeexp.cache.feed_gate.fit_rest_table`; feed_gate
            module doc, Age classes); 8 (the default); 0: none (the eighteenth stage's
            buckets without them were behind at 50 % of the real CPU map).
        rest_evict: the resting cache's victim: ``prob`` (the least resting probability, LRU
            among equals; the default) or ``lru`` (the least recently used; the default
            before the nineteenth stage). Either way, with ``rest_prefetch`` off a resting
            cache is LRU.
        feed_overlap: the feed gate prices a miss the CPU computes at its cost less the GPU
            time it takes off the GPU's chain (the GPU's own compute of the expert, which
            the CPU's runs beside; ``relief_s`` of :meth:`set_miss_cost`; the default since
            issue 27's nineteenth stage); False: at its whole cost, as the prefetch gate does.
        rest_baseline: the feed gate weighs a fed window's saving beyond what resting with
            offers saves (g; :class:`~moeexp.cache.feed_gate.FeedGate` ``rest_baseline``), not
            against on-demand LRU (issue 27's eighteenth stage: measured, and left off: it
            rested the predictor where feeding it paid).
        rest_within_pass: under ``rest_evict: prob``, in a rested pass of several tokens (a
            prefill) a resident of a layer the pass has still to run weighs its use within
            the pass, so the layers behind are evicted first, where a miss is a copy (not
            where the execution computes it on the CPU for less: feed_gate module doc, A
            pass of many tokens; the default since issue 27's twentieth stage); False: its
            resting probability per run, as in a one-token pass.
        saturation_counts: which copies the link's saturation s counts (module doc,
            Prefetch gate): ``all`` (the default since issue 27's twenty-first stage): the
            demand loads and every prefetch started, used or not; ``needed``: the demand
            loads and the used prefetches (the policy before it).
        saturation_model: how s follows from n (module doc, Prefetch gate): ``load``
            s = min(1, n x / w), the link's busy share of a layer's compute window;
            ``overflow``: the share of one more copy that spills past the window, clip(n + 1
            - w / x, 0, 1); ``by_execution`` (the default since issue 27's twenty-second
            stage): ``overflow`` where every miss is a copy, ``load`` where the CPU may
            compute a miss (:meth:`set_miss_cost`: no demand load then waits on the link).
        balance: where a layer's resident experts' compute hides its demand copies
            (:meth:`hidden_layers`), evict from such layers first and take no prefetch into
            one (module doc, Balance; issue 27's twenty-fifth stage, the default); False:
            Belady's rule on E alone, whatever the layer's compute hides (the policy
            before it).
    """

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int,
                 gate: bool = True, warm: bool = False, feed_gate: bool = True,
                 victim_horizon: bool = False, fill: bool = True,
                 rest_prefetch: bool = True, rest_buckets: int = 4,
                 rest_evict: str = "prob", rest_baseline: bool = False,
                 rest_ages: int = 8, feed_overlap: bool = True,
                 rest_within_pass: bool = True, saturation_counts: str = "all",
                 saturation_model: str = "by_execution", balance: bool = True) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        for key, val in (("gate", gate), ("warm", warm), ("feed_gate", feed_gate),
                         ("victim_horizon", victim_horizon), ("fill", fill),
                         ("rest_prefetch", rest_prefetch), ("rest_baseline", rest_baseline),
                         ("feed_overlap", feed_overlap),
                         ("rest_within_pass", rest_within_pass), ("balance", balance)):
            if not isinstance(val, bool):
                raise ConfigError(f"next_use: {key} must be true or false, got {val!r}")
        self.gate, self.warm, self.use_feed_gate = gate, warm, feed_gate
        self.victim_horizon, self.fill, self.rest_prefetch = victim_horizon, fill, rest_prefetch
        if isinstance(rest_buckets, bool) or not isinstance(rest_buckets, int) or rest_buckets < 1:
            raise ConfigError(f"next_use: rest_buckets must be an integer >= 1, got "
                              f"{rest_buckets!r}")
        if saturation_counts not in SATURATION_COUNTS:
            raise ConfigError(f"next_use: saturation_counts must be one of "
                              f"{SATURATION_COUNTS}, got {saturation_counts!r}")
        self.count_all = saturation_counts == "all"
        if saturation_model not in SATURATION_MODELS:
            raise ConfigError(f"next_use: saturation_model must be one of "
                              f"{SATURATION_MODELS}, got {saturation_model!r}")
        self.saturation_model = saturation_model
        if rest_evict not in ("lru", "prob"):
            raise ConfigError(f"next_use: rest_evict must be 'lru' or 'prob', got "
                              f"{rest_evict!r}")
        if isinstance(rest_ages, bool) or not isinstance(rest_ages, int) or rest_ages < 0:
            raise ConfigError(f"next_use: rest_ages must be an integer >= 0, got "
                              f"{rest_ages!r}")
        self.rest_buckets, self.rest_evict, self.rest_ages = rest_buckets, rest_evict, rest_ages
        self.rest_baseline = rest_baseline
        self.feed_overlap = feed_overlap
        self.rest_within_pass = rest_within_pass
        self.balance = balance
        self.expert_s: float | None = None  # set_link: one used expert's compute (s)
        self._fitted = False
        self.miss_s: float | None = None  # set_miss_cost; None: a miss is a copy
        self.miss_relief_s = 0.0  # set_miss_cost: GPU time a CPU-computed miss takes off
        self.late_capped = False  # set_miss_cost: a late copy's wait is at most miss_s
        # float64[L, J]; written through fit and observe_scores only (they reset _psum)
        self.P = np.full((num_layers, num_experts), 0.5)
        self._psum: np.ndarray | None = None  # float64[L]: P's row sums, when hidden_layers asks
        self._pmax = 0.0  # their largest, with them
        # hidden_layers' memo: the state version (bumped by every change of P, the resident
        # set or the link), the version it was computed at, its result and shield
        self._ver, self._hid_at = 0, -1
        self._hid: np.ndarray | None = None
        self._shield: np.ndarray | None = None
        self.Q = self.P.copy()  # float64[L, J], per pass after the next run (module doc)
        self._later: set[int] = set()  # layers whose Q came with the coming scores
        self.cur = 0  # layer of the latest access
        self._pref: set[Key] = set()  # prefetched, not used yet
        self._count = 0  # copies of the running layer so far (saturation_counts)
        self.need = 0.0  # average copies per layer (saturation_counts)
        self.copy_s: float | None = None
        self.window_s: float | None = None
        self.refused = 0
        self.touch_all = False  # demand_load=all_experts (set_mechanics)
        self._E: np.ndarray | None = None  # expected_next_use, until P or cur changes
        self.horizons: tuple[int, ...] = ()  # set_horizons; () : the next pass alone
        self.W: np.ndarray | None = None  # float64[H, L, J], P(used within h runs)
        self.h = 1  # the horizon in use (module doc), fixed at each layer change
        self._bounds: list[tuple[int, float]] = []  # (h, upper bound of its target)
        self._copies = 0  # copies since the start (demand and prefetch)
        self._steps = 0  # layer changes since the start
        self.feed_gate: FeedGate | None = None  # set_feed_cost > 0
        self._store: Trace | None = None  # fit's store split

    # ---- learning and cost ----------------------------------------------------------
    def fit(self, store: Trace) -> None:
        """P before any score: each expert's share of the store split's single-token passes
        (store split only: a request of another split raises ConfigError)."""
        bad = [r.request_id for r in store.requests if r.split != "store"]
        if bad:
            raise ConfigError(f"next_use: fit() got {len(bad)} request(s) outside the store "
                              f"split (e.g. {bad[:3]}): pass trace.split('store')")
        L, J = self.num_layers, self.num_experts
        sizes = np.diff(store.iter_offsets)
        rows = np.repeat(sizes == 1, sizes)  # tokens of single-token passes
        idx = store.topk_idx[rows].astype(np.int64)  # [N, L, K]
        n = int(idx.shape[0])
        flat = (np.arange(L)[None, :, None] * J + idx).reshape(-1)
        counts = np.bincount(flat, minlength=L * J).reshape(L, J)
        self.P = (counts + 1.0) / (n + 2.0)
        self._psum = None
        self._ver += 1
        self.Q = self.P.copy()
        self._fitted = True
        self._store = store  # the feed gate's resting table is fitted on it (set_feed_cost)
        if self.horizons:
            self.set_horizons(self.horizons)

    def set_link(self, *, copy_s: float, window_s: float | None,
                 expert_s: float | None = None) -> None:
        """Seconds of one expert copy and of one layer's compute in the running pass
        (None: not known yet; the copy time stands in); ``expert_s``: seconds of one used
        expert's compute in that pass (its layer's expert compute over its used experts;
        None: not known, and :meth:`hidden_layers` finds none)."""
        if not copy_s > 0:
            raise ConfigError(f"next_use: copy_s must be > 0, got {copy_s}")
        if expert_s is not None and not (expert_s >= 0 and math.isfinite(expert_s)):
            raise ConfigError(f"next_use: expert_s must be a finite number >= 0 s, got "
                              f"{expert_s}")
        self.copy_s, self.window_s = float(copy_s), window_s
        self.expert_s = None if expert_s is None else float(expert_s)
        self._E = None  # the saturation, hence Q, may change
        self._ver += 1

    def set_mechanics(self, *, demand_load: str) -> None:
        """The replay's demand loading (:mod:`moeexp.simulator.mechanics`): ``activated``
        (the router's experts; the default) or ``all_experts`` (every expert of a layer is
        touched each pass: next use is the layer's next run, module docstring)."""
        if demand_load not in ("activated", "all_experts"):
            raise ConfigError(f"next_use: demand_load must be 'activated' or 'all_experts', "
                              f"got {demand_load!r}")
        self.touch_all = demand_load == "all_experts"
        self._E = None

    def set_miss_cost(self, seconds: float, *, late_to_cpu: bool = False,
                      relief_s: float = 0.0) -> None:
        """What a decode miss costs where the CPU may compute it (module doc, Prefetch gate):
        the stall a prefetch can hide and a wasted victim's reload, instead of a copy;
        ``late_to_cpu``: a late copy's wait is at most that miss (the CPU takes it);
        ``relief_s``: the GPU time such a miss takes off the GPU's chain, which the feed
        gate subtracts under ``feed_overlap`` (module doc, Whether to run the predictor)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(f"next_use: a miss's cost must be a finite number > 0 s, got "
                              f"{seconds}")
        if not (relief_s >= 0 and math.isfinite(relief_s)):
            raise ConfigError(f"next_use: a miss's GPU relief must be a finite number >= 0 s, "
                              f"got {relief_s}")
        self.miss_s = float(seconds)
        self.late_capped = bool(late_to_cpu)
        self.miss_relief_s = float(relief_s)

    def set_feed_cost(self, seconds: float) -> None:
        """Host seconds per MoE layer of feeding the predictor (module doc, Whether to run
        the predictor at all): > 0 makes the :class:`~moeexp.cache.feed_gate.FeedGate`
        (after :meth:`fit` and :meth:`set_link`); 0 removes it."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ConfigError(f"next_use: a feed cost must be a finite number >= 0 s, got "
                              f"{seconds}")
        if seconds == 0 or not self.use_feed_gate:
            self.feed_gate = None
            return
        if self.copy_s is None:
            raise ConfigError("next_use: set_feed_cost() needs the copy time first "
                              "(set_link, from the predictor's bind)")
        table = bucket = None
        if self.rest_prefetch and self._store is not None:
            bucket = store_buckets(self.P, self.rest_buckets)  # P: the store's use shares
            table = fit_rest_table(self._store, bucket, self.rest_ages)
        gate = FeedGate(capacity_slots=self.capacity_slots, num_layers=self.num_layers,
                        num_experts=self.num_experts, feed_s=seconds, miss_s=self._feed_miss(),
                        initial=self.initial_residents(), rest_table=table,
                        rest_baseline=self.rest_prefetch and self.rest_baseline,
                        rest_bucket=bucket, rest_ages=self.rest_ages)
        # made while the cache runs: its residents, in an order it knows none of (as if
        # never used: lowest expert first); later inserts and uses order them
        gate.order.update((k, None) for k in sorted(self.resident))
        self.feed_gate = gate

    def _miss(self) -> float:
        """m: what a miss costs (the copy, or the CPU's computing it where cheaper)."""
        assert self.copy_s is not None
        return self.copy_s if self.miss_s is None else min(self.copy_s, self.miss_s)

    def _feed_miss(self) -> float:
        """The feed gate's m: :meth:`_miss`, less (under ``feed_overlap``, where the CPU
        computes a miss) the GPU time the miss takes off the GPU's chain, as the CPU's
        computation runs beside the GPU's hits; at least :data:`FREE_MISS_S`."""
        m = self._miss()
        if self.feed_overlap and self._cpu_cheaper():
            return max(FREE_MISS_S, m - self.miss_relief_s)
        return m

    def feeding(self, tokens: int = 1) -> bool:
        """Whether the pass that begins, of ``tokens`` token rows, is handed to the
        predictor (always without a feed cost); asked once per pass, by the predictor's
        :meth:`~moeexp.predictors.base.Predictor.feeding`."""
        gate = self.feed_gate
        if gate is None:
            return True
        gate.miss_s = self._feed_miss()  # set_miss_cost may come after set_feed_cost
        return gate.pass_begins(tokens)

    def initial_residents(self) -> list[Key]:
        """With ``warm``: the ``capacity_slots`` experts of highest store popularity P, most
        used first (ties: lower layer, then lower expert); else none."""
        if not self.warm:
            return []
        if not self._fitted:
            raise ConfigError("next_use: warm=true needs fit() on the store split first")
        order = np.argsort(-self.P, axis=None, kind="stable")[:self.capacity_slots]
        J = self.num_experts
        return [(int(i) // J, int(i) % J) for i in order]

    def set_horizons(self, horizons: tuple[int, ...]) -> None:
        """The horizons (passes, each >= 2, ascending) whose within-h probabilities the
        predictor will hand (:meth:`observe_within`); until it does, 1 - (1 - P)^h."""
        hs = tuple(int(h) for h in horizons)
        if not hs or any(h < 2 for h in hs) or list(hs) != sorted(set(hs)):
            raise ConfigError(f"next_use: horizons must be ascending distinct ints >= 2, got "
                              f"{horizons!r}")
        self.horizons = hs
        cands = (1, *hs)  # _pick_horizon: log-scale midpoints between neighbours
        self._bounds = [(h, math.sqrt(h * g)) for h, g in zip(cands[:-1], cands[1:], strict=True)]
        self.W = np.stack([1.0 - (1.0 - self.P) ** h for h in hs])
        self._E = None

    # ---- events ---------------------------------------------------------------------
    def observe_within(self, rows: dict[int, np.ndarray]) -> None:
        """W rows (layer -> float[H, J]): P(used within the next h runs of the layer) for
        each of :attr:`horizons` (module doc, Horizon)."""
        W = self.W
        if W is None:
            raise ConfigError("next_use: observe_within() before set_horizons()")
        for layer, row in rows.items():
            W[:, layer] = row
        self._E = None

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        P, Q, later = self.P, self.Q, self._later
        for layer, row in scores.items():
            P[layer] = row
            if layer in later:
                later.discard(layer)
            else:
                Q[layer] = row
        self._E = None
        self._psum = None
        self._ver += 1

    def observe_later(self, rows: dict[int, np.ndarray]) -> None:
        """Q rows (layer -> float[J]): the per-pass probability of use after the layer's
        next run, for layers whose P comes with the prediction about to be handed over
        (:meth:`observe_scores`, which then keeps these Q instead of copying P)."""
        for layer, row in rows.items():
            self.Q[layer] = row
            self._later.add(layer)
        self._E = None

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        super().on_insert(key, now, prefetched)
        self._ver += 1
        if self.feed_gate is not None:
            self.feed_gate.insert(key)
        self._copies += 1
        if prefetched:
            self._pref.add(key)
            if self.count_all:  # the link makes it, used or not (saturation_counts)
                self._count += 1

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        if self.feed_gate is not None:
            self.feed_gate.access(key, hit)
        if key[0] != self.cur:  # a new layer: close the last one's count
            self.need = NEED_DECAY * self.need + (1.0 - NEED_DECAY) * self._count
            self._count, self.cur, self._E = 0, key[0], None
            self._steps += 1
            if self.horizons:
                self.h = self._pick_horizon()
        if key in self._pref:  # a prefetched copy's first use
            self._pref.discard(key)
            if not self.count_all:  # needed: counted at its use
                self._count += 1
        elif not hit:  # a demand load
            self._count += 1

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._ver += 1
        self._pref.discard(key)
        if self.feed_gate is not None:
            self.feed_gate.evict(key)

    # ---- decisions ------------------------------------------------------------------
    def expected_next_use(self) -> np.ndarray:
        """float64[L, J]: E, layer steps to each expert's expected next use (kept until the
        scores or the current layer change; read it, never write it)."""
        if self._E is None:
            L = self.num_layers
            delta = (np.arange(L) - self.cur - 1) % L + 1.0
            if self.touch_all:  # every expert is touched at its layer's next run
                self._E = np.repeat(delta[:, None], self.num_experts, axis=1)
                return self._E
            s = self.saturation()
            if self.h > 1 and self.W is not None:
                h = self.h
                q = 1.0 - (1.0 - self.W[self.horizons.index(h)]) ** (1.0 / h)
                q = np.maximum(self.P + s * (q - self.P), P_MIN)
                self._E = delta[:, None] + L * (1.0 - q) / q
                return self._E
            P = np.maximum(self.P, P_MIN)
            if s == 0.0:
                Q = P
            elif s == 1.0:
                Q = np.maximum(self.Q, P_MIN)
            else:
                Q = np.maximum(self.P + s * (self.Q - self.P), P_MIN)
            self._E = delta[:, None] + L * (1.0 - P) / Q
        return self._E

    def _residence(self) -> float:
        """Passes an expert stays: capacity / (copies per pass since the start); inf before
        any copy."""
        if self._copies == 0:
            return math.inf
        return self.capacity_slots * self._steps / (self.num_layers * self._copies)

    def residence(self) -> float:
        """R of the CPU gate (module doc): :meth:`_residence`, at most :data:`R_CAP`."""
        return min(R_CAP, self._residence())

    def _pick_horizon(self) -> int:
        """h of {1} + :attr:`horizons` nearest in log scale to R / 2, R = capacity /
        (copies per pass) in passes (module doc); 1 until a pass has run."""
        if self._steps < self.num_layers or self._copies == 0:
            return 1
        target = self._residence() / 2.0
        for h, bound in self._bounds:  # nearest in log scale: below the geometric midpoint
            if target < bound:
                return h
        return self.horizons[-1]

    def saturation(self) -> float:
        """s, the link's saturation (module doc, Prefetch gate): ``load``: min(1, n x / w);
        ``overflow``: clip(n + 1 - w / x, 0, 1); ``by_execution``: ``overflow`` while every
        miss is a copy, ``load`` once :meth:`set_miss_cost` says the CPU may compute one; 1
        without a cost model."""
        if self.copy_s is None:
            return 1.0
        x = self.copy_s
        w = self.window_s if self.window_s else x
        if self.saturation_model == "overflow" or (
                self.saturation_model == "by_execution" and self.miss_s is None):
            return min(1.0, max(0.0, self.need + 1.0 - w / x))
        return min(1.0, self.need * x / w)

    def hidden_layers(self) -> np.ndarray | None:
        """bool[L]: the layers whose next run is expected to hide one more whole demand copy
        behind its hits' compute (module doc, Balance): ``H_l - D_l >= x + c``, with c the
        compute of one used expert in the running pass (``expert_s`` of :meth:`set_link`),
        ``H_l = c sum(P[l, e], e resident)`` the hits' compute, which runs while the first
        demand copies come in, and ``D_l = x sum(P[l, e], e absent)`` the demand chain.
        None where the rule does not apply or no layer is hidden: ``balance`` off, no
        expert compute known yet, a CPU that may compute a miss (:meth:`set_miss_cost`),
        every expert touched (``all_experts``), or a resting predictor."""
        if (not self.balance or self.expert_s is None or self.copy_s is None
                or self.miss_s is not None or self.touch_all):
            return None
        gate = self.feed_gate
        if gate is not None and not gate.fed:
            return None
        if self._hid_at == self._ver:  # nothing it reads changed since
            return self._hid
        self._hid_at, self._hid, self._shield = self._ver, None, None
        psum = self._psum
        if psum is None:
            psum = self._psum = self.P.sum(axis=1)
            self._pmax = float(psum.max())
        x, c = self.copy_s, self.expert_s
        if c * self._pmax < x + c:  # no layer can be (its resident use is at most its sum)
            return None
        on = np.where(self.resident_mask, self.P, 0.0).sum(axis=1)  # resident use, float[L]
        hidden = c * on - x * (psum - on) >= x + c
        if hidden.any():
            self._hid = hidden
        return self._hid

    def _hidden_shield(self, hidden: np.ndarray) -> np.ndarray:
        """float[L, J] for :meth:`lowest_priority`'s ``shielded``: +inf outside the resident
        set and in every layer not ``hidden`` (:meth:`hidden_layers`' result, memoised with
        it)."""
        if self._shield is None:
            self._shield = self._absent + np.where(hidden, 0.0, np.inf)[:, None]
        return self._shield

    def takes_every_offer(self) -> bool:
        """True under ``demand_load=all_experts``: every expert of a layer
        is copied when the layer runs, so a prefetch for a layer ahead replaces one of those
        copies and cannot be wasted (module docstring); the predictor then offers them all
        (:meth:`moeexp.predictors.reuse_prob.ReuseProbability._floor`)."""
        return self.touch_all

    def fills(self) -> bool:
        """With ``fill``: True while a slot is free. A prefetch into a free slot evicts
        nothing, so the chance it pays is that of a use before the cache is full and evicts
        it, not this pass's alone: the predictor then also offers experts likely used within
        a few passes (:meth:`moeexp.predictors.reuse_prob.ReuseProbability._fills`)."""
        return self.fill and len(self.resident) < self.capacity_slots

    def min_paying_prob(self) -> float:
        """The least P_k for which a prefetch can pass the gate with a free victim (the
        predictor need not offer less probable ones): P_k min(m, w) > (1 - P_k) x s. Under a
        CPU execution this is the floor of the copy rule's use term, not of the CPU gate
        (whose residence term could take a less probable offer): a bound on the offers, as
        the eighth stage was measured with."""
        if not self.gate or self.copy_s is None or self.touch_all:
            return 0.0
        x = self.copy_s
        w = self.window_s if self.window_s else x
        m = self._miss()
        waste = x * self.saturation()
        return waste / (min(m, w) + waste)

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        prefetch = incoming not in protected
        gate = self.feed_gate
        if gate is not None and not gate.fed:  # the predictor rests: LRU (+ rest offers)
            if prefetch and not self.rest_prefetch:
                self.refused += 1
                raise PrefetchRefused("%s: the predictor rests; no prefetch of %s", self.name,
                                      incoming)
            v = None
            if not self.has_room(incoming):
                v = self._rest_victim(gate, lambda k: k not in protected)
                if v is None:
                    raise ConfigError(f"{self.name}: no evictable expert for {incoming} "
                                      f"(capacity {self.capacity_slots} slots, "
                                      f"{len(protected)} protected)")
            if prefetch and not self._rest_pays(incoming, v):
                self.refused += 1
                raise PrefetchRefused("%s: a resting offer of %s does not pay", self.name,
                                      incoming)
            return v
        if self.has_room(incoming):
            if prefetch and not self._pays(incoming, None, self.hidden_layers(),
                                           into_room=self.fill):
                self.refused += 1
                raise PrefetchRefused("%s: prefetching %s does not pay", self.name, incoming)
            return None
        E = self.expected_next_use()
        hidden = self.hidden_layers()
        if hidden is None:
            v = self.lowest_priority(incoming, protected, -E)
        else:  # the hidden layers' residents first (module doc, Balance)
            v = self.lowest_priority(incoming, protected, -E,
                                     shielded=self._hidden_shield(hidden))
        if prefetch and (E[v] <= E[incoming] or not self._pays(incoming, v, hidden)):
            self.refused += 1
            raise PrefetchRefused("%s: prefetching %s over %s does not pay", self.name,
                                  incoming, v)
        return v

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        gate = self.feed_gate
        if gate is not None and not gate.fed:  # resting: rest_evict's victim
            allowed = set(candidates)
            v = self._rest_victim(gate, allowed.__contains__)
            if v is None:
                raise ValueError("no candidate is resident")
            return v
        E = self.expected_next_use()
        hidden = self.hidden_layers()
        if hidden is not None:  # the hidden layers' candidates first (module doc, Balance)
            candidates = [k for k in candidates if hidden[k[0]]] or candidates
        return max(candidates, key=lambda k: (E[k], -k[0], -k[1]))

    def _rest_victim(self, gate: FeedGate, allowed: Callable[[Key], bool]) -> Key | None:
        """The resting cache's victim among residents ``allowed``: the least recently used,
        or (``rest_evict: prob``, with resting offers) the least resting probability, a
        resident of a layer ahead in a multi-token pass weighed by its use within the pass
        where ``rest_within_pass`` is on and a miss is a copy (module doc of
        :mod:`moeexp.cache.feed_gate`, A pass of many tokens)."""
        if self.rest_evict == "prob" and self.rest_prefetch:
            return gate.rest_victim(allowed, within_pass=self.rest_within_pass
                                    and not self._cpu_cheaper())
        return gate.lru(allowed)

    def _cpu_cheaper(self) -> bool:
        """The execution computes a miss on the CPU for less than a copy (a miss then need
        not come in at all)."""
        return (self.miss_s is not None and self.copy_s is not None
                and self.miss_s < self.copy_s)

    def rest_layer(self, layer: int, experts: np.ndarray, k: int) -> np.ndarray:
        """A rested pass's layer ``layer`` routed to ``experts`` (int[n]): int64[<= k], the
        experts of layer + 1 the resting policy offers, highest model-free probability first
        (the feed gate's :meth:`~moeexp.cache.feed_gate.FeedGate.rest_observe` and
        :meth:`~moeexp.cache.feed_gate.FeedGate.rest_offers`); none at the last layer, where
        the predictor is fed, without a feed gate or with ``rest_prefetch`` off."""
        gate = self.feed_gate
        if gate is None or gate.fed or not self.rest_prefetch:
            return np.zeros(0, dtype=np.int64)
        gate.rest_observe(layer, experts)
        if layer + 1 >= self.num_layers:
            return np.zeros(0, dtype=np.int64)
        return gate.rest_offers(layer + 1, k)

    def _rest_pays(self, k: Key, v: Key | None) -> bool:
        """The gate's rule for a resting offer: :meth:`_rule` with the feed gate's
        model-free resting probability as every probability (P = Q = P(h) for ``k`` and for
        its victim; :meth:`~moeexp.cache.feed_gate.FeedGate.rest_prob`). The CPU rule's
        credit for the later passes' uses applies only where the CPU computes a miss for
        less than a copy: where it is slower, every miss is copied anyway, so the offer
        only moves a copy earlier and the copy rule weighs it (a resting policy has no
        model of the later passes to set against that; at a 20 GB/s CPU the residence
        credit let through offers that cost 2.4 %: ``experiments/regime_map/README.md``,
        seventeenth stage)."""
        if not self.gate or self.copy_s is None or self.touch_all:
            return True
        gate = self.feed_gate
        assert gate is not None
        pk = gate.rest_prob(k)
        pv = gate.rest_prob(v) if v is not None else 0.0
        return self._rule(k, pk, pk, v, pv, pv, self.saturation(), cpu=self._cpu_cheaper())

    def _pays(self, k: Key, v: Key | None, hidden: np.ndarray | None = None,
              into_room: bool = False) -> bool:
        """The gate's second condition (module docstring); True without a cost model and
        under ``all_experts`` (a prefetch then replaces a copy the pass makes anyway).
        ``hidden`` (:meth:`hidden_layers`): a prefetch into a hidden layer saves nothing
        (its miss would be hidden) and is refused; a victim of one costs no miss (P_v = 0).
        ``into_room`` (``fill``, a free slot; copy rule): the copy also pays where the
        expert's first use comes at a later run of its layer, within the longest horizon
        (W >= P), as nothing evicts it before the cache is full: that use waits for no copy,
        so it saves a whole miss m, not the window: gain = P min(m, w) + (W - P) m
        - (1 - W) x s."""
        if not self.gate or self.copy_s is None or self.touch_all:
            return True
        if hidden is not None and hidden[k[0]]:
            return False
        x = self.copy_s
        w = self.window_s if self.window_s else x
        m = self._miss()  # what a miss costs
        pk = float(self.P[k])
        s = self.saturation()
        if into_room and self.miss_s is None and self.W is not None:
            later = max(0.0, float(self.W[-1, k[0], k[1]]) - pk)
            return pk * min(m, w) + later * m - (1.0 - pk - later) * x * s > 0.0
        qv = float(self.Q[v]) if v is not None else 0.0
        pv = self._victim_use(v, s) if v is not None else 0.0
        if hidden is not None and v is not None and hidden[v[0]]:
            pv = 0.0  # its miss would be hidden behind its layer's hits
        return self._rule(k, pk, float(self.Q[k]), v, qv, pv, s)

    def _rule(self, k: Key, pk: float, qk: float, v: Key | None, qv: float, pv: float,
              s: float, cpu: bool | None = None) -> bool:
        """The gate's second condition (module docstring, Prefetch gate) on given
        probabilities: ``pk``, ``qk`` the prefetch's use at its layer's next run and per
        pass after it, ``qv`` the victim's per pass, ``pv`` the victim's use while the
        prefetch holds its slot (0 without a victim), ``s`` the link's saturation;
        ``cpu``: the CPU rule (None: where the execution may compute a miss on the CPU)."""
        assert self.copy_s is not None
        x = self.copy_s
        w = self.window_s if self.window_s else x
        m = self._miss()  # what a miss costs
        if cpu is None:
            cpu = self.miss_s is not None
        if not cpu:
            gain = pk * min(m, w) - (1.0 - pk) * x * s
        else:  # the CPU computes a miss: the late landing and the residence count
            L = self.num_layers
            wait = max(0.0, x - ((k[0] - self.cur - 1) % L + 1) * w)
            if self.late_capped:  # the CPU computes a late copy's expert: at most a miss
                wait = min(wait, m)
            gain = (pk * (m - wait) + max(0.0, qk - qv) * self.residence() * m
                    - (1.0 - pk) * x * s)
        if v is not None:
            gain -= (1.0 - pk) * pv * m
        return gain > 0.0

    def _victim_use(self, v: Key, s: float) -> float:
        """P_v of the gate's victim term: the chance the victim is used while the prefetch
        holds its slot, as its reload costs a copy: with ``victim_horizon`` and a horizon
        h > 1 in use, P[v] + s (W_h[v] - P[v]) (W_h: used within its layer's next h runs,
        h from the cache's residence, module doc, Horizon; ``s`` the link's saturation, as
        the gate computed it: on a free link a later use is prefetched back in time, as Q
        weighs it); else P[v] (its layer's next run). Copy rule only (the CPU rule keeps
        P[v])."""
        p = float(self.P[v])
        if (self.victim_horizon and self.miss_s is None and self.h > 1
                and self.W is not None):
            return p + s * (float(self.W[self.horizons.index(self.h), v[0], v[1]]) - p)
        return p
