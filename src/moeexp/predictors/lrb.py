"""A learned next-use model for eviction, in the spirit of LRB (Learning Relaxed Belady, NSDI'20).

Every routed expert ``(l, e)`` carries, besides ``reuse_prob``'s state (last, fast, slow:
:mod:`moeexp.predictors.reuse_features`), the passes of layer l since it was last used
(``rec``, recency) and its uses in the last :data:`WINDOW` passes of layer l (``win``,
frequency); the request's position (decode steps so far) is shared. The label of a row is
the reuse distance: the number of passes of layer l until the expert is used again (1: the
next pass; censored at the split's end). Rows come from walking the store split only, in the
replay's order, with the same state updates the replay makes (a walk handed a request of
another split raises ConfigError).

The model ``reuse_prob`` uses (``next_model: lrb``) is :class:`LrbTable`: a scikit-learn
``HistGradientBoostingRegressor`` (:func:`fit_lrb`, Poisson loss: the mean distance) on the
discrete features :data:`TABLE`, evaluated once on every cell of their grid, so that a
query is an index. The ``next_use`` cache receives a predicted distance D (passes) as the
probability ``1 / D`` of a geometric wait of mean D, so its expected next use
``Δ + L (D - 1)`` ranks experts by the model. :data:`FEATURES` (all of the state) serves the
offline comparison (``experiments/regime_map/lrb_offline.py``).

Shapes: L layers, J experts, N rows. Units: passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.reuse_features import REC_CAP, ReuseState, _pass_used, store_iterations
from moeexp.traces.schema import Trace

WINDOW = 16  #: passes of a layer counted by the frequency feature
MAX_ROWS = 400_000  #: training rows (passes are strided to stay under it)
FEATURES = ("last", "fast", "slow", "logpop", "log_rec", "win", "log_step")
REC_BINS = 64  #: recency values of the table model: 1 .. 63 passes, and 64 for >= 64 (or never)
STEP_EDGES = (4, 16, 64)  #: the table model's request-position bins: [0, 4), [4, 16), ...
LOSS = "poisson"  #: the regression's loss (:func:`fit_lrb`)
TABLE = ("logpop", "log_rec", "win", "step_bin")  #: the table model's features


@dataclass
class LrbState(ReuseState):
    """:class:`moeexp.predictors.reuse_features.ReuseState` (``feat`` float64[3, L, J]:
    last, fast, slow; ``rec`` float64[L, J], passes since last use) plus ``hist``
    float64[WINDOW, L, J] (ring of the last uses), ``pos`` int[L] (the ring's slot per
    layer) and ``step`` (the request's decode steps so far)."""

    hist: np.ndarray
    pos: np.ndarray
    step: int = 0

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> LrbState:
        L, J = num_layers, num_experts
        return cls(np.zeros((3, L, J)), np.full((L, J), float(REC_CAP)),
                   np.zeros((WINDOW, L, J)), np.zeros(L, dtype=np.int64))

    def update(self, layer: int, used: np.ndarray) -> None:
        """Layer ``layer`` ran; ``used`` float64[J] 0/1."""
        super().update(layer, used)
        self.hist[self.pos[layer], layer] = used
        self.pos[layer] = (self.pos[layer] + 1) % WINDOW

    def update_all(self, used: np.ndarray) -> None:
        """Every layer ran; ``used`` float64[L, J] 0/1."""
        for layer in range(used.shape[0]):
            self.update(layer, used[layer])

    def rows(self, logpop: np.ndarray, layer: int | slice = slice(None)) -> np.ndarray:
        """float64[..., J, len(FEATURES)] of layer(s) ``layer``."""
        f = self.feat
        win = self.hist[:, layer].sum(axis=0)
        step = np.full_like(win, np.log1p(self.step))
        return np.stack([f[0, layer], f[1, layer], f[2, layer], logpop[layer],
                         np.log(self.rec[layer]), win, step], axis=-1)


def _distances(used: np.ndarray) -> np.ndarray:
    """float64[N, L, J]: passes from the end of pass t - 1 to the next use at or after pass t
    (1: pass t uses it); censored at the end (remaining passes + 1). ``used`` bool[N, L, J]."""
    N = used.shape[0]
    out = np.empty(used.shape)
    nxt = np.full(used.shape[1:], float(N))
    for t in range(N - 1, -1, -1):
        nxt = np.where(used[t], float(t), nxt)
        out[t] = nxt - t + 1.0
    return out


def walk_rows(trace: Trace, state_cls: type = LrbState, check_store: bool = True,
              max_rows: int = MAX_ROWS) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Walk ``trace``'s requests in order (store split only when ``check_store``: another
    split's request raises ConfigError) -> (X float64[N, F], request id int[N], distance
    float64[N], pass index int[N]), passes strided to stay under ``max_rows`` rows."""
    if check_store:
        its = store_iterations(trace)
    else:
        its = [int(i) for r in trace.requests for i in trace.request_iterations(r.request_id)]
    L, J = trace.dims.num_layers, trace.dims.num_experts
    passes = [_pass_used(trace, it) for it in its]
    used = np.stack([p[0] > 0 for p in passes]) if passes else np.zeros((0, L, J), bool)
    decode = [p[0] for p in passes if p[2] == 1]
    logpop = np.log((sum(decode, np.zeros((L, J))) + 1.0) / (len(decode) + 2.0))
    dist = _distances(used)
    stride = max(1, int(np.ceil(len(passes) * L * J / max_rows)))
    state = state_cls.zeros(L, J)
    xs, rids, ds, gs = [], [], [], []
    for n, it in enumerate(its):
        state.step = int(trace.iter_step[it])
        if n % stride == 0:
            xs.append(state.rows(logpop).reshape(-1, len(FEATURES)))
            rids.append(np.full(L * J, int(trace.iter_request[it])))
            ds.append(dist[n].reshape(-1))
            gs.append(np.full(L * J, n))
        state.update_all(used[n].astype(np.float64))
    if not xs:
        raise ConfigError("lrb: the split has no passes to learn from")
    return np.concatenate(xs), np.concatenate(rids), np.concatenate(ds), np.concatenate(gs)


def fit_lrb(X: np.ndarray, dist: np.ndarray):  # noqa: ANN201 (a scikit-learn estimator)
    """A HistGradientBoostingRegressor of the reuse distance ``dist`` (float64[N], passes)
    on X (float64[N, F]), :data:`LOSS` ``poisson``: it predicts the mean distance (what
    the geometric wait of the ``next_use`` cache assumes); ``squared_error`` on log(dist):
    exp of its prediction is a geometric mean."""
    from sklearn.ensemble import HistGradientBoostingRegressor  # fit time only

    model = HistGradientBoostingRegressor(loss=LOSS, max_iter=100, learning_rate=0.1,
                                          max_leaf_nodes=31, random_state=0)
    return model.fit(X, dist if LOSS == "poisson" else np.log(dist))


def predict_dist(model, X: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """float64[N]: passes to the next use predicted by a :func:`fit_lrb` model."""
    y = model.predict(X)
    return y if LOSS == "poisson" else np.exp(y)


def table_rows(X: np.ndarray) -> np.ndarray:
    """float64[N, len(TABLE)] from rows of :data:`FEATURES`: recency capped at
    :data:`REC_BINS`, the request position binned by :data:`STEP_EDGES`."""
    f = {n: X[:, i] for i, n in enumerate(FEATURES)}
    rec = np.minimum(np.rint(np.exp(f["log_rec"])), REC_BINS)
    step = np.searchsorted(STEP_EDGES, np.rint(np.expm1(f["log_step"])), side="right")
    return np.stack([f["logpop"], np.log(rec), f["win"], step.astype(np.float64)], axis=-1)


@dataclass
class LrbTable:
    """The learned reuse distance, tabulated: ``dist[l, e, r - 1, w, s]`` float32 (passes)
    for recency r (1 .. :data:`REC_BINS`), window count w (0 .. :data:`WINDOW`) and request
    position bin s: the fitted model evaluated once on every cell of its discrete features,
    so that a query is an index, not a model call."""

    dist: np.ndarray

    @classmethod
    def fit(cls, X: np.ndarray, dist: np.ndarray, logpop: np.ndarray) -> LrbTable:
        """Fit on rows ``X`` (float64[N, len(FEATURES)], store split) and distances
        ``dist`` float64[N]; ``logpop`` float64[L, J] as the rows'."""
        model = fit_lrb(table_rows(X), dist)
        L, J = logpop.shape
        S = len(STEP_EDGES) + 1
        grid = np.meshgrid(np.arange(L * J), np.arange(1, REC_BINS + 1),
                           np.arange(WINDOW + 1), np.arange(S), indexing="ij")
        cells = np.stack([logpop.reshape(-1)[grid[0]], np.log(grid[1]), grid[2], grid[3]],
                         axis=-1).reshape(-1, len(TABLE)).astype(np.float64)
        d = predict_dist(model, cells).astype(np.float32)
        return cls(d.reshape(L, J, REC_BINS, WINDOW + 1, S))

    def lookup(self, state: LrbState, layer: int) -> np.ndarray:
        """float64[J]: the predicted passes to each expert's next use at ``layer``."""
        rec = np.minimum(state.rec[layer], REC_BINS).astype(np.int64) - 1
        win = state.hist[:, layer].sum(axis=0).astype(np.int64)
        s = int(np.searchsorted(STEP_EDGES, state.step, side="right"))
        return self.dist[layer, np.arange(rec.shape[0]), rec, win, s].astype(np.float64)
