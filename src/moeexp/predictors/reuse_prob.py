"""``reuse_prob``: calibrated per-expert probabilities of use, for prefetch and for eviction.

The predictor half of the ``prefetch_if_pays`` system (algorithms.md §12). At every layer
l of a pass it (1) updates layer l's reuse state (:mod:`moeexp.predictors.reuse_features`)
and gives the cache, as ``scores[l]``, each expert's probability of being used at layer
l's next pass; (2) for the layers l + 1 .. l + D ahead, gives ``scores[l + d]``, each
expert's probability of being used there in this pass, and asks to prefetch the ones that
could pay (probability >= ``min_prob``, at most ``max_per_layer`` per layer; priority:
nearer layers first, then the more probable). Whether a prefetch pays is decided where
the victim is known: by the ``next_use`` cache, with the cost model this predictor hands it
(:meth:`bind`): copy time, and the compute window of each pass (the layer's dense part for
the pass's tokens and context, plus its experts' compute for the observed counts).

Every probability is a logistic regression fitted on the store split only
(:func:`moeexp.predictors.reuse_features.fit_models`); the layer-transition matrices and
the token-to-token follow matrices (the next-pass model's evidence of which expert follows
which at the next token) too. With
``spec: auto`` (the default) and a store split that records speculative gates, the models of
the layers ahead also read the gates' evidence from the running layer's hidden state (the
predictor then needs ``spec_probs``); on a routing-only trace they do without.

In the simulator, a one-token pass's trajectory kNN rows and their logit terms are made
for every layer at once (:meth:`preview_pass`), with the same numbers as layer by layer.

In a pass the ``next_use`` cache's feed gate rests it for (:meth:`feeding`), it is not fed,
and :meth:`rest_layer` passes on the cache's model-free next-layer offers (HybriMoE's
score-ranked prefetch, on the gate's model-free probabilities; decode passes only, as
HybriMoE's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    PREDICTORS,
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
    RequestStart,
    RestLayer,
)
from moeexp.predictors.layer_transition import transition_counts
from moeexp.predictors.lrb import LrbState, LrbTable, walk_rows
from moeexp.predictors.reuse_features import (
    FAST,
    HORIZONS,
    KNN_ROWS,
    MAX_HORIZON,
    REC_CAP,
    SLOW,
    Logistic,
    ReuseModels,
    ReuseState,
    carried,
    carried_steps,
    fit_models,
    next_features,
    sigmoid,
    spec_features,
)
from moeexp.traces.schema import Trace, TraceDims

#: ``next_model`` values
NEXT_MODELS = ("logistic", "logistic_no_follow", "logistic_no_recency", "lrb")


@dataclass
class _KnnPreview:
    """A one-token pass's trajectory kNN, every layer at once (:meth:`ReuseProbability.
    preview_pass`): ``obs`` the observations previewed; ``rows`` float64[L, H1, J] the kNN
    rows (:meth:`~moeexp.predictors.trajectory_index.TrajectoryIndex.observe` of each
    layer); and the kNN terms of the models' logits, each the product the per-layer code
    makes, for every layer: ``next`` float64[L, J] (``_next_p``), ``ahead`` float64[L, D,
    J] (``_ahead``, with ``knn_ahead``; row d of layer l: layer l + 1 + d) and ``within``
    float64[L, H, J] (``_within``, with the kNN's within shares); None where not read."""

    obs: Sequence[LayerObservation]
    rows: np.ndarray
    next: np.ndarray
    ahead: np.ndarray | None
    within: np.ndarray | None


@PREDICTORS.register("reuse_prob")
class ReuseProbability(Predictor):
    """Calibrated P(use) per expert: next pass (eviction) and D layers ahead (prefetch).

    Args:
        dims: trace dimensions.
        depth: D >= 1, layers ahead it predicts and may prefetch (config: the model's
            ``prefetch_distance``); a model of fewer layers caps it at L - 1.
        min_prob: the least probability worth offering the cache as a prefetch (the cache
            refuses the ones that do not pay; this only bounds the work).
        max_per_layer: most prefetches offered per layer ahead (0: J).
        alpha: Laplace smoothing of the transition counts.
        spec: ``auto``: the layers-ahead models also read the speculative gates when the
            store split records them (decided at :meth:`fit`); ``off``: never.
        next_model: the next-use score of a layer that ran, for eviction: ``logistic`` (the
            calibrated next-pass probability, recency and the store's token-to-token
            follow evidence among its features: :mod:`moeexp.predictors.reuse_features`),
            ``logistic_no_follow`` (the same without the follow evidence: issue 27's
            fourth and fifth stages), ``logistic_no_recency`` (without either: the second
            and third stages) or ``lrb`` (a learned reuse distance D,
            :mod:`moeexp.predictors.lrb`, handed over as the probability 1 / D).
        later: with a ``logistic`` next model, also hand the ``next_use`` cache, for each
            layer ahead in the pass, the next-pass probability its experts would have if
            this pass does not use them (the cache's Q: an in-pass "not now" is not a
            "never"); False: the cache extrapolates the in-pass probability (the shipped
            behaviour before issue 27's fourth stage).
        horizon: with a ``logistic`` next model, also fit P(used within the next h passes)
            for h in ``horizons`` and hand the ``next_use`` cache those rows
            (:meth:`_hand_within`), which ranks eviction by the horizon its own residence
            time picks (issue 27's seventh stage); False: the cache ranks by the next pass
            alone (the sixth stage).
        horizons: the h of those models (passes; ascending distinct ints in [2, 254]), by
            default :data:`~moeexp.predictors.reuse_features.HORIZONS`, (2, 4, 8, 16). The
            cache picks the one nearest half its residence time, so an h above 16 acts only
            where it holds an expert for more than ~45 passes (issue 27's twenty-third
            stage: at 50 % of the real map, R ~ 55 passes, (2, ..., 64) picks h = 32 and
            removes less of LRU's extra misses than 16 does; measured, left at the default).
        knn: with the ``logistic`` next model, its last feature is the trajectory kNN of
            :mod:`moeexp.predictors.trajectory_index` (what the store's next tokens used
            after the store tokens nearest to this token's routing so far; issue 27's
            thirteenth stage; on by default since the fifteenth); False: not read. It acts
            only with ``next_model="logistic"``. A decode pass of several requests has no kNN
            row and reads ``next`` and ``within`` models fitted without it.
        knn_within: with ``knn`` and ``horizon``, each ``within[h]`` model reads the kNN
            share of neighbours that used the expert within their next h tokens (the
            fourteenth stage); False: the next token's share, as the ``next`` model.
        knn_ahead: with ``knn``, the layer-ahead (prefetch) models also read the share of
            the same neighbours that used the expert at that layer of their own token
            (:meth:`~moeexp.predictors.trajectory_index.TrajectoryIndex.ahead`; the
            fourteenth stage; on by default since the fifteenth); False: not read. It acts
            only when ``knn`` does.
        knn_rows: the store decode tokens the kNN index keeps at most (a seeded sample
            beyond; default :data:`~moeexp.predictors.reuse_features.KNN_ROWS`, 8,192). A
            query's work grows with it. Issue 27's twenty-fourth stage: at 50 % of the real
            map, copy/compute 36, the whole store (45,373 tokens at seed 0, 5.5 times the
            default's) closes 0.422 of the gap between LRU and ``oracle_aggressive``
            against the default's 0.404 (TPOT -1.4 %) at 2.4 times the host time per
            decision; measured, left at the default.
    """

    def __init__(self, *, dims: TraceDims, depth: int = 2, min_prob: float = 0.05,
                 max_per_layer: int = 0, alpha: float = 1.0, spec: str = "auto",
                 next_model: str = "logistic", later: bool = True,
                 horizon: bool = True, knn: bool = True, knn_within: bool = True,
                 knn_ahead: bool = True, horizons: Sequence[int] = HORIZONS,
                 knn_rows: int = KNN_ROWS) -> None:
        super().__init__(dims=dims)
        L, J = dims.num_layers, dims.num_experts
        if int(depth) < 1:
            raise ConfigError(f"reuse_prob: depth must be >= 1 (layers ahead), got {depth}")
        if not 0.0 <= min_prob <= 1.0:
            raise ConfigError(f"reuse_prob: min_prob must be in [0, 1], got {min_prob}")
        if max_per_layer < 0 or alpha <= 0:
            raise ConfigError(f"reuse_prob: max_per_layer must be >= 0 and alpha > 0, got "
                              f"{max_per_layer}, {alpha}")
        if spec not in ("auto", "off"):
            raise ConfigError(f"reuse_prob: spec must be 'auto' or 'off', got {spec!r}")
        if next_model not in NEXT_MODELS:
            raise ConfigError(f"reuse_prob: next_model must be one of {NEXT_MODELS}, got "
                              f"{next_model!r}")
        for key, val in (("later", later), ("horizon", horizon), ("knn", knn),
                         ("knn_within", knn_within), ("knn_ahead", knn_ahead)):
            if not isinstance(val, bool):
                raise ConfigError(f"reuse_prob: {key} must be true or false, got {val!r}")
        hs = tuple(horizons) if isinstance(horizons, (list, tuple)) else ()
        if not hs or any(not isinstance(h, int) or isinstance(h, bool)
                         or not 2 <= h <= MAX_HORIZON for h in hs) \
                or list(hs) != sorted(set(hs)):
            raise ConfigError(f"reuse_prob: horizons must be a non-empty ascending list of "
                              f"distinct ints in [2, {MAX_HORIZON}] (passes), got {horizons!r}")
        if not isinstance(knn_rows, int) or isinstance(knn_rows, bool) or knn_rows < 1:
            raise ConfigError(f"reuse_prob: knn_rows must be an int >= 1 (store tokens the "
                              f"kNN index keeps), got {knn_rows!r}")
        self.knn_rows = knn_rows
        self.spec, self.next_model, self.later = spec, next_model, later
        self.horizon = horizon and next_model.startswith("logistic")
        self.horizons: tuple[int, ...] = hs
        # Each option acts only where the model it feeds exists, as ``horizon`` does: the
        # kNN column is a feature of the ``logistic`` next model (so ``next_model=lrb`` or
        # ``logistic_no_follow`` alone reproduces those stages), ``knn_ahead`` needs the
        # index ``knn`` builds, and ``knn_within`` acts only with ``knn`` and ``horizon``.
        self.knn = knn and next_model == "logistic"
        self.knn_within, self.knn_ahead = knn_within, knn_ahead and self.knn
        self._knn_rows = np.zeros((1, L, J))  # float64[H1, L, J]: the kNN rows, latest per layer
        self._lrb: LrbTable | None = None  # the learned reuse distance (next_model=lrb)
        self._lstate = LrbState.zeros(L, J)
        self.depth, self.min_prob, self.alpha = int(depth), float(min_prob), float(alpha)
        self.max_per_layer = int(max_per_layer) or J
        self.models: ReuseModels | None = None
        self._coef: dict[int, np.ndarray] = {}
        self._icpt: dict[int, np.ndarray] = {}
        self._from: list[np.ndarray] = [np.zeros((0, 0, 0))] * L
        self._reach = {0: 0, 1: 0}
        self._trans = np.zeros((0, 0, 0))
        self.state = ReuseState.zeros(L, J)
        self._caches: list[Any] = []
        self._cost: Any = None
        self._prompt_len: dict[int, int] = {}
        self._kind, self._dense_s, self._window_set = 0, 0.0, False
        self._query_ns = self._queries = 0
        self._qpass: np.ndarray | None = None  # float64[L, J], this pass's Q (_hand_later)
        self._wpass: np.ndarray | None = None  # float64[H, L, J], this pass's (_hand_within)
        self._wcoef = np.zeros((0, 0))  # float64[H, F]: the within models, stacked
        self._wicpt = np.zeros(0)  # float64[H]
        #: (next model, stacked within coefficients, intercepts, reads the kNN column) per
        #: pass: [0] a pass with a kNN row, [1] a decode pass of several requests (fit)
        self._evict: list[tuple[Logistic, np.ndarray, np.ndarray, bool]] = []
        self._ev = 0  # which of them this pass uses (start_iteration)
        self._fol: tuple[int, np.ndarray] | None = None  # (layer, follow column): _next_p
        self._feed_s = 0.0  # set_feed_cost: host seconds per layer fed
        self._pv: _KnnPreview | None = None  # preview_pass of a one-token pass with the kNN
        #: the layer whose kNN rows and terms come from the preview (-1: none): the logits'
        #: kNN terms are read from it at that layer (_next_p, _ahead, _within)
        self._pv_layer = -1

    # ---- learning ---------------------------------------------------------------------
    def fit(self, store: Trace) -> None:
        """Transitions and the calibrated models, from ``store`` (store split only:
        a request of another split raises ConfigError)."""
        C = transition_counts(store) + self.alpha
        trans = C / C.sum(axis=-1, keepdims=True)
        L = self.dims.num_layers
        m = fit_models(store, trans, min(self.depth, L - 1), use_spec=self.spec == "auto",
                       prefill_depth=L - 1, recency=self.next_model != "logistic_no_recency",
                       follow=self.next_model == "logistic", knn=self.knn,
                       horizons=self.horizons if self.horizon else (),
                       knn_within=self.knn_within, knn_ahead=self.knn_ahead,
                       knn_rows=self.knn_rows)
        if m.within:
            self._wcoef = np.array([m.within[h].coef for h in self.horizons])
            self._wicpt = np.array([m.within[h].intercept for h in self.horizons])
        self._evict = [(m.next, self._wcoef, self._wicpt, m.knn is not None)]
        if m.plain is not None:  # a batched decode pass: the models without the kNN column
            nxt, within = m.plain
            wcoef = np.array([within[h].coef for h in self.horizons]) if within else self._wcoef
            wicpt = np.array([within[h].intercept for h in self.horizons]) if within else self._wicpt
            self._evict.append((nxt, wcoef, wicpt, False))
        self.needs = frozenset({"spec_probs"}) if m.spec_depth else frozenset()  # type: ignore[misc]
        D = len(m.chains)
        # layers ahead per pass kind (0: one token, 1: more): a multi-token pass (prefill)
        # uses nearly every expert of every layer, so every layer ahead is worth predicting
        self._reach = {0: D, 1: max([D] + [d for k, d in m.ahead if k == 1])}
        self._trans = trans
        # per pass kind: coefficients float64[D_kind, F], intercepts [D_kind]
        for kind in (0, 1):
            fits = [m.ahead.get((kind, d)) or m.ahead[(0, d)]
                    for d in range(1, self._reach[kind] + 1)]
            self._coef[kind] = np.array([f.coef for f in fits]).reshape(len(fits), -1)
            self._icpt[kind] = np.array([f.intercept for f in fits])
        # per layer: the d-step chains out of it, float64[min(D, L-1-l), J, J]
        self._from = [np.stack([m.chains[d][layer] for d in range(min(D, L - 1 - layer))])
                      if layer < L - 1 else np.zeros((0, 0, 0)) for layer in range(L)]
        self.models = m
        if m.knn is not None:
            self._knn_rows = m.knn.prior.copy()
        self.state = ReuseState.zeros(L, self.dims.num_experts)
        if self.next_model == "lrb":
            X, _, dist, _ = walk_rows(store)
            self._lrb = LrbTable.fit(X, dist, m.logpop)
            self._lstate = LrbState.zeros(L, self.dims.num_experts)

    def bind(self, cost: Any, caches: Sequence[Any]) -> None:
        """The run's cost model (:class:`moeexp.costmodel.roofline.CostModel`) and cache
        policies: each policy with ``set_link`` (``next_use``) gets the copy time now and
        the compute window of every pass as it starts."""
        self._cost = cost
        self._caches = [c for c in caches if hasattr(c, "set_link")]
        for c in self._caches:
            c.set_link(copy_s=float(cost.copy_s), window_s=None)
            if len(self._wicpt):
                c.set_horizons(self.horizons)
        self.set_feed_cost(self._feed_s)

    def set_feed_cost(self, seconds: float) -> None:
        """Feeding this predictor costs ``seconds`` per MoE layer: the bound ``next_use``
        caches weigh resting it (:mod:`moeexp.cache.feed_gate`); callable before or after
        :meth:`bind`."""
        self._feed_s = float(seconds)
        for c in self._caches:
            if hasattr(c, "set_feed_cost"):
                c.set_feed_cost(self._feed_s)

    def feeding(self, tokens: int = 1) -> bool:
        """Whether the pass that begins (``tokens`` token rows, handed on to the caches) is
        fed: every bound ``next_use`` cache is asked (once each) and all must agree; always
        without a cache or a feed cost. Fed again after a rest, the reuse state first
        catches up on the rested passes' routing that the caches kept
        (:meth:`moeexp.cache.feed_gate.FeedGate.rested`)."""
        gates = [c for c in self._caches if hasattr(c, "feeding")]
        fed = all([c.feeding(tokens) for c in gates])
        if fed:
            kept = [g.feed_gate.rested() for g in gates if g.feed_gate is not None]
            for per_cache in zip(*kept, strict=False):  # one rested pass, every cache's keys
                used = np.logical_or.reduce(per_cache).astype(np.float64)
                self.state.update_all(used)
                if self._lrb is not None:
                    self._lstate.update_all(used)
            if kept and self.models is not None and self.models.knn is not None:
                self._knn_rows[:] = self.models.knn.prior  # stale after a rest
        return fed

    # ---- hooks ------------------------------------------------------------------------
    def rest_layer(self, obs: RestLayer) -> Prediction:
        """A rested pass's layer: every bound ``next_use`` cache folds the layer's routing
        into its model-free use patterns, and in a decode step (one token) this passes on the
        next layer's ``top_k`` experts of highest resting probability that they offer
        (:meth:`NextUseCache.rest_layer`), best first; no offer in a prefill (HybriMoE
        prefetches in decode only)."""
        k = self.dims.top_k
        nxt = obs.layer + 1
        seen: set[int] = set()
        out = Prediction()
        if obs.layer == 0 and obs.tokens == 1 and self._cost is not None:
            self._rest_window(obs.experts)
        for c in self._caches:
            if not hasattr(c, "rest_layer"):
                continue
            offers = c.rest_layer(obs.layer, obs.experts, k)
            if obs.tokens != 1:
                continue
            for i, e in enumerate(offers.tolist()):
                if e not in seen:
                    seen.add(e)
                    out.prefetch.append(Prefetch(1.0 - 1e-6 * i, nxt, e))
        return out

    def _rest_window(self, experts: np.ndarray) -> None:
        """A rested decode pass's compute window, once (its first layer), as a fed pass's
        (:meth:`observe_layer`): the dense part last priced (0 before any fed pass: a lower
        bound, so late landings are not underrated) plus one token on each routed expert;
        the bound caches' gate reads it (without it the copy time stands in, and a copy
        would seem to land within a layer)."""
        counts = np.zeros(self.dims.num_experts, dtype=np.int64)
        counts[experts] = 1
        self._hand_window(counts)

    def _hand_window(self, counts: np.ndarray) -> None:
        """Hand the bound caches the running pass's compute window (the dense part plus the
        experts' compute of a layer routed as ``counts``, int[J] tokens per expert) and one
        used expert's compute in it (their mean)."""
        experts = float(self._cost.experts_s(counts))
        used = max(1, int(np.count_nonzero(counts)))
        for c in self._caches:
            c.set_link(copy_s=float(self._cost.copy_s), window_s=self._dense_s + experts,
                       expert_s=experts / used)

    def start_request(self, ctx: RequestStart) -> Prediction:
        self._prompt_len[ctx.request.request_id] = int(ctx.request.prompt_len)
        return Prediction()

    def end_request(self, request_id: int) -> None:
        self._prompt_len.pop(request_id, None)

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        T = len(ctx.token_request)
        self._kind = int(T > 1)
        # a decode pass of several requests has no kNN row (the index holds one request's
        # trajectories) and no such row was fitted: the models without the column
        self._ev = int(len(ctx.request_ids) > 1 and len(self._evict) > 1)
        if self.models is not None and self.models.knn is not None:
            if T == 1:
                self.models.knn.begin()
            else:  # a prefill: no decode token's trajectory (the fit's prior)
                self._knn_rows[:] = self.models.knn.prior
        self._lstate.step = int(ctx.step)
        self._window_set = False
        self._pv, self._pv_layer = None, -1
        self._qpass = self._wpass = None  # once per pass (_hand_later, _hand_within)
        if self._cost is not None:
            prompt = sum(self._prompt_len.get(int(r), 0) for r in ctx.request_ids)
            if T > 1:  # prefill: T tokens attend to their prefix
                ctx_tok, kv = T * (T + 1) // 2, T
            else:
                ctx_tok = kv = prompt + int(ctx.step)
            self._dense_s = float(self._cost.dense_s(T, ctx_tok, kv))
        return self._opening()

    def _opening(self) -> Prediction:
        """At a pass's start: the first ``depth`` layers' offers, from their next-pass
        probabilities (no routing of this pass is known yet); the cache's gate uses the
        last pass's compute window."""
        if self.models is None:
            raise ConfigError("reuse_prob: start_iteration() before fit() (fit on the store split)")
        t0 = time.perf_counter_ns()
        n = min(self.depth, self.dims.num_layers)
        out = Prediction(prefetch=self._offers(-1, self._next_p(slice(0, n)), self._floor()))
        self._query_ns += time.perf_counter_ns() - t0
        return out

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        t0 = time.perf_counter_ns()
        if self.models is None:
            raise ConfigError("reuse_prob: observe_layer() before fit() (fit on the store split)")
        layer = obs.layer
        if self._caches and not self._window_set:  # the pass's compute window, once
            self._hand_window(obs.counts)
            self._window_set = True
        used = np.zeros(self.dims.num_experts)
        used[obs.experts] = 1.0
        self.state.update(layer, used)
        if self._kind == 0 and self.models.knn is not None:
            self._knn_rows[:, layer] = self._knn_observe(obs)
        if self._lrb is not None:
            self._lstate.update(layer, used)
            dist = self._lrb.lookup(self._lstate, layer)  # float64[J], passes
            scores = {layer: 1.0 / np.maximum(dist, 1.0)}
        else:
            scores = {layer: self._next_p(layer)}
        out = Prediction(scores=scores)
        counts = np.asarray(obs.counts, dtype=np.float64)
        n = min(self._reach[self._kind], self.dims.num_layers - 1 - layer)
        if n:
            if self._reach[self._kind] > len(self.models.chains):  # prefill, every layer ahead
                extra = carried_steps(counts, self._trans[layer:], n)
            else:
                extra = carried(counts, self._from[layer])  # [n, J]
            ka = None  # float64[n, J]: the neighbours' use of the layers ahead (knn_ahead)
            if self.knn_ahead and self._kind == 0 and self._pv_layer != layer:
                ka = self.models.knn.ahead(layer, n)  # type: ignore[union-attr]
            p = self._ahead(layer, n, extra, obs.spec_probs, ka)
            for d in range(n):
                scores[layer + 1 + d] = p[d]
            if self.later and self._lrb is None and self._caches:
                self._hand_later(layer, n)
            floor = self._floor()
            out.prefetch = self._offers(layer, p, floor)
        if len(self._wicpt) and self._caches:
            w = self._hand_within(layer, p if n else None)
            if w is not None and any(c.fills() for c in self._caches):
                out.prefetch += self._fills(layer, p, w[-1], floor)
        self._query_ns += time.perf_counter_ns() - t0
        self._queries += 1
        return out

    previews = True  # preview_pass batches a one-token pass's kNN queries

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """Speed hook (:meth:`Predictor.preview_pass`): in a one-token pass with the kNN,
        every layer's trajectory kNN rows and ahead rows at once
        (:meth:`~moeexp.predictors.trajectory_index.TrajectoryIndex.token_rows`, bit-identical
        to the per-layer queries), which :meth:`observe_layer` reads for the observations
        previewed (:meth:`_knn_observe`); nothing otherwise."""
        self._pv, self._pv_layer = None, -1
        knn = None if self.models is None else self.models.knn
        if knn is None or self._kind != 0 or len(obs) != self.dims.num_layers \
                or len({len(o.experts) for o in obs}) != 1:
            return
        t0 = time.perf_counter_ns()  # counted in query_us_mean, as the per-layer queries were
        D = self._reach[0]
        rows, ahead = knn.token_rows(np.array([o.experts for o in obs], dtype=np.int64), D)
        nxt, wcoef, _, _ = self._evict[self._ev]
        self._pv = _KnnPreview(
            obs, rows, nxt.coef[-1] * rows[:, 0],
            self._coef[0][:D, -1, None] * ahead if self.knn_ahead else None,
            wcoef[:, -1, None] * (rows[:, 1:] - rows[:, :1])
            if rows.shape[1] > 1 and len(wcoef) else None)
        self._query_ns += time.perf_counter_ns() - t0

    def _knn_observe(self, obs: LayerObservation) -> np.ndarray:
        """float64[H1, J]: the kNN rows of ``obs``'s layer in a one-token pass: the preview's
        where ``obs`` is the observation previewed, else the index's query (the index first
        catching up on the layers the preview served, as its per-layer state needs them)."""
        knn, pv, layer = self.models.knn, self._pv, obs.layer  # type: ignore[union-attr]
        assert knn is not None
        if pv is not None:
            if pv.obs[layer] is obs:
                self._pv_layer = layer
                return pv.rows[layer]
            self._pv = None  # not what was previewed: the index answers from here on
            knn.begin()
            for o in pv.obs[:layer]:
                knn.observe(o.layer, np.asarray(o.experts))
        self._pv_layer = -1
        return knn.observe(layer, np.asarray(obs.experts))

    def _ahead(self, layer: int, n: int, extra: np.ndarray,
               spec: np.ndarray | None = None, ka: np.ndarray | None = None) -> np.ndarray:
        """float64[n, J]: P(used at layer + d in this pass), d = 1..n: ``extra`` float64[n,
        J], layer's token distribution carried d layers (:func:`carried`); ``spec``
        float32[T, D, J], the layer's speculative gates (read when the models have them);
        ``ka`` float64[n, J], the kNN column (``knn_ahead``; None: the index's popularity,
        as a multi-token pass's fit read)."""
        coef, icpt = self._coef[self._kind], self._icpt[self._kind]
        rows = slice(layer + 1, layer + 1 + n)
        feat = self.state.feat
        z = coef[:n, 0, None] * feat[0, rows]
        z += coef[:n, 1, None] * feat[1, rows]
        z += coef[:n, 2, None] * feat[2, rows]
        z += coef[:n, 3, None] * self.models.logpop[rows]  # type: ignore[union-attr]
        z += coef[:n, 4, None] * extra
        z += icpt[:n, None]
        m = min(n, self.models.spec_depth)  # type: ignore[union-attr]
        if m and spec is not None:
            sf = spec_features(spec[:, :m], self.dims.top_k)  # [m, J, 2]
            z[:m] += coef[:m, 5, None] * sf[..., 0] + coef[:m, 6, None] * sf[..., 1]
        if self.knn_ahead:  # the last feature
            if self._pv_layer == layer:  # previewed: the same products, made for the pass
                z += self._pv.ahead[layer, :n]  # type: ignore[union-attr,index]
            else:
                z += coef[:n, -1, None] * (ka if ka is not None
                                           else self.models.knn.use[rows])  # type: ignore[union-attr]
        return sigmoid(z)

    def _next_p(self, rows: slice | int, unused: bool = False) -> np.ndarray:
        """float64[..., J]: the next-pass probability of layers ``rows`` (``unused``: if
        their coming pass leaves the experts unused); the product of
        :func:`moeexp.predictors.reuse_features.next_features` with the coefficients,
        written out (this runs at every layer)."""
        m = self.models
        assert m is not None
        nxt, _, _, knn = self._evict[self._ev]
        c, f = nxt.coef, self.state.feat
        if unused:
            z = (c[1] * FAST) * f[1, rows] + (c[2] * SLOW) * f[2, rows]
            rec = np.minimum(self.state.rec[rows] + 1.0, REC_CAP)
        else:
            z = c[0] * f[0, rows] + c[1] * f[1, rows] + c[2] * f[2, rows]
            rec = self.state.rec[rows]
        z += c[3] * m.logpop[rows] + nxt.intercept
        if len(c) >= 5:
            z += c[4] * np.log(rec)
        if knn:  # the last coefficient (the follow one before it)
            if rows == self._pv_layer and not unused:  # previewed: the same product
                z += self._pv.next[rows]  # type: ignore[union-attr]
            else:
                z += c[-1] * (m.knn.prior[0, rows] if unused  # type: ignore[union-attr]
                              else self._knn_rows[0, rows])
        if m.follow is not None:  # the last coefficient, or the one before the kNN's
            fol = m.follow.prior[rows] if unused else m.follow.feature(f[0, rows], rows)
            z += c[-1 - int(knn)] * fol
            if isinstance(rows, int) and not unused:  # _within(rows) reads it next
                self._fol = (rows, fol)
        return sigmoid(z)

    def _hand_later(self, layer: int, n: int) -> None:
        """The caches' Q of layers layer + 1 .. layer + n: the next-pass model on the state
        those layers would have if this pass left their experts unused (last 0, the averages
        decayed once)."""
        if self._qpass is None:  # once per pass: no layer ahead has run yet, so the rows hold
            self._qpass = self._next_p(slice(None), unused=True)
        q = self._qpass
        later = {layer + 1 + d: q[layer + 1 + d] for d in range(n)}
        for cache in self._caches:
            cache.observe_later(later)

    def _within(self, rows: slice | int, unused: bool = False) -> np.ndarray:
        """float64[H, ..., J]: P(used within the next h passes) of layers ``rows`` for each h
        of :attr:`horizons` (``unused``: if their coming pass leaves the experts unused)."""
        m = self.models
        assert m is not None
        col = None  # the follow column _next_p just computed for this layer, if it did
        if isinstance(rows, int) and not unused and self._fol is not None \
                and self._fol[0] == rows:
            col = self._fol[1]
        _, wcoef, wicpt, reads = self._evict[self._ev]
        knn = None  # float64[H1, ..., J]
        if reads:
            knn = m.knn.prior[:, rows] if unused else self._knn_rows[:, rows]  # type: ignore[union-attr]
        X = next_features(self.state, m.logpop, rows, unused=unused, follow=m.follow,
                          follow_col=col, knn_col=None if knn is None else knn[0])
        z = (X @ wcoef.T).T  # [H, ..., J]: the axes reversed (a view)
        if z.ndim == 3:  # [H, J, L] -> [H, L, J]
            z = z.transpose(0, 2, 1)
        if knn is not None and len(knn) > 1:  # each h its own share in the kNN column
            if rows == self._pv_layer and not unused:  # previewed: the same products
                z = z + self._pv.within[rows]  # type: ignore[union-attr,index]
            else:
                z = z + wcoef[:, -1].reshape((-1,) + (1,) * (z.ndim - 1)) * (knn[1:] - knn[0])
        return sigmoid(z + wicpt.reshape((-1,) + (1,) * (z.ndim - 1)))

    def _hand_within(self, layer: int, ahead: np.ndarray | None) -> np.ndarray | None:
        """The caches' horizon rows (:meth:`NextUseCache.observe_within`): the layer that ran,
        from its new state; each layer ahead (``ahead`` float64[n, J], this pass's scores)
        1 - (1 - p)(1 - W_u): used now or, if not, within h passes after (W_u on the state
        the pass would leave: one pass more than h, as no model has h + 1)."""
        if ahead is not None and self._wpass is None:  # once per pass, as _hand_later
            self._wpass = self._within(slice(None), unused=True)
        rows = {layer: self._within(layer)}
        if ahead is not None:
            wu = self._wpass
            assert wu is not None
            n = ahead.shape[0]
            w = 1.0 - (1.0 - ahead) * (1.0 - wu[:, layer + 1:layer + 1 + n])  # [H, n, J]
            for d in range(n):
                rows[layer + 1 + d] = w[:, d]
        for cache in self._caches:
            cache.observe_within(rows)
        self._fol = None
        return w if ahead is not None else None

    def _fills(self, layer: int, p: np.ndarray, w: np.ndarray,
               floor: float) -> list[Prefetch]:
        """Fills for every layer after ``layer`` while a bound cache has a free slot
        (:meth:`NextUseCache.fills`): the experts likely used within the longest horizon
        (``w`` float64[n, J], used now or within it, for the n layers this pass's offers
        reach; beyond them, within it on the state this pass would leave them) with
        probability >= ``min_prob`` that this pass's offers (``p`` float64[n, J] >=
        ``floor``) left out, each below every offer (priority: that probability - 1 < 0)."""
        assert self._wpass is not None  # _hand_within made it (w is not None)
        fw = self._wpass[-1, layer + 1:].copy()  # [L - 1 - layer, J]
        n = p.shape[0]
        fw[:n] = w
        fw[:n][p >= floor] = 0.0  # offered already
        ds, es = np.nonzero(fw >= self.min_prob)
        return [Prefetch(q, layer + 1 + d, e) for q, d, e in
                zip((fw[ds, es] - 1.0).tolist(), ds.tolist(), es.tolist(), strict=True)]

    def _floor(self) -> float:
        """The least probability offered as a prefetch: ``min_prob``, raised to the least
        that a bound cache's gate could take (:meth:`NextUseCache.min_paying_prob`); 0, so
        every expert of the layers ahead is offered, where a bound cache takes every offer
        (``next_use`` under ``demand_load=all_experts``: each layer copies all its experts
        anyway, so a prefetch replaces one of those copies whatever the router picks; the
        probabilities then only order the offers)."""
        if any(c.takes_every_offer() for c in self._caches):
            return 0.0
        return max([self.min_prob] + [c.min_paying_prob() for c in self._caches])

    def _offers(self, layer: int, p: np.ndarray, floor: float) -> list[Prefetch]:
        """Prefetch offers for layers layer + 1.. (``p`` float64[n, J]): p >= ``floor``
        (``min_prob``, or more where the cache says less cannot pay), at most
        ``max_per_layer`` per layer, the most probable; priority: nearer layers first."""
        keep = p >= floor
        if self.max_per_layer < p.shape[1]:
            rank = np.argsort(np.argsort(-p, axis=1, kind="stable"), axis=1)
            keep &= rank < self.max_per_layer
        ds, es = np.nonzero(keep)
        if not len(ds):
            return []
        pri = (max(self.depth, p.shape[0]) - 1 - ds) + p[ds, es]
        return [Prefetch(q, layer + 1 + d, e)
                for q, d, e in zip(pri.tolist(), ds.tolist(), es.tolist(), strict=True)]

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        rows = float(self.models.rows) if self.models is not None else 0.0
        out = {"query_us_mean": q, "fit_rows": rows}
        for c in self._caches[:1]:  # the feed gate's counts (only where there is one)
            gate = getattr(c, "feed_gate", None)
            if gate is not None:
                out.update(gate.stats())
        return out
