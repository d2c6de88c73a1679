"""Per-expert reuse features and their calibrated logistic models (``reuse_prob``'s parts).

Every routed expert ``(l, e)`` carries a small state, updated each time layer l runs:

* ``last[l, e]``: 1 if the last pass used it at layer l, else 0;
* ``fast[l, e]``, ``slow[l, e]``: exponential averages of that 0/1 use (decays
  :data:`FAST` and :data:`SLOW` per pass: recency and frequency);
* ``rec[l, e]``: passes of layer l since it was last used (1: the last pass; a never-used
  expert :data:`REC_CAP`): recency with the reach the averages lack (``fast`` is ~0 after
  ten passes, while a 50 % cache keeps experts unused for a hundred);
* ``logpop[l, e]``: log of its share of the store split's decode passes (popularity).

Two kinds of probability come out of it, each a logistic regression fitted on the store
split only (Platt's calibration, with the features as the score):

* ``next``: P(expert used at its layer's next pass | state): what eviction needs for a layer
  that already ran in the current pass, and for every layer before the pass starts. Its
  features (:func:`next_features`) add log(rec) to the four of the ``ahead`` models unless
  fitted with ``recency=False``, and, unless fitted with ``follow=False``, the token-to-token
  evidence ``log(max(u M_l / |u|, EPS))``: u the layer's last pass's experts (``last``), M_l
  the store's per-layer *follow* matrix, P(e used at the next pass | e' used at this one),
  the same layer (:func:`follow_matrices`; where the last pass used nothing, or for a pass
  whose routing is not known yet, the store's marginal ``prior``). The tiny model's routing
  barely repeats an expert from one token to the next (``last`` alone: test AUC 0.66) but
  strongly follows one expert with another (0.75 with this column; real gpt-oss-20b 0.857 ->
  0.880, issue 27's sixth stage).
* ``within[h]`` (h in :data:`HORIZONS`, fitted with ``horizons``): P(expert used at one of
  its layer's next h passes | state), on the ``next`` model's features and rows: what the
  ``next_use`` cache ranks eviction by when an expert's next pass alone says too little
  (issue 27's seventh stage: an expert the next token will not route to may be needed two
  tokens later, and a cache holds an expert for several passes).
* ``ahead[d]`` (d = 1..D, and separately for single-token decode and multi-token prefill
  passes): P(used at layer l + d of this pass | state of l + d, the pass's observed routing at
  layer l), the router's evidence entering through ``log(v_l P_l ... P_{l+d-1})``: layer
  l's token distribution carried d layers by the store's layer transition matrices
  (:func:`moeexp.predictors.layer_transition.transition_counts`), and, where the trace
  records speculative gates (``spec_probs``, d <= its ``spec_depth``), the hidden state's
  evidence too: the share of the pass's tokens whose speculative top-K at distance d holds
  the expert, and the log of its mean speculative probability (:func:`spec_features`; the
  same gates ``speculative_gate``/``promoe`` read). Without gates those two columns are 0.

The fit walks the store requests in their order through the same state updates the replay
makes, so a feature means the same at fit and at query time. Shapes: L layers, J experts,
F features. Units: probabilities; no time here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.trajectory_index import MAX_ROWS as KNN_ROWS
from moeexp.predictors.trajectory_index import TrajectoryIndex
from moeexp.traces.schema import Trace

FAST = 0.5  #: decay per pass of the recency average
SLOW = 0.9  #: decay per pass of the frequency average
EPS = 1e-3  #: floor of a carried transition probability before its log
MAX_ROWS = 300_000  #: rows per fitted model (passes are strided to stay under it)
REC_CAP = 1024  #: recency of an expert never used yet (passes)
HORIZONS = (2, 4, 8, 16)  #: h of the ``within[h]`` models (passes; h = 1 is ``next``)
MAX_HORIZON = 254  #: longest h: the kNN's waits are stored as uint8, capped at max(h)


@dataclass
class ReuseState:
    """The running feature state: ``feat`` float64[3, L, J] = (last, fast, slow) (see the
    module docstring), one array so that a model reads several layers in one product, and
    ``rec`` float64[L, J], passes since the last use."""

    feat: np.ndarray
    rec: np.ndarray

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> ReuseState:
        return cls(np.zeros((3, num_layers, num_experts)),
                   np.full((num_layers, num_experts), float(REC_CAP)))

    @property
    def last(self) -> np.ndarray:
        return self.feat[0]

    @property
    def fast(self) -> np.ndarray:
        return self.feat[1]

    @property
    def slow(self) -> np.ndarray:
        return self.feat[2]

    def update(self, layer: int, used: np.ndarray) -> None:
        """Layer ``layer`` ran; ``used``: float64[J] 0/1 (or bool) of the experts it used."""
        f = self.feat
        f[0, layer] = used
        f[1, layer] = FAST * f[1, layer] + (1.0 - FAST) * used
        f[2, layer] = SLOW * f[2, layer] + (1.0 - SLOW) * used
        self.rec[layer] = np.where(used > 0, 1.0, np.minimum(self.rec[layer] + 1.0, REC_CAP))

    def update_all(self, used: np.ndarray) -> None:
        """Every layer ran; ``used``: float64[L, J] 0/1."""
        f = self.feat
        f[0] = used
        f[1] = FAST * f[1] + (1.0 - FAST) * used
        f[2] = SLOW * f[2] + (1.0 - SLOW) * used
        self.rec = np.where(used > 0, 1.0, np.minimum(self.rec + 1.0, REC_CAP))


@dataclass
class Follow:
    """The ``next`` model's token-to-token evidence, fitted on the store split:
    ``matrix`` float64[L, J, J], P(e at the next pass | e' at this one) of each layer;
    ``prior`` float64[L, J], its feature where the last pass is unknown (log of the
    popularity-weighted row mix)."""

    matrix: np.ndarray
    prior: np.ndarray

    def feature(self, last: np.ndarray, rows: slice | int = slice(None)) -> np.ndarray:
        """float64[..., J]: log(max(u M / |u|, EPS)) of layers ``rows`` for ``last`` =
        u float64[..., J] 0/1 (the layers' last pass); ``prior`` where u is empty."""
        m = self.matrix[rows]
        if last.ndim == 1:  # one layer (every layer step): the same numbers, fewer calls
            k1 = float(np.add.reduce(last))
            if k1 > 0:
                return np.log(np.maximum((last @ m) / k1, EPS))
            return self.prior[rows].copy()
        k = last.sum(axis=-1, keepdims=True)
        p = np.einsum("...j,...jk->...k", last, m)
        f = np.log(np.maximum(p / np.where(k > 0, k, 1.0), EPS))
        return np.where(k > 0, f, self.prior[rows])


def follow_matrices(passes: list[tuple[np.ndarray, int]], logpop: np.ndarray,
                    alpha: float = 1.0) -> Follow:
    """The :class:`Follow` of consecutive passes ``passes`` ((used float64[L, J] 0/1,
    tokens) each, the store split in replay order; a pair whose second pass has several
    tokens is skipped, as the ``next`` model is fitted on single-token passes only): counts
    of (e' at pass n, e at pass n + 1) per layer, each row smoothed toward the popularity
    (``alpha`` pseudo passes) and normalised."""
    L, J = logpop.shape
    C = np.zeros((L, J, J))
    rows = np.zeros((L, J))
    for (a, _), (b, tokens) in zip(passes[:-1], passes[1:], strict=True):
        if tokens != 1:
            continue
        C += a[:, :, None] * b[:, None, :]
        rows += a
    pop = np.exp(logpop)
    M = (C + alpha * pop[:, None, :]) / (rows[..., None] + alpha)
    prior_p = np.einsum("lj,ljk->lk", pop, M) / pop.sum(axis=-1, keepdims=True)
    return Follow(M, np.log(np.maximum(prior_p, EPS)))


@dataclass
class Logistic:
    """``sigmoid(X @ coef + intercept)``; coef float64[F]."""

    coef: np.ndarray
    intercept: float

    def __call__(self, X: np.ndarray) -> np.ndarray:
        """float64[..., F] -> probabilities float64[...]."""
        return sigmoid(X @ self.coef + self.intercept)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """The logistic function of ``z`` (clipped to +-30: no overflow; the clip as two ufuncs,
    the same numbers as ``np.clip`` without its per-call overhead)."""
    return 1.0 / (1.0 + np.exp(-np.minimum(np.maximum(z, -30.0), 30.0)))


def fit_logistic(X: np.ndarray, y: np.ndarray, n_features: int) -> Logistic:
    """Platt-style calibration: a logistic regression of ``y`` (0/1 float[N]) on ``X``
    (float[N, F]) with scikit-learn; with one class only, a constant at its rate."""
    if len(y) == 0:
        return Logistic(np.zeros(n_features), 0.0)
    rate = float(np.mean(y))
    if rate in (0.0, 1.0):
        return Logistic(np.zeros(n_features), 30.0 if rate else -30.0)
    from sklearn.linear_model import LogisticRegression  # fit time only

    m = LogisticRegression(C=1.0, max_iter=300).fit(X, y)
    return Logistic(m.coef_[0].astype(np.float64), float(m.intercept_[0]))


def next_features(state: ReuseState, logpop: np.ndarray, rows: slice | int = slice(None),
                  recency: bool = True, unused: bool = False,
                  follow: Follow | None = None,
                  follow_col: np.ndarray | None = None,
                  knn_col: np.ndarray | None = None) -> np.ndarray:
    """float64[..., J, 6] (last, fast, slow, logpop, log rec, follow) of layers ``rows``, the
    ``next`` model's features (without log rec when not ``recency``, without the follow
    column without ``follow``); ``unused``: as they will be after a pass of those layers
    that does not use the expert (last 0, the averages decayed once, one pass older; that
    pass's other experts unknown: the follow column is the prior). ``follow_col``: the
    follow column of these rows if the caller has it already (not recomputed).
    ``knn_col``: the trajectory kNN column of these rows (:mod:`moeexp.predictors.
    trajectory_index`), appended last; None: no such column."""
    f = state.feat
    if unused:
        cols = [np.zeros_like(f[0, rows]), FAST * f[1, rows], SLOW * f[2, rows], logpop[rows]]
        rec = np.minimum(state.rec[rows] + 1.0, REC_CAP)
    else:
        cols = [f[0, rows], f[1, rows], f[2, rows], logpop[rows]]
        rec = state.rec[rows]
    if recency:
        cols.append(np.log(rec))
    if follow is not None:
        if follow_col is None:
            follow_col = follow.prior[rows] if unused else follow.feature(f[0, rows], rows)
        cols.append(follow_col)
    if knn_col is not None:
        cols.append(knn_col)
    out = np.empty(np.shape(cols[0]) + (len(cols),))  # np.stack(cols, axis=-1), fewer calls
    for i, col in enumerate(cols):
        out[..., i] = col
    return out


def state_features(state: ReuseState, logpop: np.ndarray,
                   rows: slice | int = slice(None)) -> np.ndarray:
    """float64[..., J, 4]: (last, fast, slow, logpop) of layers ``rows``."""
    return np.stack([state.last[rows], state.fast[rows], state.slow[rows], logpop[rows]],
                    axis=-1)


def carried(counts: np.ndarray, chain: np.ndarray) -> np.ndarray:
    """float64[..., J]: log(max(v @ M, EPS)), v = counts / sum(counts) (int[..., J]),
    M = chain float64[..., J, J] (the d-step transition of the layer)."""
    tot = counts.sum(axis=-1, keepdims=True)
    v = counts / np.where(tot > 0, tot, 1.0)
    if v.ndim == 1:
        return np.log(np.maximum(v @ chain, EPS))
    return np.log(np.maximum(np.einsum("...j,...jk->...k", v, chain), EPS))


def spec_features(spec: np.ndarray | None, top_k: int) -> np.ndarray | None:
    """float64[..., J, 2] from speculative gate probabilities ``spec`` float[T, ..., J]
    (T tokens): (share of the tokens whose top-``top_k`` holds the expert, log(max(mean
    probability over the tokens, EPS))); None when ``spec`` is None."""
    if spec is None:
        return None
    s = np.asarray(spec, dtype=np.float64)
    T, J = s.shape[0], s.shape[-1]
    k = min(max(int(top_k), 1), J)
    kth = np.partition(s, J - k, axis=-1)[..., J - k:J - k + 1]
    out = np.empty((*s.shape[1:], 2))
    # the means over the tokens written as np.mean computes them (a sum, then / T): the
    # same numbers without its per-call overhead (this runs at every layer)
    out[..., 0] = np.add.reduce(s >= kth, axis=0, dtype=np.float64) / T
    out[..., 1] = np.log(np.maximum(np.add.reduce(s, axis=0) / T, EPS))
    return out


@dataclass
class ReuseModels:
    """The fitted models: ``next`` (decode passes) and ``ahead[(kind, d)]``, kind 0 =
    single-token pass, 1 = multi-token pass; ``chains[d - 1]``: float64[L - d, J, J];
    ``logpop``: float64[L, J]."""

    next: Logistic
    ahead: dict[tuple[int, int], Logistic] = field(default_factory=dict)
    chains: list[np.ndarray] = field(default_factory=list)
    logpop: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    follow: Follow | None = None  #: the ``next`` model's follow evidence (None: not read)
    #: h -> P(used within the next h passes), on the ``next`` model's features (empty: none)
    within: dict[int, Logistic] = field(default_factory=dict)
    rows: int = 0  #: training rows over all models
    spec_depth: int = 0  #: distances d <= this have speculative features (0: none)
    #: the ``next`` model's trajectory kNN evidence (its last feature; None: not read)
    knn: TrajectoryIndex | None = None
    #: with ``knn``: ``next`` and ``within`` fitted on the same rows without the kNN column,
    #: for a pass that has no kNN row (a decode pass of several requests; None: no kNN)
    plain: tuple[Logistic, dict[int, Logistic]] | None = None


def carried_steps(counts: np.ndarray, trans: np.ndarray, n: int) -> np.ndarray:
    """float64[n, J]: :func:`carried` for d = 1..n out of one layer, one matrix at a time
    (no d-step products stored): ``counts`` int[J] of the layer, ``trans`` float64[>= n, J,
    J] the transitions out of it and the next layers."""
    tot = counts.sum()
    cur = counts / (tot if tot > 0 else 1.0)
    out = np.empty((n, counts.shape[-1]))
    for d in range(n):
        cur = cur @ trans[d]
        out[d] = np.log(np.maximum(cur, EPS))
    return out


def _carried_all(counts: np.ndarray, trans: np.ndarray, n: int) -> list[np.ndarray]:
    """[float64[L - d, J] for d = 1..n]: :func:`carried_steps` of every layer of a pass
    (``counts`` int[L, J]) at once."""
    tot = counts.sum(axis=-1, keepdims=True)
    cur = (counts / np.where(tot > 0, tot, 1.0))[:-1]
    out: list[np.ndarray] = []
    for d in range(1, n + 1):
        cur = np.einsum("lj,ljk->lk", cur if d == 1 else cur[:-1], trans[d - 1:])
        out.append(np.log(np.maximum(cur, EPS)))
    return out


def chain_matrices(trans: np.ndarray, depth: int) -> list[np.ndarray]:
    """``trans`` float64[L-1, J, J] row-stochastic -> [M_1, ..., M_depth], M_d float64[L-d,
    J, J]: M_d[l] = P_l P_{l+1} ... P_{l+d-1}."""
    out: list[np.ndarray] = []
    cur = trans
    for d in range(1, depth + 1):
        if d > 1:
            cur = np.einsum("lij,ljk->lik", cur[:-1], trans[d - 1:])
        out.append(cur)
    return out


def _pass_used(store: Trace, it: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(used float64[L, J] 0/1, counts int64[L, J], tokens) of iteration ``it``."""
    sl = store.token_slice(it)
    idx = store.topk_idx[sl].astype(np.int64)  # [T, L, K]
    T, L, _ = idx.shape
    J = store.dims.num_experts
    flat = (np.arange(L)[None, :, None] * J + idx).reshape(-1)
    counts = np.bincount(flat, minlength=L * J).reshape(L, J)
    return (counts > 0).astype(np.float64), counts, T


def passes_until_use(used: list[np.ndarray], rows: list[int]) -> dict[int, np.ndarray]:
    """For each pass index n in ``rows``: float64[L, J], the passes from n to the first pass
    >= n that uses (l, e) (0: pass n itself; inf: none up to the end), over the consecutive
    passes ``used`` (float64[L, J] 0/1 each)."""
    want = set(rows)
    nxt = np.full(used[0].shape, np.inf) if used else np.zeros((0, 0))
    out: dict[int, np.ndarray] = {}
    for n in range(len(used) - 1, -1, -1):
        nxt[used[n] > 0] = n
        if n in want:
            out[n] = nxt - n
    return out


def store_iterations(store: Trace) -> list[int]:
    """The store split's iterations in request order (the replay's order); ConfigError if
    ``store`` holds a request of another split (a fit must never see a test request)."""
    bad = [r.request_id for r in store.requests if r.split != "store"]
    if bad:
        raise ConfigError(f"reuse_prob: fit() got {len(bad)} request(s) outside the store "
                          f"split (e.g. {bad[:3]}): pass trace.split('store')")
    return [int(i) for r in store.requests for i in store.request_iterations(r.request_id)]


def _spec_block(store: Trace, it: int, d: int, spec_depth: int, L: int,
                J: int) -> np.ndarray:
    """float64[L - d, J, 2]: the speculative features of iteration ``it`` for every layer l
    predicting l + d (zeros past the recorded ``spec_depth``)."""
    if d > spec_depth:
        return np.zeros((L - d, J, 2))
    spec = store.spec_probs[store.token_slice(it), :L - d, d - 1]  # type: ignore[index]
    return spec_features(spec, store.dims.top_k)  # type: ignore[return-value]


def fit_models(store: Trace, trans: np.ndarray, depth: int, use_spec: bool = False,
               prefill_depth: int = 0, recency: bool = True, follow: bool = True,
               horizons: tuple[int, ...] = (), knn: bool = False, knn_within: bool = True,
               knn_ahead: bool = False, knn_rows: int = KNN_ROWS) -> ReuseModels:
    """Walk ``store`` (store split only) and fit ``next`` and every ``ahead[(kind, d)]``
    (with the speculative features when ``use_spec`` and the store records gates):
    d <= ``depth`` for single-token passes, d <= max(depth, ``prefill_depth``) for
    multi-token ones (their evidence carried one matrix at a time: :func:`carried_steps`);
    ``next`` on :func:`next_features` (with log rec when ``recency``, with the follow
    evidence of :func:`follow_matrices` when ``follow``), and ``within[h]`` for each h in
    ``horizons`` on the same rows (the label: used at one of the passes n .. n + h - 1 of
    the store split's sequence, :func:`passes_until_use`). ``knn``, ``knn_within``,
    ``knn_ahead``: the trajectory kNN columns (:class:`TrajectoryIndex` of at most ``knn_rows``
    store decode tokens, a row's own request excluded): the ``next`` model's (read from the token
    before the row; the prior where that is not a decode token of the request), each
    ``within[h]``'s own share within h tokens, and the ``ahead`` models' (its
    :meth:`~TrajectoryIndex.ahead_features`; a multi-token pass: :attr:`~TrajectoryIndex.use`);
    with ``knn``, ``plain`` holds ``next`` and ``within`` refitted on the same rows without
    the kNN column (for passes of several requests, which have no kNN row)."""
    L, J = store.dims.num_layers, store.dims.num_experts
    its = store_iterations(store)
    sd = store.dims.spec_depth if use_spec and store.spec_probs is not None else 0
    passes = [_pass_used(store, it) for it in its]
    decode = [p for p in passes if p[2] == 1]
    pop = (sum((p[0] for p in decode), np.zeros((L, J))) + 1.0) / (len(decode) + 2.0)
    logpop = np.log(pop)
    fol = follow_matrices([(p[0], p[2]) for p in passes], logpop) if follow else None
    req = store.iter_request[its] if its else np.zeros(0, dtype=np.int64)
    chained = _chained(passes, req)
    index = (_trajectory_index(passes, chained, req, horizons if knn_within else (),
                               max_rows=knn_rows) if knn else None)
    chains = chain_matrices(trans, depth)
    stride = max(1, int(np.ceil(len(passes) * L * J / MAX_ROWS)))
    xs: dict[tuple[int, int], list[np.ndarray]] = {}
    ys: dict[tuple[int, int], list[np.ndarray]] = {}
    state = ReuseState.zeros(L, J)
    waits = passes_until_use([p[0] for p in passes], [
        n for n, p in enumerate(passes) if p[2] == 1 and n % stride == 0]) if horizons else {}
    wait_rows: list[np.ndarray] = []  # the next model's rows' waits (the within labels)
    knn_rows: list[np.ndarray] = []  # their kNN within shares, float64[H, L * J] each
    for n, (used, counts, T) in enumerate(passes):
        kind = int(T > 1)
        if kind == 1 or n % stride == 0:
            feats = state_features(state, logpop)  # [L, J, 4]
            if kind == 0:
                rows = None if index is None else (  # [H1, L, J]
                    index.features(passes[n - 1][0] > 0, int(req[n])) if chained[n]
                    else index.prior)
                if rows is not None and len(rows) > 1:
                    knn_rows.append(rows[1:].reshape(len(rows) - 1, -1))
                nf = next_features(state, logpop, recency=recency, follow=fol,
                                   knn_col=None if rows is None else rows[0])
                xs.setdefault((0, 0), []).append(nf.reshape(-1, nf.shape[-1]))
                ys.setdefault((0, 0), []).append(used.reshape(-1))
                if horizons:
                    wait_rows.append(waits[n].reshape(-1))
            extras = (_carried_all(counts, trans, prefill_depth)
                      if kind and prefill_depth > depth else
                      [carried(counts[:L - d], chains[d - 1]) for d in range(1, len(chains) + 1)])
            ka = (_ahead_knn(index, used > 0, int(req[n]), kind, len(chains))
                  if knn_ahead and index is not None else None)
            for d, extra in enumerate(extras, start=1):
                parts = [feats[d:], extra[..., None]]  # [L-d, J, 4], [L-d, J, 1]
                if sd:
                    parts.append(_spec_block(store, its[n], d, sd, L, J))
                if ka is not None:
                    parts.append((ka[d - 1, :L - d] if kind == 0 else ka[d:])[..., None])
                x = np.concatenate(parts, axis=-1)
                xs.setdefault((kind, d), []).append(x.reshape(-1, x.shape[-1]))
                ys.setdefault((kind, d), []).append(used[d:].reshape(-1))
        state.update_all(used)
    stack = {k: (np.concatenate(xs[k]), np.concatenate(ys[k])) for k in xs}
    n_feat = 4 + int(recency) + int(follow) + int(knn)
    X0, y0 = stack.get((0, 0), (np.zeros((0, n_feat)), np.zeros(0)))
    wait = np.concatenate(wait_rows) if wait_rows else np.zeros(0)
    nxt, within, plain = _fit_next(X0, y0, wait, knn_rows, horizons, index is not None)
    ahead = {k: fit_logistic(X, y, X.shape[1]) for k, (X, y) in stack.items() if k[1] > 0}
    return ReuseModels(next=nxt, ahead=ahead, chains=chains, logpop=logpop, follow=fol,
                       within=within, rows=sum(len(y) for _, y in stack.values()),
                       spec_depth=sd, knn=index, plain=plain)


def _fit_next(X0: np.ndarray, y0: np.ndarray, wait: np.ndarray, knn_rows: list[np.ndarray],
              horizons: tuple[int, ...], knn: bool
              ) -> tuple[Logistic, dict[int, Logistic], tuple[Logistic, dict[int, Logistic]] | None]:
    """The ``next`` model on ``X0`` float64[N, F] (labels ``y0``), each ``within[h]`` on the
    same rows (labels wait < h, each its own kNN share: :func:`_within_x`) and, with
    ``knn`` (the kNN column last in ``X0``), both refitted without that column."""
    n_feat = X0.shape[1]
    nxt = fit_logistic(X0, y0, n_feat)
    within = {int(h): fit_logistic(_within_x(X0, knn_rows, i), (wait < h).astype(np.float64),
                                   n_feat) for i, h in enumerate(horizons)}
    plain = None if not knn else (
        fit_logistic(X0[:, :-1], y0, n_feat - 1),
        {int(h): fit_logistic(X0[:, :-1], (wait < h).astype(np.float64), n_feat - 1)
         for h in horizons})
    return nxt, within, plain


def _chained(passes: list[tuple[np.ndarray, np.ndarray, int]], req: np.ndarray) -> list[bool]:
    """Per pass n: whether n - 1 is a decode token of pass n's request and n one too (the
    trajectory the kNN reads for pass n)."""
    return [n > 0 and passes[n][2] == 1 and passes[n - 1][2] == 1 and req[n] == req[n - 1]
            for n in range(len(passes))]


def _ahead_knn(index: TrajectoryIndex, used: np.ndarray, request: int, kind: int,
               depth: int) -> np.ndarray:
    """The ``ahead`` models' kNN column of one pass: float64[depth, L, J] of a decode pass
    (its own routing's neighbours, its request excluded), float64[L, J] the index's
    popularity for a multi-token pass (no single trajectory)."""
    if kind:
        return index.use
    return index.ahead_features(used, request, depth)


def _within_x(X0: np.ndarray, knn_rows: list[np.ndarray], i: int) -> np.ndarray:
    """The ``within[horizons[i]]`` model's rows: the ``next`` model's ``X0``, its last
    column (the kNN's next-token share) swapped for the kNN's share within that horizon
    (unchanged without a kNN's within rows)."""
    if not knn_rows:
        return X0
    X = X0.copy()
    X[:, -1] = np.concatenate([k[i] for k in knn_rows])
    return X


def _trajectory_index(passes: list[tuple[np.ndarray, np.ndarray, int]], chained: list[bool],
                      req: np.ndarray, horizons: tuple[int, ...] = (),
                      max_rows: int = KNN_ROWS) -> TrajectoryIndex:
    """The store's decode tokens that have a next decode token of their request (at most
    ``max_rows``, a seeded sample beyond); with
    ``horizons``, each with its wait (:class:`TrajectoryIndex`): decode tokens of the same
    request from the next one to the first that uses the expert, counted only through the
    run of chained decode tokens (capped at max(horizons))."""
    pairs = [n - 1 for n in range(len(passes)) if chained[n]]
    L, J = passes[0][0].shape if passes else (0, 0)
    if not pairs:
        used = nxt = np.zeros((0, L, J), dtype=bool)
        return TrajectoryIndex(used, nxt, np.zeros(0, dtype=np.int64), max_rows=max_rows,
                               wait=np.zeros((0, L, J)), horizons=horizons)
    used = np.stack([passes[n][0] > 0 for n in pairs])
    nxt = np.stack([passes[n + 1][0] > 0 for n in pairs])
    wait = None
    if horizons:
        cap = max(horizons)
        if cap > MAX_HORIZON:
            raise ConfigError(f"reuse_prob: a kNN horizon of {cap} passes is over {MAX_HORIZON}")
        # backwards through the passes: the wait from pass n, reset where the chain breaks
        wait_at = np.full((len(passes), L, J), cap, dtype=np.uint8)  # cap <= 255
        for n in range(len(passes) - 1, -1, -1):
            later = wait_at[n + 1] + 1 if n + 1 < len(passes) and chained[n + 1] else cap
            wait_at[n] = np.where(passes[n][0] > 0, 0, np.minimum(later, cap))
        wait = wait_at[[n + 1 for n in pairs]]
    return TrajectoryIndex(used, nxt, req[pairs], max_rows=max_rows, wait=wait,
                           horizons=horizons)
