"""FineMoE's expert-map predictor (algorithms.md §5): semantic + trajectory search, δ selection.

An **expert map** is the L×J matrix of full router probabilities of one token (or one
iteration). The store keeps up to ``store_capacity`` rows of (semantic key [H], map [L, J]);
when full, a new row replaces the stored row of highest redundancy
``RDY(x, y) = (d/L)·cos_sem(x, y) + ((L − d)/L)·cos(map_x, map_y)`` (whole flattened maps).

Layer indexing (0-based here; the paper counts from 1):

- at iteration start (``l_now = −1``) the **semantic search** (cosine between the iteration's
  pooled embedding-layer output and every stored key, argmax) drives layers ``0..d−1`` with
  prefetch priority ``p / (l − l_now) = p / (l + 1)``;
- after layer ``l``'s router (``l_now = l``) the **trajectory search** (cosine between the
  probabilities observed this iteration for layers ``0..l``, flattened, and the same prefix of
  every stored map, argmax) drives layer ``l + d`` with priority ``p / d``.

This is the paper's "semantic drives layers 1..d; layer l > d is predicted from layers
1..l−d". Prefix cosines are incremental: running dot products of the query prefix with every
stored row plus precomputed prefix norms, so one ``observe_layer`` costs O(C·J), not O(C·l·J).

δ selection: δ = clip(1 − score, 0, 1) with ``score`` the matched similarity; experts are
taken in descending probability until their cumulative probability reaches δ, never fewer
than K (``use_delta=False``: exactly K), and never one of probability 0: stored maps are
rounded (float16 offline, float32 online), so a row may sum to 0.99991 and, with δ = 1, the
running sum would otherwise never reach δ and take every zero-probability expert too.

``selection`` (default ``paper``, the above) runs one of the authors' artifact rules
instead (:mod:`moeexp.predictors.expert_map_select` documents each with its source file and
commit of ``IntelliSys-Lab/FineMoE-EuroSys26``; algorithms.md §10): ``v0_tail`` (V0 at
``6d063946``, ``moe_infinity/runtime/model_offload.py`` ``_select_by_cumsum``: keeps the
experts from where the running sum reaches δ on, the tail, plus the K most probable) or
``v1_window`` (V1 at ``5c584686``, ``finemoe/runtime/model_offload.py``
``process_expert_map``: ``+= 1e-6`` on the window's whole priority map, so every expert of
the predicted layer is prefetched). Each is one integer per (row, score), so the memos, the
store-wide tables and the batch path serve every rule alike.

Choices where the paper is silent (config keys where useful):

- Batches: each request of the batch is one query (its key pooled over its token rows, its
  trajectory the **mean** of its tokens' probabilities per layer); predictions are combined
  as the union of the selected experts, and the per-expert maximum of the matched
  probabilities (``scores``, and the ``p`` of the priority), as the authors' code does.
- ``scores`` at iteration start: the semantic maps for layers ``0..d−1`` and the uniform
  ``1/J`` for every other layer ("no map speaks for that layer yet"), so the ``finemoe`` cache
  resets its p at each iteration start from this signal.
- ``use_trajectory=False`` (semantic only): the semantic match's map also drives layers
  ``≥ d`` at distance d. ``use_semantic=False`` (Map(T)): layers ``0..d−1`` get no prediction.
- Prefill (``prefill``): ``paper`` (default) treats the prompt as one query like any
  iteration (key pooled with ``embed_pooling``, trajectory = the mean of its tokens'
  probabilities), so it predicts one set of about K experts per layer while a prefill uses
  nearly all of them; ``token_union`` makes every prompt token a query (its own key and
  trajectory) and prefetches the union of their selections (p = the per-expert maximum);
  ``none`` predicts nothing for a prefill (the authors' V2 code: its predictor only runs
  in decode). The config default is ``token_union``: on the default experiment's recipe
  (3 seeds) its TTFT is lower on every seed (1.603 vs 1.623 ms paper, 1.727 ms none) at
  the same TPOT.
- ``predict_decode_layer0`` (default true, the paper: semantic search drives layers
  0..d-1): false leaves layer 0 of a decode iteration unpredicted (the authors' V2 GPU
  path starts predicting after layer 0's router).
- Store rows (``map_granularity``): ``token`` = one row per token row of an iteration (prefill:
  one per prompt token, key = that token's embedding, map = its probabilities; decode: one per
  generated token); ``iteration`` = one row per (request, iteration), key pooled with
  ``embed_pooling``, map = mean probabilities of the request's tokens.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from itertools import repeat
from typing import Literal, NamedTuple

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    PREDICTORS,
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
)
from moeexp.predictors.expert_map_select import (
    DELTA_TOL,
    SELECTIONS,
    V1_EPSILON,
    RowSelection,
    Selection,
    artifact_counts,
    positions,
    select_experts,
    taken_mask,
)
from moeexp.predictors.expert_map_store import ExpertMapStore, unit_rows
from moeexp.traces.schema import Trace, TraceDims

log = logging.getLogger(__name__)

Mode = Literal["offline", "online"]
Granularity = Literal["token", "iteration"]
Pooling = Literal["last_token", "mean"]
PrefillRule = Literal["paper", "token_union", "none"]
PREFILL_RULES = ("paper", "token_union", "none")

#: Semantic-search results remembered per store version (distinct query keys).
MEMO_ENTRIES = 1 << 16

__all__ = ["DELTA_TOL", "SELECTIONS", "ExpertMapPredictor", "RowSelection", "pool_keys",
           "select_experts"]
class _Preview(NamedTuple):
    """One pass's trajectory searches (:meth:`ExpertMapPredictor.preview_pass`).

    Attributes:
        probs: the previewed observations' probabilities (identity-checked per layer).
        dots: float64[L, B, n] running prefix dot products after each layer.
        qsq: float64[L, B] running squared query norms.
        preds: per layer, what :meth:`ExpertMapPredictor.observe_layer` returns for it
            (one query per pass: shared memo entries, never modify them).
    """

    probs: list[np.ndarray]
    dots: np.ndarray
    qsq: np.ndarray
    preds: list[Prediction]


def pool_keys(embed: np.ndarray, groups: list[np.ndarray], pooling: Pooling) -> np.ndarray:
    """float32[B, H]: one semantic key per group of token rows of ``embed`` (float[T, H])."""
    if pooling == "last_token":
        return embed[[int(g[-1]) for g in groups]].astype(np.float32)  # one gather
    return np.stack([embed[g].mean(axis=0) for g in groups]).astype(np.float32)


@PREDICTORS.register("expert_map")
class ExpertMapPredictor(Predictor):
    """FineMoE (paper semantics). Config keys:

    Args:
        dims: trace dimensions (L, J, K, H).
        prefetch_distance: d (Mixtral 3, Qwen1.5-MoE 6, Phi-3.5-MoE 4; tiny 2).
        mode: ``offline`` (store built by :meth:`fit` from the store split, then frozen) or
            ``online`` (start empty, add rows after every iteration).
        store_capacity: C, rows kept (paper 1000).
        map_granularity: ``token`` (the authors' prefill rows) or ``iteration``.
        embed_pooling: ``last_token`` (the authors' code) or ``mean``: the query key of an
            iteration and the key of ``iteration``-granularity rows.
        use_semantic / use_trajectory / use_delta: the ablation switches (Map(T) =
            semantic off, delta off; Map(T+S) = delta off; Map(T+S+δ) = all on).
        min_experts: the "never fewer than K" floor (None: the model's top-K).
        prefill: ``paper`` | ``token_union`` | ``none``: what a prefill iteration predicts
            (module docstring). The class keeps the paper's rule; ``conf/predictor/
            expert_map.yaml`` runs ``token_union``, chosen on TTFT (issue 11).
        predict_decode_layer0: false: no prediction for layer 0 of a decode iteration
            (the authors' V2).
        selection: ``paper`` (δ selection, algorithms.md §5) | ``v0_tail`` | ``v1_window``
            (the authors' artifact selections, algorithms.md §10; module docstring).

    On a routing-only trace (imported, top-k weights only: :attr:`Trace.capabilities`) the
    maps are the scattered top-k weights (zero outside the K selected experts), and the
    trajectory search runs on those; the semantic search needs the embedding-layer outputs
    (``needs = {"embed"}``), so there FineMoE runs as Map(T+δ) (``use_semantic=false``) or
    is reported not applicable.
    """

    needs = frozenset({"embed"})

    def __init__(
        self,
        *,
        dims: TraceDims,
        prefetch_distance: int = 3,
        mode: Mode = "offline",
        store_capacity: int = 1000,
        map_granularity: Granularity = "token",
        embed_pooling: Pooling = "last_token",
        use_semantic: bool = True,
        use_trajectory: bool = True,
        use_delta: bool = True,
        min_experts: int | None = None,
        prefill: PrefillRule = "paper",
        predict_decode_layer0: bool = True,
        selection: Selection = "paper",
    ) -> None:
        super().__init__(dims=dims)
        L, J = dims.num_layers, dims.num_experts
        checks = [
            (mode in ("offline", "online"), f"mode={mode!r}; valid: offline, online"),
            (map_granularity in ("token", "iteration"),
             f"map_granularity={map_granularity!r}; valid: token, iteration"),
            (embed_pooling in ("last_token", "mean"),
             f"embed_pooling={embed_pooling!r}; valid: last_token, mean"),
            (1 <= prefetch_distance <= L, f"prefetch_distance={prefetch_distance}; valid: 1..{L}"),
            (store_capacity >= 1, f"store_capacity={store_capacity}; must be >= 1"),
            (use_semantic or use_trajectory, "use_semantic and use_trajectory are both false"),
            (prefill in PREFILL_RULES,
             f"prefill={prefill!r}; valid: {', '.join(PREFILL_RULES)}"),
            (selection in SELECTIONS,
             f"selection={selection!r}; valid: {', '.join(SELECTIONS)}"),
            (use_delta or selection == "paper",
             f"selection={selection} is a δ rule of the authors' artifact: it needs "
             "use_delta=true (use_delta=false takes exactly K, the paper's ablation)"),
        ]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ConfigError(f"predictor=expert_map: {'; '.join(bad)}")
        self.k = int(min_experts if min_experts is not None else dims.top_k)
        if not 1 <= self.k <= J:
            raise ConfigError(f"predictor=expert_map: min_experts={self.k}; valid: 1..{J}")
        self.d = int(prefetch_distance)
        self.mode: Mode = mode
        self.granularity: Granularity = map_granularity
        self.pooling: Pooling = embed_pooling
        self.use_semantic, self.use_trajectory, self.use_delta = (
            bool(use_semantic), bool(use_trajectory), bool(use_delta))
        self.prefill: PrefillRule = prefill
        self.predict_decode_layer0 = bool(predict_decode_layer0)
        self.selection: Selection = selection
        if selection != "paper":
            log.info("predictor=expert_map: selection=%s (the authors' artifact, "
                     "algorithms.md §10), not the paper's δ selection", selection)
        self._silent = False  # this pass predicts nothing (prefill: none)
        self._queries: list[np.ndarray] = []  # token rows of each search query
        if not self.use_semantic:  # no semantic key: no embeddings needed
            self.needs = frozenset()  # type: ignore[misc]
        self.store = ExpertMapStore(store_capacity, L, J, dims.hidden_size, self.d)
        self._uniform = np.full(J, 1.0 / J)
        self._uniform.setflags(write=False)
        self._groups: list[np.ndarray] = []
        self._units: np.ndarray = np.zeros(0, dtype=np.int64)
        self._n = 0  # store rows seen by this iteration's search (the store is fixed within it)
        self._dots = np.zeros((0, 0))
        self._qsq = np.zeros(0)
        self._next_layer = 0
        self._sem_rows = np.zeros(0, dtype=np.int64)
        self._sem_score = np.zeros(0)
        self._layer = -1
        self._pre: _Preview | None = None  # preview_pass's trajectory searches of this pass
        self._memo: dict[bytes, tuple[int, float]] = {}
        self._memo_version = -1
        self._clear_memos(-1)
        self._buf_embed: np.ndarray | None = None
        self._buf_probs: list[np.ndarray] = []
        self._buf_token_request = np.zeros(0, dtype=np.int64)
        self._t_sem: list[float] = []
        self._t_traj: list[float] = []

    # ------------------------------------------------------------------ learning
    def fit(self, store: Trace) -> None:
        """Offline mode: build the store from the *store split* rows of ``store`` (frozen).

        Requests whose split is not ``store`` are ignored (with a warning), so a test request
        can never enter the map store. Online mode: nothing (the store starts empty).
        """
        if self.mode == "online":
            log.info("expert_map: online mode, the store starts empty (fit ignored)")
            return
        other = [r.request_id for r in store.requests if r.split != "store"]
        if other:
            log.warning("expert_map.fit: ignoring %d non-store requests", len(other))
            store = store.split("store")
        self._check_dims(store.dims)
        keys, maps, req = self._rows_from_trace(store)
        self.store.add(keys, maps, req)
        log.info("expert_map: store built with %d rows (%d candidates, capacity %d)",
                 self.store.size, len(keys), self.store.capacity)

    def _check_dims(self, dims: TraceDims) -> None:
        mine = self.dims
        if (dims.num_layers, dims.num_experts, dims.hidden_size) != (
                mine.num_layers, mine.num_experts, mine.hidden_size):
            raise ConfigError(
                f"expert_map: trace dims (L={dims.num_layers}, J={dims.num_experts}, "
                f"H={dims.hidden_size}) differ from the predictor's (L={mine.num_layers}, "
                f"J={mine.num_experts}, H={mine.hidden_size})")

    def _rows_from_trace(self, trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Store rows of a whole trace per ``map_granularity``: keys [N,H], maps [N,L,J], req [N]."""
        lens = np.diff(trace.iter_offsets)
        tok_req = np.repeat(trace.iter_request.astype(np.int64), lens)
        all_probs = trace.router_probs()  # sparse top-k weights in a routing-only trace
        embed = trace.embed
        if embed is None:  # Map(T): no semantic search, the keys are never compared
            embed = np.zeros((trace.num_tokens, self.dims.hidden_size), dtype=np.float16)
        if self.granularity == "token":
            return (embed.astype(np.float32), all_probs.astype(np.float64), tok_req)
        starts = trace.iter_offsets[:-1]
        probs = np.add.reduceat(all_probs.astype(np.float64), starts, axis=0) / lens[:, None, None]
        if self.pooling == "last_token":
            keys = embed[trace.iter_offsets[1:] - 1].astype(np.float32)
        else:
            keys = (np.add.reduceat(embed.astype(np.float64), starts, axis=0)
                    / lens[:, None]).astype(np.float32)
        return keys, probs, trace.iter_request.astype(np.int64)

    # ------------------------------------------------------------------ hooks
    def start_iteration(self, ctx: IterationStart) -> Prediction:
        tok_req = np.asarray(ctx.token_request, dtype=np.int64)
        # no embeddings (a routing-only trace, Map(T)): zero keys, never searched
        embed = (np.zeros((len(tok_req), self.dims.hidden_size), dtype=np.float32)
                 if ctx.embed is None and not self.use_semantic else np.asarray(ctx.embed))
        if embed.ndim != 2 or embed.shape[1] != self.dims.hidden_size:
            raise ValueError(f"expert_map: embed must be [T, {self.dims.hidden_size}], "
                             f"got {embed.shape}")
        self._units, self._groups = unit_rows(tok_req)
        prefill = int(ctx.step) == 0
        self._silent = prefill and self.prefill == "none"
        # token_union: every prompt token is its own query (key, trajectory); the batch
        # rule (union of the selections, per-expert max of p) combines them
        self._queries = ([np.array([i]) for i in range(len(tok_req))]
                         if prefill and self.prefill == "token_union" else self._groups)
        B, n = len(self._queries), self.store.size
        self._n = n
        self._dots = np.zeros((B, n))
        self._qsq = np.zeros(B)
        self._next_layer = 0
        self._layer = -1
        self._pre = None
        if self.mode == "online":
            self._buf_embed = embed.astype(np.float32, copy=True)
            self._buf_token_request = tok_req
            self._buf_probs = []
        if not self.use_semantic or n == 0 or self._silent:
            return Prediction(scores=dict.fromkeys(range(self.dims.num_layers), self._uniform))
        t0 = time.perf_counter()
        self._sem_rows, self._sem_score = self._semantic(pool_keys(embed, self._queries,
                                                                   self.pooling))
        pred = self._semantic_pred(0 if prefill or self.predict_decode_layer0 else 1)
        self._t_sem.append(time.perf_counter() - t0)
        return pred

    def _semantic_pred(self, first: int) -> Prediction:
        """:meth:`start_iteration`'s Prediction from this iteration's semantic matches:
        their maps drive layers ``first..d-1`` (priority p / (l + 1)); every other layer's
        score is the uniform 1/J. One query: a memo entry per (matched row, ``first``,
        experts taken per layer), shared between iterations (callers never modify it)."""
        L = self.dims.num_layers
        layers = range(first, min(self.d, L))
        rows, score = self._sem_rows, self._sem_score
        if len(rows) != 1:
            pred = Prediction(scores=dict.fromkeys(range(L), self._uniform))
            for layer in layers:
                self._emit(pred, layer, rows, score, distance=layer + 1)
            return pred
        row, sc = int(rows[0]), float(score[0])
        self._fresh_memos()
        sels = [self._selection(layer, row) for layer in layers]
        counts = tuple(sel.num_selected(sc, self.k, self.use_delta, self.selection)
                       for sel in sels)
        got = self._start_preds.get((row, first, counts))
        if got is not None:
            return got
        pred = Prediction(scores=dict.fromkeys(range(L), self._uniform))
        for layer, sel, c in zip(layers, sels, counts, strict=True):  # what _emit_one adds
            p, chosen, prefetch = self._emit_of(layer, row, c, layer + 1, sel.p, sel.order)
            pred.scores[layer], pred.predicted[layer] = p, chosen
            pred.prefetch.extend(prefetch)
        self._start_preds[(row, first, counts)] = pred
        return pred

    def _semantic(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Semantic search per query key (float32[B, H]), memoised per store version.

        The embedding-layer output of a token depends on its id only, so the same query key
        recurs often; the memo returns exactly what the search would while the store is
        unchanged (it is cleared whenever a row is inserted).
        """
        if self._memo_version != self.store.version or len(self._memo) > MEMO_ENTRIES:
            self._memo, self._memo_version = {}, self.store.version
        tags = [k.tobytes() for k in keys]
        miss = [b for b, t in enumerate(tags) if t not in self._memo]
        if miss:
            rows, score = self.store.semantic_search(keys[miss])
            for b, r, s in zip(miss, rows, score, strict=True):
                self._memo[tags[b]] = (int(r), float(s))
        found = [self._memo[t] for t in tags]
        return (np.array([f[0] for f in found], dtype=np.int64),
                np.array([f[1] for f in found], dtype=np.float64))

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        """The trajectory search after layer ``obs.layer``'s router: what it predicts for
        layer ``obs.layer + d``. A previewed layer (:meth:`preview_pass`) returns the
        preview's Prediction, which for one query per pass is a memo entry shared between
        passes: callers read it, never modify it (the simulator and the engine only read)."""
        layer = obs.layer
        if layer != self._next_layer:
            raise RuntimeError(f"expert_map: observe_layer({layer}) out of order; expected "
                               f"layer {self._next_layer} (layers are observed 0..L-1 once)")
        self._next_layer += 1
        if self.mode == "online":
            self._buf_probs.append(np.asarray(obs.probs).astype(np.float32, copy=True))
        pre = self._pre  # a preview exists only when this layer would search (below)
        if pre is not None and pre.probs[layer] is obs.probs:  # made by preview_pass,
            self._layer = layer  # which timed it (_t_traj)
            return pre.preds[layer]
        want = layer + self.d < self.dims.num_layers
        if self._n == 0 or self._silent or not (self.use_trajectory
                                                or (want and self.use_semantic)):
            return Prediction()
        t0 = time.perf_counter()
        pred = self._observe(layer, np.asarray(obs.probs), want)
        self._t_traj.append(time.perf_counter() - t0)
        return pred

    def _observe(self, layer: int, probs: np.ndarray, want: bool) -> Prediction:
        """:meth:`observe_layer`'s search, made now (not previewed). ``probs``: float[T, J]
        the layer's router probabilities; ``want``: layer ``layer + d`` exists."""
        pred = Prediction()
        target = layer + self.d
        if self.use_trajectory:
            if self._pre is not None:  # not what was previewed: the incremental path again
                self._resume_from(self._pre, layer)
            found = self._update_trajectory(layer, self._query(probs), search=want)
            if found is not None:
                self._emit(pred, target, found[0], found[1], distance=self.d)
        elif want:  # semantic only: its match keeps speaking for later layers
            self._emit(pred, target, self._sem_rows, self._sem_score, distance=self.d)
        return pred

    def _query(self, probs: np.ndarray) -> np.ndarray:
        """float64[B, J]: each query's trajectory row of one layer (its tokens' mean)."""
        queries = self._queries
        if len(probs) == 1 or len(queries) == len(probs):  # one token per query: its row
            return probs.astype(np.float64)  # is its mean, exactly
        if len(queries) == 1:
            return probs.astype(np.float64).mean(axis=0, keepdims=True)
        return np.stack([probs[g].astype(np.float64).mean(axis=0) for g in queries])

    previews = True

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """Every layer's trajectory search of the pass at once (:class:`_Preview`): the
        operations of :meth:`_update_trajectory`, stacked over layers (one matmul, the
        running sums added in layer order, one argmax), so each layer's match is
        bit-identical; then every layer's Prediction (:meth:`_preview_preds`)."""
        self._pre = None
        L = self.dims.num_layers
        if (self._n == 0 or self._silent or not self.use_trajectory or len(obs) != L
                or self._next_layer != 0):
            return
        t0 = time.perf_counter()
        probs = [o.probs for o in obs]
        T, B, n = len(probs[0]), len(self._queries), self._n
        if T == 1 and all(len(p) == 1 for p in probs):  # one token: the query is its row
            q = np.concatenate(probs, dtype=np.float64)[:, None, :]  # [L, 1, J]
        elif T == B and all(len(p) == T for p in probs):  # a query = its row
            q = np.stack(probs).astype(np.float64)  # [L, B, J], as _query per layer
        else:
            q = np.stack([self._query(np.asarray(p)) for p in probs])  # [L, B, J]
        maps = self.store.maps[:, :n]  # [L, n, J]
        if B == 1:  # maps' rows times the query: numpy sends this and _update_trajectory's
            # q @ maps.T for one row to the same BLAS call (gemv over maps' rows), the
            # same bits; q @ maps.T stacked would not be a gemv, and is slower
            dots = np.matmul(maps, q.transpose(0, 2, 1)).reshape(L, 1, n)
        else:
            dots = np.matmul(q, maps.transpose(0, 2, 1))  # [L, B, n]
        add, per_layer = np.add, list(dots)  # the running sums, added in layer order
        for prev, cur in zip(per_layer[:-1], per_layer[1:], strict=True):  # (cumsum's
            add(prev, cur, out=cur)  # strided loop is slower)
        qsq = np.cumsum(np.einsum("lbj,lbj->lb", q, q), axis=0)  # [L, B]
        m = L - self.d  # layers l whose target l + d exists: the only ones searched
        sims = (dots[:m] * self.store.inv_prefix_norm[:m, None, :n]).reshape(m * B, n)
        rows = sims.argmax(axis=1)  # [m·B]
        best = sims[np.arange(m * B), rows].reshape(m, B)  # the argmax's own values
        rows = rows.reshape(m, B)
        preds = self._preview_preds(rows, best, qsq[:m])
        preds.extend(Prediction() for _ in range(m, L))  # no target layer: nothing to say
        self._pre = _Preview(probs, dots, qsq, preds)
        # each layer's trajectory query costs a 1/L share of the pass's search (the
        # previewed observe_layer calls only look their Prediction up)
        self._t_traj.extend(repeat((time.perf_counter() - t0) / L, L))

    def _preview_preds(self, rows: np.ndarray, best: np.ndarray, qsq: np.ndarray
                       ) -> list[Prediction]:
        """The Predictions of layers ``0..m-1`` of a previewed pass from their matches:
        ``rows`` int64[m, B] matched rows, ``best`` float64[m, B] their ``dots · inv
        prefix norm``, ``qsq`` float64[m, B] running squared query norms (what
        :meth:`_update_trajectory` then :meth:`_emit` give, layer by layer)."""
        d = self.d
        scores = best / np.maximum(np.sqrt(qsq), 1e-300)  # the IEEE sqrt, max and divide
        if rows.shape[1] == 1:  # of _update_trajectory's Python floats: the same bits
            return self._trajectory_preds(rows[:, 0], scores[:, 0])
        preds = []
        for layer in range(len(rows)):
            pred = Prediction()
            self._emit(pred, layer + d, rows[layer], scores[layer], distance=d)
            preds.append(pred)
        return preds

    def _trajectory_preds(self, matched: np.ndarray, score: np.ndarray) -> list[Prediction]:
        """One query's trajectory Predictions of a pass: for each layer l < L - d, what
        layer l's match (stored row ``matched[l]``, cosine ``score[l]``) predicts for layer
        l + d (``matched`` int64[L - d], ``score`` float64[L - d]). Offline (a frozen store),
        the number of experts each takes is counted for all layers at once
        (:meth:`_counts`), and a memoised Prediction is then found by its key alone."""
        L, d = self.dims.num_layers, self.d
        if self.mode != "offline":  # the store moves every iteration: nothing to share
            out = []
            for layer, r, sc in zip(range(d, L), matched.tolist(), score.tolist(),
                                    strict=True):
                p, chosen, prefetch = self._one(layer, r, sc, d)
                out.append(Prediction(prefetch=list(prefetch), scores={layer: p},
                                      predicted={layer: chosen}))
            return out
        order_t = self._tables()[0]
        counts = self._counts(np.arange(d, L), matched, score).tolist()
        got, out = self._preds.get, []
        for layer, r, c in zip(range(d, L), matched.tolist(), counts, strict=True):
            pred = got((layer, r, c, d))
            if pred is None:
                p, chosen, prefetch = self._emit_of(layer, r, c, d, self._row_p(layer, r),
                                                    order_t[layer, r])
                pred = self._preds[(layer, r, c, d)] = Prediction(
                    prefetch=prefetch, scores={layer: p}, predicted={layer: chosen})
            out.append(pred)
        return out

    def _counts(self, layers: np.ndarray, rows: np.ndarray | list[int],
                score: np.ndarray | Sequence[float]) -> np.ndarray:
        """int64[N]: how many experts δ selection takes from stored row ``rows[i]`` at layer
        ``layers[i]`` matched with cosine ``score[i]`` (offline mode), all at once on the
        store-wide tables (:meth:`_tables`): what :meth:`RowSelection.num_selected` gives.
        There n = min(#(running sums < δ - tol) + 1, nonzero) (the sums never decrease, so
        ``bisect_left`` counts them), then min(max(n, k), J). Here the capped sums table
        holds +inf from index nonzero - 1 on, so 1 + #(capped < δ - tol) is min(that count
        + 1, max(nonzero, 1)): the same n, or 1 where n is 0, which max(·, k ≥ 1) makes the
        same; and n ≤ J already. δ's clip in float64, as there."""
        _, csum, nz, capped = self._tables()
        n_rows, J, k = capped.shape[1], capped.shape[2], self.k
        if not self.use_delta:
            return np.full(len(rows), min(k, J), dtype=np.int64)
        flat = layers * n_rows + rows  # (layer, row) as one index: one gather, not two
        delta = np.clip(1.0 - np.asarray(score, dtype=np.float64), 0.0, 1.0)
        if self.selection != "paper":  # an artifact rule's count (expert_map_select)
            return artifact_counts(csum.reshape(-1, J).take(flat, axis=0),
                                   nz.reshape(-1).take(flat), delta, k, self.selection)
        below = capped.reshape(-1, J).take(flat, axis=0) < (delta - DELTA_TOL)[:, None]
        return np.maximum(below.sum(axis=1) + 1, k)  # int64[N]

    def _resume_from(self, pre: _Preview, layer: int) -> None:
        """Drop the preview, keeping the running sums of layers ``0..layer-1``."""
        if layer:
            self._dots, self._qsq = pre.dots[layer - 1].copy(), pre.qsq[layer - 1].copy()
        self._pre = None

    def _update_trajectory(self, layer: int, q: np.ndarray, search: bool = True
                           ) -> tuple[np.ndarray, Sequence[float]] | None:
        """Fold layer ``layer``'s query rows q (float64[B, J]) into the running prefix dots.

        Incremental: ``dots[b, c] += q[b] · maps[layer, c]`` and ``|prefix_b|² += |q[b]|²``;
        the stored prefix norms are precomputed, so this is O(B·C·J) per layer.

        Returns (int64[B] argmax rows, float64[B] their cosines), or None when ``search``
        is false (a layer whose target ``layer + d`` does not exist: nothing to emit).
        """
        n = self._n
        self._dots += q @ self.store.maps[layer, :n].T
        self._qsq += np.einsum("bj,bj->b", q, q)
        self._layer = layer
        if not search:
            return None
        # cos = dots / (|q| · |stored prefix|); |q| is one constant per query row
        sims = self._dots * self.store.inv_prefix_norm[layer, :n]
        rows = sims.argmax(axis=1)
        if len(rows) == 1:  # the same IEEE operations on Python floats
            r = int(rows[0])
            return rows, (float(sims[0, r]) / max(math.sqrt(float(self._qsq[0])), 1e-300),)
        score = sims[np.arange(len(rows)), rows] / np.maximum(np.sqrt(self._qsq), 1e-300)
        return rows, score

    @property
    def last_cosines(self) -> np.ndarray:
        """float64[B, n]: prefix cosines of each query with every stored row, as of the latest
        :meth:`observe_layer` (from the incremental state; tests compare it to a direct one)."""
        dots, qsq = self._dots, self._qsq
        if self._pre is not None and self._layer >= 0:  # previewed: the preview's sums
            dots, qsq = self._pre.dots[self._layer], self._pre.qsq[self._layer]
        inv = self.store.inv_prefix_norm[self._layer, : self._n]
        return dots * inv / np.maximum(np.sqrt(qsq), 1e-300)[:, None]

    def _emit(self, pred: Prediction, layer: int, rows: np.ndarray,
              score: np.ndarray | Sequence[float], distance: int) -> None:
        """Add the matched maps' layer ``layer`` (one matched row per query) to ``pred``."""
        if len(rows) == 1:
            self._emit_one(pred, layer, int(rows[0]), float(score[0]), distance)
            return
        if self.mode == "offline":  # every query's δ selection at once, on the tables
            order_t, _, nz_t, _ = self._tables()
            taken = order_t[layer, rows]  # [B, J] each row's experts, best first
            counts = self._counts(np.full(len(rows), layer), rows, score)
            mask = taken_mask(counts, nz_t[layer, rows], self.k, taken.shape[1], self.selection)
            experts = np.unique(taken[mask])
            head = (set(np.unique(taken[taken_mask(counts, nz_t[layer, rows], self.k,
                                                   taken.shape[1], "paper")]).tolist())
                    if self.selection == "v1_window" else None)
        else:
            chosen: set[int] = set()
            head = set() if self.selection == "v1_window" else None
            for r, sc in zip(rows.tolist(), score, strict=True):  # select_experts per query
                sel = self._selection(layer, r)
                c = sel.num_selected(float(sc), self.k, self.use_delta, self.selection)
                chosen.update(sel.taken(c, self.k, self.selection).tolist())
                if head is not None:
                    head.update(sel.order[:c].tolist())
            experts = np.array(sorted(chosen), dtype=np.int64)
        p = self.store.maps[layer, rows].max(axis=0)  # [B, J] -> [J]
        pred.scores[layer] = p
        pred.predicted[layer] = np.sort(experts)
        if head is None:
            pred.prefetch.extend(Prefetch(float(p[e]) / distance, layer, int(e))
                                 for e in experts)
        else:  # v1_window: the heads at p / distance + ε, every other expert at ε
            pred.prefetch.extend(Prefetch(
                (float(p[e]) / distance if e in head else 0.0) + V1_EPSILON, layer, e)
                for e in experts.tolist())

    def _fresh_memos(self) -> None:
        """Drop the selection memos and tables if the store changed since they were made."""
        if self._sel_version != self.store.version:
            self._clear_memos(self.store.version)

    def _clear_memos(self, version: int) -> None:
        """Empty selection memos and tables, for store version ``version``."""
        # single-query emits: (layer, row) -> its selection data, and (layer, row, experts
        # taken, distance) -> (hint p, sorted experts, prefetch requests)
        self._sel: dict[tuple[int, int], RowSelection] = {}
        self._out: dict[tuple[int, int, int, int],
                        tuple[np.ndarray, np.ndarray, list[Prefetch]]] = {}
        # offline: (layer, row) -> the row's hint p; the emit keys -> whole Predictions;
        # one query's start_iteration Predictions by (row, first layer, experts per layer)
        self._p: dict[tuple[int, int], np.ndarray] = {}
        self._preds: dict[tuple[int, int, int, int], Prediction] = {}
        self._start_preds: dict[tuple[int, int, tuple[int, ...]], Prediction] = {}
        # the whole store's stable sort, running sums, non-zero counts and capped sums
        self._sel_table: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._sel_version = version

    def _selection(self, layer: int, row: int) -> RowSelection:
        """The memoised :class:`RowSelection` of stored ``row`` at ``layer`` (the memos
        are dropped whenever the store changed)."""
        self._fresh_memos()
        sel = self._sel.get((layer, row))
        if sel is None:
            sel = self._sel[(layer, row)] = (  # online: the store moves every iteration
                self._row_selection(layer, row) if self.mode == "offline"
                else RowSelection.of(self.store.maps[layer, row]))
        return sel

    def _row_selection(self, layer: int, row: int) -> RowSelection:
        """:meth:`RowSelection.of` of stored ``row`` at ``layer``, its sort and running
        sums read from tables of the whole store made at the first call per store version
        (offline mode: the store is frozen; the same stable sort and sequential sums per
        row, so the same values)."""
        order_t, csum_t, nz_t, _ = self._tables()
        o = order_t[layer, row].copy()
        o.setflags(write=False)
        return RowSelection(self._row_p(layer, row), o, csum_t[layer, row].tolist(),
                            int(nz_t[layer, row]))

    def _row_p(self, layer: int, row: int) -> np.ndarray:
        """Read-only float64[J]: stored ``row``'s probabilities at ``layer``, one array per
        (layer, row) and store version (offline mode), owning its data: the ``finemoe``
        cache checks such a hint row once, not at every pass that sends it."""
        self._fresh_memos()
        p = self._p.get((layer, row))
        if p is None:
            p = self._p[(layer, row)] = self.store.maps[layer, row].copy()  # float64
            p.setflags(write=False)
        return p

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The whole store's stable sort int64[L, n, J], running sums float64[L, n, J],
        non-zero counts int64[L, n] and the running sums capped for :meth:`_counts`
        (float64[L, n, J], +inf from index nonzero - 1 on), made once per store version."""
        self._fresh_memos()
        n = self.store.size
        if self._sel_table is None or self._sel_table[0].shape[1] != n:
            maps = self.store.maps[:, :n]  # [L, n, J]
            order = np.argsort(-maps, axis=2, kind="stable")
            csum = np.cumsum(np.take_along_axis(maps, order, axis=2), axis=2, dtype=np.float64)
            nz = np.count_nonzero(maps > 0, axis=2)
            capped = np.where(np.arange(maps.shape[2]) >= (nz - 1)[:, :, None], np.inf, csum)
            self._sel_table = (order, csum, nz, capped)
        return self._sel_table

    def _emit_one(self, pred: Prediction, layer: int, row: int, score: float,
                  distance: int) -> None:
        """:meth:`_emit` for one query (what :meth:`_one` gives)."""
        p, chosen, prefetch = self._one(layer, row, score, distance)
        pred.scores[layer] = p
        pred.predicted[layer] = chosen
        pred.prefetch.extend(prefetch)

    def _one(self, layer: int, row: int, score: float,
             distance: int) -> tuple[np.ndarray, np.ndarray, list[Prefetch]]:
        """One query's emit for ``layer`` from stored ``row`` matched with ``score``
        (:meth:`_emit_of` with the number of experts δ selection takes)."""
        sel = self._selection(layer, row)
        return self._emit_of(layer, row, sel.num_selected(score, self.k, self.use_delta,
                                                          self.selection),
                             distance, sel.p, sel.order)

    def _emit_of(self, layer: int, row: int, n: int, distance: int, p: np.ndarray,
                 order: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Prefetch]]:
        """The emit for ``layer`` of stored ``row`` taking its ``n`` most probable experts,
        memoised per store version (the same experts, in the same order, the same hint and
        priorities, without re-sorting the row): (``p``, the row's read-only float64[J]
        hint; int64[n] sorted experts; their prefetch requests best first, priority
        p / distance; the last two shared: never modify them). ``order``: the row's
        experts in descending probability (stable)."""
        key = (layer, row, n, distance)
        out = self._out.get(key)
        if out is None:
            if self.selection == "paper":
                experts = order[:n]  # descending probability: the prefetch order
            else:  # an artifact rule: n is its count (expert_map_select.positions)
                experts = order[positions(n, int(np.count_nonzero(p > 0)), self.k, len(p),
                                          self.selection)]
            chosen = experts.copy()
            chosen.sort()  # in place: a third of np.sort's time on a few experts
            chosen.setflags(write=False)
            pl = p.tolist()
            if self.selection == "v1_window":  # head at p / distance + ε, the rest at ε
                prefetch = [Prefetch((pl[e] / distance if i < n else 0.0) + V1_EPSILON,
                                     layer, e) for i, e in enumerate(experts.tolist())]
            else:
                prefetch = [Prefetch(pl[e] / distance, layer, e) for e in experts.tolist()]
            out = self._out[key] = (p, chosen, prefetch)
        return out

    def end_iteration(self) -> None:
        """Online mode: add this iteration's rows to the store."""
        if self.mode != "online" or self._buf_embed is None:
            return
        L = self.dims.num_layers
        if len(self._buf_probs) != L:
            raise RuntimeError(f"expert_map: iteration ended after {len(self._buf_probs)} of "
                               f"{L} layers; online rows need every layer's probabilities")
        probs = np.stack(self._buf_probs, axis=1).astype(np.float64)  # [T, L, J]
        if self.granularity == "token":
            keys, maps, req = self._buf_embed, probs, self._buf_token_request
        else:
            keys = pool_keys(self._buf_embed, self._groups, self.pooling)
            maps = np.stack([probs[g].mean(axis=0) for g in self._groups])
            req = self._units
        self.store.add(keys, maps, req)
        self._buf_embed, self._buf_probs = None, []

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, float]:
        def us(ts: list[float]) -> float:
            return float(np.mean(ts) * 1e6) if ts else float("nan")

        return {
            "store_rows": float(self.store.size),
            "store_bytes": float(self.store.nbytes),
            "semantic_query_us_mean": us(self._t_sem),
            "trajectory_query_us_mean": us(self._t_traj),
        }
