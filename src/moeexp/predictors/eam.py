"""MoE-Infinity's activation-aware predictor (algorithms.md §4): EAM matching and prefetch.

An **EAM** (expert activation matrix) is an L×J count matrix: ``M[i][j]`` = tokens routed to
expert j at layer i. A request's EAM is the sum of its iterations' EAMs. A fixed-capacity
**collection** of request-level EAMs is pre-filled from the store split (:meth:`fit`, as
FineMoE did for a fair comparison) and, with ``online_update``, grows with every finished
request (MoE-Infinity's own behaviour). Layer indices are 0-based; ``l`` is the layer whose
router just ran (``l = −1`` at iteration start).

``variant: paper`` (MoE-Infinity v3, the default):
    - request EAMs are kept **separately for prefill and decode** (two collections, each of
      ``capacity`` rows); the query of a prefill iteration is its partial iteration EAM, the
      query of a decode iteration is the request's decode EAM so far plus the partial one;
    - matching: cosine over the flattened L·J matrices; the ``top_n`` nearest are summed and
      each layer's row normalised to probabilities (the pEAM);
    - prefetch score of expert j at a future layer i > l: ``pEAM[i][j] · (1 − (i − l)/L)``;
    - collection replacement: the new EAM replaces the most similar stored one.
``variant: oss`` (what the public code does):
    - one request EAM for prefill + decode, top-1 match only, similarity = mean over the
      future layers i > l of the per-layer cosine (the code blanks the stored layers ≤ l to a
      constant row; that adds the same value to every candidate, so this ranks identically),
    - score ``M[i][j] · (1 − (i − l)/(L + 1))`` on the raw counts of the match,
    - replacement of the least-accessed entry (a match counts as an access; a new entry
      starts at 1); ``oss_prefetch: false`` reproduces the release's disabled prefetch.

``per_layer`` (off by default): keep only the best ``per_layer`` scores of each future layer
(``top_k``: the model's K), every future layer requested (``max_prefetch`` then defaults to
all of them): the FineMoE artifact's MoE-Infinity baseline (``IntelliSys-Lab/
FineMoE-EuroSys26`` at ``6d063946``, ``moe_infinity/memory/expert_predictor.py``
``ExpertPredictor.predict``: the top-``top_k`` counts of each layer of the best-matching
trace, layers l + 1 .. L − 1, decayed, all enqueued by ``memory/expert_prefetcher.py``
``prefetch_experts``; ``demo/configs/baselines/config_moeinf.py``: ``store_capacity = 1000``).
At ``051cb7e1`` the model file adds ``1e-6`` to every expert of layers < l + 2 + d (+ L/2 in
decode) instead, which prefetches whole layers, as ``per_layer: null`` with a large
``max_prefetch`` does.

Choices where the paper is silent:
    - ``max_prefetch`` (default J): requests issued per hook, the highest scores over all
      future layers. The paper prefetches "in descending score" and lets bandwidth bound it;
      the mechanism drops stale requests, so a short, well-ordered list loses nothing.
    - ``predicted`` (recall accounting): the top-K experts of layer l + 1 by score, i.e. the
      last prediction made for each layer before it runs.
    - ``scores`` (cache hints, e.g. the ``moe_infinity`` cache's Algorithm 1): the pEAM rows
      of all layers (row-normalised for ``oss`` too), sent when the match changed (a cache
      keeps the latest rows it was given).
    - Batches: one query per request of the batch; its per-layer counts come from
      ``obs.counts`` when the batch is one request, else from the top-K of each token's
      probabilities. Scores are combined by the per-expert maximum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

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
from moeexp.predictors.expert_map_store import unit, unit_rows
from moeexp.traces.schema import Trace, TraceDims

log = logging.getLogger(__name__)

Variant = Literal["paper", "oss"]
DEFAULT_CAPACITY = {"paper": 120, "oss": 1000}
#: Memoised one-request predictions kept (the memo is cleared when it reaches this).
MEMO_ENTRIES = 1 << 16
#: Bytes of contiguous layer-suffix copies one collection may keep for ``match_unit_rows``.
SUFFIX_BYTES = 1 << 26
#: Unit roundoff of float64 (2^-53).
_U = 2.0 ** -53


def _per_layer(value: int | str | None, dims: TraceDims) -> int | None:
    """``per_layer`` checked: None, ``"top_k"`` (the model's K) or an int >= 1."""
    if value is None:
        return None
    if value == "top_k":
        return dims.top_k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"predictor=eam: per_layer={value!r}; valid: null, top_k or an "
                          "integer >= 1")
    return value


def normalize_rows(m: np.ndarray) -> np.ndarray:
    """float64[..., J]: each row divided by its sum (all-zero rows stay zero)."""
    s = m.sum(axis=-1, keepdims=True)
    return np.divide(m, s, out=np.zeros(m.shape, dtype=np.float64), where=s > 0)


class EAMCollection:
    """A fixed-capacity set of request-level EAMs.

    Args:
        capacity: rows kept.
        num_layers, num_experts: L, J.
        replacement: ``similar`` (replace the most cosine-similar row, paper) or
            ``least_accessed`` (the row matched fewest times, oss; ties: lowest index).
    """

    def __init__(self, capacity: int, num_layers: int, num_experts: int,
                 replacement: Literal["similar", "least_accessed"]) -> None:
        self.capacity, self.L, self.J = capacity, num_layers, num_experts
        self.replacement = replacement
        self.eams = np.zeros((capacity, num_layers, num_experts))
        self.flat_n = np.zeros((capacity, num_layers * num_experts))
        self.rows_n = np.zeros((capacity, num_layers, num_experts))
        self.access = np.zeros(capacity, dtype=np.int64)
        self.size = 0
        self.version = 0  # bumped by every insertion
        # first layer -> rows_n[:size, first:] as one C-contiguous [size, (L - first)·J]
        # matrix (what match_unit_rows multiplies), for the collection's version
        self._suffix: dict[int, np.ndarray] = {}
        self._suffix_version = -1

    def add(self, eam: np.ndarray) -> int:
        """Insert ``eam`` (float[L, J]); returns the slot it went to."""
        eam = np.asarray(eam, dtype=np.float64)
        flat = unit(eam.reshape(1, -1))[0]
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
        elif self.replacement == "similar":
            slot = int(np.argmax(self.flat_n @ flat))
        else:
            slot = int(np.argmin(self.access))
        self.eams[slot] = eam
        self.flat_n[slot] = flat
        self.rows_n[slot] = unit(eam)
        self.access[slot] = 1
        self.version += 1
        return slot

    def match_flat(self, query: np.ndarray, top_n: int) -> np.ndarray:
        """int64[≤top_n]: rows of highest cosine with the flattened ``query`` (best first)."""
        sims = self.flat_n[: self.size] @ unit(query.reshape(1, -1))[0]
        n = min(top_n, self.size)
        if n == 1:
            return np.array([int(sims.argmax())])
        top = np.argpartition(-sims, n - 1)[:n]
        return top[np.argsort(-sims[top], kind="stable")]

    def _suffix_rows(self, first_layer: int) -> np.ndarray:
        """float64[size, (L - first_layer)·J]: the stored unit rows of layers
        ``first_layer..L−1``, C-contiguous (the copy ``reshape`` makes of the strided
        suffix, kept per collection version while all suffixes fit :data:`SUFFIX_BYTES`)."""
        if self._suffix_version != self.version:
            self._suffix, self._suffix_version = {}, self.version
        got = self._suffix.get(first_layer)
        if got is None:
            got = self.rows_n[: self.size, first_layer:].reshape(self.size, -1)
            if self.size * self.L * (self.L + 1) * self.J * 4 <= SUFFIX_BYTES:  # all of them
                self._suffix[first_layer] = got
        return got

    def match_layer_mean(self, query: np.ndarray, first_layer: int) -> int:
        """Row of highest mean per-layer cosine over layers ``first_layer..L−1`` (oss)."""
        return self.match_unit_rows(unit(query[first_layer:]), first_layer)

    def match_unit_rows(self, q_rows: np.ndarray, first_layer: int) -> int:
        """:meth:`match_layer_mean` of a query whose layers ``first_layer..L−1`` are already
        unit rows (float64[L − first_layer, J]; ``unit`` is row-wise, so the suffix of a
        whole query's unit rows is the unit rows of its suffix, bit for bit)."""
        q = q_rows.reshape(-1)  # [L'·J]
        sims = self._suffix_rows(first_layer) @ q  # Σ over layers of per-layer cosines
        row = int(sims.argmax())
        self.access[row] += 1
        return row

    def suffix_winners(self, q_units: np.ndarray) -> list[int | None]:
        """For every first layer f = 0..L−1, the row :meth:`match_unit_rows` returns for
        ``q_units[f:]`` (float64[L, J], non-negative unit rows), or None where this cannot
        tell it apart from another row; counts no access.

        One pass over the collection instead of a matrix-vector product per layer: the
        per-layer cosines of every row, summed from the last layer back (float64[size, L]).
        That sum and the BLAS product of :meth:`match_unit_rows` add the same n ≤ L·J
        non-negative products (each sum ≤ L: cosines) in different orders, so each lies
        within γ_n·L ≈ n·u·L of the exact value (u = 2^-53). A row that leads every other by
        more than 8·n·u·L (twice the 4·γ_n·L the two errors can close) is the product's
        unique argmax too; a nearer race (e.g. two equal stored EAMs) is left to the exact
        product (None)."""
        n_rows = self.size
        per_layer = np.einsum("slj,lj->sl", self.rows_n[:n_rows], q_units)  # [size, L]
        sims = np.cumsum(per_layer[:, ::-1], axis=1)[:, ::-1]  # [size, f]: Σ over layers ≥ f
        best = sims.argmax(axis=0)  # [L]
        if n_rows == 1:
            return [0] * self.L
        cols = np.arange(self.L)
        top = sims[best, cols]
        sims[best, cols] = -np.inf
        margin = top - sims.max(axis=0)
        tol = 8.0 * _U * self.L * self.J * self.L
        return [int(b) if m > tol else None for b, m in zip(best.tolist(), margin.tolist(),
                                                                strict=True)]


@PREDICTORS.register("eam")
class EAMPredictor(Predictor):
    """MoE-Infinity (``variant: paper|oss``). Config keys:

    Args:
        dims: trace dimensions.
        variant: ``paper`` (default) or ``oss``.
        capacity: EAMs per collection (None: 120 for paper, 1000 for oss).
        top_n: nearest EAMs combined into the pEAM (paper variant; oss always uses 1).
        max_prefetch: prefetch requests per hook (None: J).
        online_update: add each finished request's EAMs to the collection(s).
        oss_prefetch: oss variant only; False disables prefetching (the release's Mixtral
            and DeepSeek behaviour).
        per_layer: None (default), an int >= 1 or ``"top_k"`` (the model's K): only the
            best ``per_layer`` experts of each future layer are prefetched, and
            ``max_prefetch`` None then means every one of them (module docstring: the
            artifact's MoE-Infinity).
    """

    def __init__(self, *, dims: TraceDims, variant: Variant = "paper", capacity: int | None = None,
                 top_n: int = 1, max_prefetch: int | None = None, online_update: bool = True,
                 oss_prefetch: bool = True, per_layer: int | str | None = None) -> None:
        super().__init__(dims=dims)
        if variant not in DEFAULT_CAPACITY:
            raise ConfigError(f"predictor=eam: variant={variant!r}; valid: paper, oss")
        self.per_layer = _per_layer(per_layer, dims)
        cap = DEFAULT_CAPACITY[variant] if capacity is None else int(capacity)
        limit = (int(max_prefetch) if max_prefetch is not None else dims.num_experts
                 if self.per_layer is None else dims.num_layers * dims.num_experts)
        if cap < 1 or top_n < 1 or limit < 0:
            raise ConfigError(f"predictor=eam: capacity={cap}, top_n={top_n}, max_prefetch="
                              f"{limit}; need capacity >= 1, top_n >= 1, max_prefetch >= 0")
        self.variant: Variant = variant
        self.top_n = 1 if variant == "oss" else int(top_n)
        self.max_prefetch = limit
        self.online_update = bool(online_update)
        self.prefetch_enabled = variant == "paper" or bool(oss_prefetch)
        L, J = dims.num_layers, dims.num_experts
        phases = ("prefill", "decode") if variant == "paper" else ("all",)
        repl: Literal["similar", "least_accessed"] = (
            "similar" if variant == "paper" else "least_accessed")
        self.collections = {p: EAMCollection(cap, L, J, repl) for p in phases}
        self._req: dict[int, dict[str, np.ndarray]] = {}  # request -> phase -> EAM so far
        self._units = np.zeros(0, dtype=np.int64)
        self._groups: list[np.ndarray] = []
        self._phase = phases[0]
        self._iter = np.zeros((0, L, J))
        # paper preview: (the previewed counts, per layer the matched rows or None)
        self._pre: tuple[list[np.ndarray], list[tuple[int, ...] | None]] | None = None
        # bool[L-1, L, 1]: [l, row] = row <= l (the rows a query after layer l has seen)
        self._upto = np.arange(L - 1)[:, None, None] >= np.arange(L)[None, :, None]
        # oss preview: (the previewed counts, unit rows of the request's EAM at the pass
        # start, per layer whether the query after it is non-zero, per first layer the
        # match where EAMCollection.suffix_winners could tell it)
        self._pre_oss: tuple[list[np.ndarray], np.ndarray, list[bool],
                             list[int | None]] | None = None
        self._sent: tuple[object, ...] = ()  # what the latest cache hints were computed from
        # one-request hooks: (phase, collection version, matched rows, layer) -> that
        # hook's Prediction with the cache hints and without them, a function of those
        # alone (cleared as versions move; shared: callers only read a Prediction)
        self._memo: dict[tuple[object, ...], tuple[Prediction, Prediction]] = {}
        # _decay[now + 1][i - now - 1] = decay of future layer i seen from layer now (-1..L-1)
        span = float(L) if variant == "paper" else float(L + 1)
        self._decay = [(1.0 - (np.arange(now + 1, L) - now) / span)[:, None]
                       for now in range(-1, L)]

    # ------------------------------------------------------------------ learning
    def _phase_of(self, step: int) -> str:
        if self.variant == "oss":
            return "all"
        return "prefill" if step == 0 else "decode"

    def fit(self, store: Trace) -> None:
        """Pre-fill the collection(s) with the request EAMs of the store split (only)."""
        if any(r.split != "store" for r in store.requests):
            log.warning("eam.fit: ignoring non-store requests")
            store = store.split("store")
        L, J = self.dims.num_layers, self.dims.num_experts
        if (store.dims.num_layers, store.dims.num_experts) != (L, J):
            raise ConfigError(f"eam: trace has L={store.dims.num_layers}, J="
                              f"{store.dims.num_experts}; predictor built for L={L}, J={J}")
        lens = np.diff(store.iter_offsets)
        phase = np.array([self._phase_of(int(s)) for s in store.iter_step])
        for rid in [r.request_id for r in store.requests]:
            for p in self.collections:
                its = np.flatnonzero((store.iter_request == rid) & (phase == p))
                if len(its) == 0:
                    continue
                rows = np.concatenate([np.arange(store.iter_offsets[i], store.iter_offsets[i]
                                                 + lens[i]) for i in its])
                self.collections[p].add(self._counts(store.topk_idx[rows].astype(np.int64)))
        log.info("eam: collection pre-filled: %s",
                 {p: c.size for p, c in self.collections.items()})

    def _counts(self, topk_idx: np.ndarray) -> np.ndarray:
        """float64[L, J] token counts from int[T, L, K] selected experts."""
        L, J = self.dims.num_layers, self.dims.num_experts
        flat = (np.arange(L)[None, :, None] * J + topk_idx).reshape(-1)
        return np.bincount(flat, minlength=L * J).reshape(L, J).astype(np.float64)

    # ------------------------------------------------------------------ hooks
    def start_iteration(self, ctx: IterationStart) -> Prediction:
        self._units, self._groups = unit_rows(np.asarray(ctx.token_request))
        self._phase = self._phase_of(int(ctx.step))
        L, J = self.dims.num_layers, self.dims.num_experts
        self._iter = np.zeros((len(self._units), L, J))
        self._pre = self._pre_oss = None
        for r in self._units:
            self._req.setdefault(int(r), {p: np.zeros((L, J)) for p in self.collections})
        return self._predict(layer=-1)

    previews = True

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """``variant: paper``, one request: every layer's ``match_flat`` of the pass at once.

        The query after layer l is the request's EAM so far plus this pass's counts of
        layers 0..l (the same sums as in :meth:`_predict_one`); their unit rows are matched
        by one stacked matmul (one matrix-vector product per layer, as there) and an argmax
        per layer, so every match is bit-identical."""
        self._pre = self._pre_oss = None
        L = self.dims.num_layers
        coll = self.collections[self._phase]
        if (self.top_n != 1 or len(self._units) != 1 or not self.prefetch_enabled
                or coll.size == 0 or len(obs) != L or self._iter.any()):
            return
        if self.variant == "oss":
            self._preview_oss(obs)
            return
        counts = [o.counts for o in obs]
        req = self._req[int(self._units[0])][self._phase]
        after = req + np.asarray(counts, dtype=np.float64)  # rows once observed: req + counts
        queries = np.where(self._upto, after[None], req[None])  # [L-1, L, J]
        live: list[bool] = np.asarray(queries.reshape(L - 1, -1).any(axis=1)).tolist()
        q = unit(queries.reshape(L - 1, -1))  # [L-1, L*J] unit rows
        sims = np.matmul(coll.flat_n[: coll.size][None], q[:, :, None])[:, :, 0]
        best = sims.argmax(axis=1)
        rows: list[tuple[int, ...] | None] = [(r,) if ok else None
                                             for r, ok in zip(best.tolist(), live, strict=True)]
        self._pre = (counts, rows)

    def _preview_oss(self, obs: Sequence[LayerObservation]) -> None:
        """``variant: oss``, one request: the query after layer l is the request's EAM so far
        plus this pass's counts of layers 0..l, and its match reads layers l+1.. only, which
        no layer of this pass has changed yet: their unit rows are the EAM's, computed once
        per pass instead of once per layer (the same rows, bit for bit), and so are the
        matches of every layer, wherever no near-tie needs the exact product."""
        counts = [o.counts for o in obs]
        req = self._req[int(self._units[0])][self._phase]
        seen = bool(np.count_nonzero(req))
        live: list[bool] = []
        for c in counts:  # the query after layer l is non-zero: the EAM or counts 0..l
            seen = seen or bool(np.count_nonzero(c))
            live.append(seen)
        q_units = unit(req)
        winners = self.collections[self._phase].suffix_winners(q_units)
        self._pre_oss = (counts, q_units, live, winners)

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        layer = obs.layer
        pre = self._pre
        if pre is not None and (layer >= len(pre[0]) or pre[0][layer] is not obs.counts):
            self._pre = pre = None  # not what was previewed: match as without a preview
        oss = self._pre_oss
        if oss is not None and (layer >= len(oss[0]) or oss[0][layer] is not obs.counts):
            self._pre_oss = None
        if len(self._groups) == 1:
            self._iter[0, layer] = obs.counts
        else:
            K, J = self.dims.top_k, self.dims.num_experts
            top = np.argsort(-np.asarray(obs.probs), axis=1, kind="stable")[:, :K]
            for b, g in enumerate(self._groups):
                self._iter[b, layer] = np.bincount(top[g].ravel(), minlength=J)
        return self._predict(layer)

    def end_iteration(self) -> None:
        for b, r in enumerate(self._units):
            self._req[int(r)][self._phase] += self._iter[b]
        self._iter[:] = 0

    def end_request(self, request_id: int) -> None:
        eams = self._req.pop(int(request_id), None)
        if not self.online_update or eams is None:
            return
        for p, m in eams.items():
            if m.any():
                self.collections[p].add(m)

    # ------------------------------------------------------------------ prediction
    def _predict(self, layer: int) -> Prediction:
        """Scores for layers > ``layer`` from the current queries (layer = −1 at start)."""
        coll = self.collections[self._phase]
        L = self.dims.num_layers
        if not self.prefetch_enabled or coll.size == 0 or layer >= L - 1:
            return Prediction()
        if len(self._units) == 1:
            return self._predict_one(layer, coll)
        peams, scores, matched = [], [], []
        for b, r in enumerate(self._units):
            query = self._req[int(r)][self._phase] + self._iter[b]
            if not query.any():
                continue
            rows = self._match(coll, query, layer)
            peam, score = self._matched_parts(coll, rows, layer)
            peams.append(peam)
            scores.append(score)
            matched.append(tuple(rows.tolist()))
        if not peams:
            return Prediction()
        # the pEAM is a function of the matched rows: resend the cache hints only on change
        sent = (self._phase, coll.version, tuple(matched))
        hints, self._sent = sent != self._sent, sent
        return self._prediction(layer, peams, scores, hints)

    def _match(self, coll: EAMCollection, query: np.ndarray, layer: int) -> np.ndarray:
        """Matched rows of ``query`` (float64[L, J]) seen from layer ``layer``."""
        if self.variant == "paper":
            return coll.match_flat(query, self.top_n)
        return np.array([coll.match_layer_mean(query, layer + 1)])

    def _matched_parts(self, coll: EAMCollection, rows: np.ndarray,
                       layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(the pEAM [L, J], the future layers' scores [L - layer - 1, J]) of ``rows``."""
        decay = self._decay[layer + 1]
        if self.variant == "paper":
            peam = normalize_rows(coll.eams[rows].sum(axis=0))
            return peam, peam[layer + 1 :] * decay
        raw = coll.eams[rows[0]]
        return normalize_rows(raw), raw[layer + 1 :] * decay

    def _predict_one(self, layer: int, coll: EAMCollection) -> Prediction:
        """:meth:`_predict` for a batch of one request: the match is searched at every
        hook, what it implies is memoised per (phase, collection version, rows, layer):
        the Prediction itself, shared between hooks (read-only arrays)."""
        pre = self._pre
        matched: tuple[int, ...]  # the matched rows, best first
        if pre is not None and layer >= 0:  # previewed (paper): the same match, computed
            got_rows = pre[1][layer]
            if got_rows is None:  # an all-zero query
                return Prediction()
            matched = got_rows
        elif self._pre_oss is not None and layer >= 0:  # previewed (oss): the unit rows
            _, unit_rows, live, winners = self._pre_oss
            if not live[layer]:
                return Prediction()
            row = winners[layer + 1]
            if row is None:  # a near-tie: the exact product decides
                row = coll.match_unit_rows(unit_rows[layer + 1:], layer + 1)
            else:
                coll.access[row] += 1  # as match_unit_rows counts its match
            matched = (row,)
        else:
            query = self._req[int(self._units[0])][self._phase] + self._iter[0]
            if not np.count_nonzero(query):  # query.any(), without its Python wrapper
                return Prediction()
            matched = tuple(self._match(coll, query, layer).tolist())
        sent = (self._phase, coll.version, (matched,))
        hints, self._sent = sent != self._sent, sent
        key = (self._phase, coll.version, matched, layer)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= MEMO_ENTRIES:  # stale versions' entries go too
                self._memo.clear()
            peam, score = self._matched_parts(coll, np.array(matched, dtype=np.int64), layer)
            peam.setflags(write=False)
            full = self._prediction(layer, [peam], [score], True)
            for a in full.predicted.values():
                a.setflags(write=False)
            got = self._memo[key] = (full, Prediction(prefetch=full.prefetch,
                                                      predicted=full.predicted))
        return got[0] if hints else got[1]

    def _prediction(self, layer: int, peams: list[np.ndarray], scores: list[np.ndarray],
                    hints: bool) -> Prediction:
        """Prefetches (best ``max_prefetch`` scores over all future layers) and hints.

        ``predicted`` names only layer ``layer + 1``: the last prediction made before that
        layer runs (the following hooks refine the later layers), top-K by score. With a
        batch, the per-expert maximum over its requests is used.
        """
        J, K = self.dims.num_experts, self.dims.top_k
        peam = peams[0] if len(peams) == 1 else np.max(peams, axis=0)
        score = scores[0] if len(scores) == 1 else np.max(scores, axis=0)
        pred = Prediction(scores=dict(enumerate(peam)) if hints else {})
        nxt: set[int] = set()
        for s in scores:
            top = np.argsort(-s[0], kind="stable")[:K]
            nxt.update(int(e) for e in top[s[0][top] > 0])
        pred.predicted[layer + 1] = np.array(sorted(nxt), dtype=np.int64)
        if self.per_layer is not None and self.per_layer < J:  # the artifact: top-N per layer
            score = self._best_per_layer(score)
        flat = score.reshape(-1)
        n = min(self.max_prefetch, int(np.count_nonzero(flat > 0)))
        if n:
            # descending score; ties: nearer layer, then lower expert (stable on flat order)
            best = np.argsort(-flat, kind="stable")[:n]
            pred.prefetch = [Prefetch(float(flat[f]), layer + 1 + int(f) // J, int(f) % J)
                             for f in best]
        return pred

    def _best_per_layer(self, score: np.ndarray) -> np.ndarray:
        """``score`` (float[F, J], future layers) with all but each row's best
        ``per_layer`` zeroed; ties at the cut go to the lower expert index."""
        n = self.per_layer
        assert n is not None
        cut = np.sort(score, axis=1)[:, -n][:, None]
        above = score > cut
        at = (score == cut) & (score > 0)
        room = n - above.sum(axis=1, keepdims=True)
        keep = above | (at & (np.cumsum(at, axis=1) <= room))
        return np.where(keep, score, 0.0)

    def stats(self) -> dict[str, float]:
        return {f"eam_collection_{p}": float(c.size) for p, c in self.collections.items()}
