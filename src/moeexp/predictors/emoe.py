"""eMoE (algorithms.md §6): periodic, task-aware prediction of each layer's resident experts.

Schedule, by the order in which requests start (n = 0, 1, 2, ...):

- n = 0, the first prompt: every expert is wanted (all J of every layer are predicted and
  streamed through the budget one layer ahead: layer 0 at each iteration start, layer l+1
  while layer l runs); no history exists yet.
- n >= 1 with (n - 1) % ``period`` == 0: the predictor runs and selects a new resident set.
- any other n: the prompt reuses the resident set of the last run (it is re-requested at
  ``start_request``, a no-op for experts still resident).

Prediction uses routing history only (the router's own top-K of its probabilities, never
the substitutes of restricted routing). Both variants output per-layer expert frequency
distributions f[l, :] from a small numpy softmax regression trained on the store split
(soft cross-entropy, Adam, L2, bias initialised to the log of the store's mean distribution
so an untrained or data-starved model predicts the store prior):

- ``emoe_l``: layer i's distribution from layer i-1's distribution of the same prompt (its
  prefill iteration, observed as the prompt runs, so layer i is chosen while layer i-1
  runs); layer 0 from the previous prompt's layer-0 distribution (at ``start_request``).
  One J->J regression per layer: L*(J*J + J) parameters.
- ``emoe_a``: all layers of the next prompt from the previous prompt's whole sequence (its
  request-level L*J distribution), at ``start_request``: L*(L*J*J + J) parameters.

Expert selection (Eq. 2): N[l, i] = sum over task types t of the running requests of
(sum of their input tokens + T_t * W_o,t) * s_t[l] * f[l, i], with T_t the number of running
requests of task t and W_o,t the mean output length of task t on the store split (all
store requests when the task is unseen). The top ``experts_per_layer`` of N per layer are
kept. A layer with N = 0 everywhere (insensitive, s = 0, for every running task) skips
prediction and keeps its previous set (the store's most used experts if it had none).

``sensitivity`` (optional, default all sensitive): a list of L values s[l] in [0, 1] for
every task, or a mapping task -> list (key ``default`` for other tasks).
The predicted set is sent to the cache as ``scores`` (N normalised per layer, 0 for
unselected experts): the ``emoe`` cache policy evicts unselected experts first.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
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
    RequestStart,
)
from moeexp.predictors.emoe_model import SoftmaxRegression, store_histories, training_pairs
from moeexp.traces.schema import RequestMeta, Trace, TraceDims

Variant = Literal["emoe_l", "emoe_a"]
Sensitivity = Sequence[float] | Mapping[str, Sequence[float]] | None


def expected_tokens(f: np.ndarray, running: Sequence[RequestMeta], w_out: Mapping[str, float],
                    w_default: float, sens: Mapping[str, np.ndarray],
                    s_default: np.ndarray) -> np.ndarray:
    """Eq. 2: float64[L, J] expected tokens N per expert.

    Args:
        f: float[L, J] predicted expert frequencies (rows sum to 1).
        running: requests running now (the new one included).
        w_out: task -> expected output tokens W_o; ``w_default`` for other tasks.
        sens: task -> float[L] sensitivity s; ``s_default`` for other tasks.
    """
    N = np.zeros_like(f, dtype=np.float64)
    for task in sorted({r.task for r in running}):
        reqs = [r for r in running if r.task == task]
        tokens = sum(r.prompt_len for r in reqs) + len(reqs) * w_out.get(task, w_default)
        s = sens.get(task, s_default)
        N += tokens * s[:, None] * f
    return N


def select_top(N_row: np.ndarray, e: int) -> np.ndarray:
    """int64[e]: the e largest entries of N_row (ties -> lower expert index)."""
    return np.lexsort((np.arange(len(N_row)), -N_row))[:e].astype(np.int64)


@PREDICTORS.register("emoe")
class EMoE(Predictor):
    """eMoE's periodic expert predictor with Eq. 2 selection.

    Args:
        dims: trace dimensions.
        variant: ``emoe_l`` (layer to layer) or ``emoe_a`` (whole previous prompt).
        period: p, prompts per prediction (paper: 40).
        experts_per_layer: experts kept per layer: an int count, or a float in (0, 1] as a
            fraction of J (0.25 of 8 -> 2); match it to the cache capacity.
        sensitivity: per-layer task sensitivity s (see module doc); None = all 1.
        steps, lr, l2: training of the softmax regressions (full-batch Adam).
        seed: initialisation.
        task_aware: Eq. 2 with each task's own W_o and sensitivity (eMoE); False: every
            request counts as one task (the store's overall mean W_o, the default
            sensitivity): the task-agnostic ablation of ``+experiment=emoe_serving``.
    """

    def __init__(self, *, dims: TraceDims, variant: Variant = "emoe_l", period: int = 40,
                 experts_per_layer: int | float = 0.25, sensitivity: Sensitivity = None,
                 steps: int = 300, lr: float = 0.05, l2: float = 1e-3, seed: int = 0,
                 task_aware: bool = True) -> None:
        super().__init__(dims=dims)
        if not isinstance(task_aware, bool):
            raise ConfigError(f"emoe: task_aware must be true or false, got {task_aware!r}")
        self.task_aware = task_aware
        L, J = dims.num_layers, dims.num_experts
        if variant not in ("emoe_l", "emoe_a"):
            raise ConfigError(f"emoe: variant must be 'emoe_l' or 'emoe_a', got {variant!r}")
        if int(period) < 1:
            raise ConfigError(f"emoe: period must be >= 1, got {period}")
        self.variant: Variant = variant
        self.period = int(period)
        self.experts_per_layer = self._parse_epl(experts_per_layer, J)
        self.s_default, self.sens = self._parse_sensitivity(sensitivity, L)
        self.steps, self.lr, self.l2, self.seed = int(steps), float(lr), float(l2), int(seed)
        self.models: list[SoftmaxRegression] = []
        self.prior = np.full((L, J), 1.0 / J)
        self.w_out: dict[str, float] = {}
        self.w_default = 0.0
        # run-time state
        self.sets: list[np.ndarray | None] = [None] * L  # None = all experts (first prompt)
        self.scores: np.ndarray = np.ones((L, J))
        self._started = 0
        self._running: dict[int, RequestMeta] = {}
        self._mode: dict[int, str] = {}
        self._acc: dict[int, np.ndarray] = {}
        self._prefill: dict[int, np.ndarray] = {}
        self._pending: set[int] = set()  # emoe_l: requests whose prefill predicts layers >= 1
        self._history: np.ndarray | None = None  # float[L, J] previous prompt's distribution
        self._token_request = np.zeros(0, dtype=np.int64)
        self._iter_rids: list[int] = []
        self.invocations = 0
        self._query_ns = 0
        self._queries = 0
        # memoised Predictions (read-only arrays; callers only read them): _all_experts by
        # its prefetch layer (fixed once fitted), _current by its layers (cleared whenever
        # ``sets`` or ``scores`` change)
        self._all_memo: dict[int | None, Prediction] = {}
        self._current_memo: dict[tuple[int, ...], Prediction] = {}
        # preview_pass: (the pass's probs objects, per request its float64[L, J] counts)
        self._pre: tuple[list[np.ndarray], dict[int, np.ndarray]] | None = None

    # ------------------------------------------------------------------ configuration
    @staticmethod
    def _parse_epl(value: int | float, J: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"emoe: experts_per_layer must be an int or a float, got {value!r}")
        if isinstance(value, float):
            if not 0 < value <= 1:
                raise ConfigError("emoe: a float experts_per_layer is a fraction of J in (0, 1],"
                                  f" got {value}")
            return max(1, int(round(value * J)))
        if not 1 <= value:
            raise ConfigError(f"emoe: experts_per_layer must be >= 1, got {value}")
        return min(int(value), J)

    @staticmethod
    def _parse_sensitivity(value: Sensitivity, L: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        def vec(v: Sequence[float], where: str) -> np.ndarray:
            a = np.asarray(list(v), dtype=np.float64)
            if a.shape != (L,) or np.any(a < 0) or np.any(a > 1):
                raise ConfigError(f"emoe: sensitivity{where} must list {L} values in [0, 1], "
                                  f"got {list(v)}")
            return a

        if value is None:
            return np.ones(L), {}
        if isinstance(value, Mapping):
            per = {str(k): vec(v, f"[{k!r}]") for k, v in value.items()}
            return per.pop("default", np.ones(L)), per
        return vec(value, ""), {}

    # ------------------------------------------------------------------ learning
    def fit(self, store: Trace) -> None:
        """Train the regressions on consecutive store prompts; learn W_o per task."""
        L, J = self.dims.num_layers, self.dims.num_experts
        full, prefill = store_histories(store)  # float[R, L, J] each, store order
        if len(full):
            self.prior = full.mean(axis=0)
        outs = [float(r.output_len) for r in store.requests]
        self.w_default = float(np.mean(outs)) if outs else 0.0
        for task in (sorted({r.task for r in store.requests}) if self.task_aware else ()):
            self.w_out[task] = float(np.mean([r.output_len for r in store.requests
                                              if r.task == task]))
        rng = np.random.default_rng(self.seed)
        self.models = []
        self._all_memo.clear()
        self._current_memo.clear()
        for layer in range(L):
            x, y = training_pairs(full, prefill, self.variant, layer)
            m = SoftmaxRegression(x.shape[1], J, self.prior[layer], rng)
            m.fit(x, y, steps=self.steps, lr=self.lr, l2=self.l2)
            self.models.append(m)

    # ------------------------------------------------------------------ selection
    def _select(self, f: np.ndarray, layers: Sequence[int]) -> Prediction:
        """Eq. 2 selection for ``layers`` from f float[L, J]; updates sets and scores."""
        running = list(self._running.values())
        sens = self.sens if self.task_aware else {}
        N = expected_tokens(f, running, self.w_out, self.w_default, sens, self.s_default)
        out = Prediction()
        L = self.dims.num_layers
        self._current_memo.clear()  # sets and scores change below
        for layer in layers:
            row = N[layer]
            if row.max() <= 0:  # insensitive for every running task: skip prediction
                if self.sets[layer] is None:
                    self.sets[layer] = select_top(self.prior[layer], self.experts_per_layer)
                chosen = self.sets[layer]
                assert chosen is not None
                score = np.zeros_like(row)
                score[chosen] = self.prior[layer][chosen] + 1e-12
            else:
                chosen = select_top(row, self.experts_per_layer)
                score = np.zeros_like(row)
                score[chosen] = row[chosen] / row[chosen].sum() + 1e-12
                self.sets[layer] = chosen
            self.scores[layer] = score
            base = float(L - layer)
            out.prefetch.extend(Prefetch(base - 1e-3 * i, layer, int(e))
                                for i, e in enumerate(chosen))
            out.predicted[layer] = chosen
            out.scores[layer] = score.copy()
        return out

    def _all_experts(self, prefetch_layer: int | None) -> Prediction:
        """Every expert of every layer predicted (first prompt); prefetch ``prefetch_layer``.

        The first prompt streams the whole model through the budget one layer ahead
        (layer 0 at the iteration start, layer l+1 while layer l runs), most used first.
        Memoised per ``prefetch_layer`` (it depends on the fitted prior only): read-only
        arrays, shared; callers never modify a Prediction.
        """
        out = self._all_memo.get(prefetch_layer)
        if out is not None:
            return out
        L, J = self.dims.num_layers, self.dims.num_experts
        out = Prediction()
        every, ones = _frozen(np.arange(J, dtype=np.int64)), _frozen(np.ones(J))
        for layer in range(L):
            out.predicted[layer] = every
            out.scores[layer] = ones
        if prefetch_layer is not None and prefetch_layer < L:
            order = select_top(self.prior[prefetch_layer], J)
            out.prefetch = [Prefetch(float(L - prefetch_layer) - 1e-3 * i, prefetch_layer,
                                     int(e)) for i, e in enumerate(order)]
        self._all_memo[prefetch_layer] = out
        return out

    def _current(self, layers: Sequence[int]) -> Prediction:
        """Re-request the current resident set of ``layers`` (reuse prompts). Memoised
        per ``layers`` until ``sets`` or ``scores`` change (shared: the scores as read-only
        copies; ``sets``' arrays are replaced by :meth:`_select`, never modified)."""
        key = tuple(layers)
        out = self._current_memo.get(key)
        if out is not None:
            return out
        L = self.dims.num_layers
        out = Prediction()
        for layer in key:
            chosen = self.sets[layer]
            if chosen is None:
                chosen = np.arange(self.dims.num_experts, dtype=np.int64)
            out.prefetch.extend(Prefetch(float(L - layer) - 1e-3 * i, layer, int(e))
                                for i, e in enumerate(chosen))
            out.predicted[layer] = chosen
            out.scores[layer] = _frozen(self.scores[layer].copy())
        self._current_memo[key] = out
        return out

    # ------------------------------------------------------------------ hooks
    def start_request(self, ctx: RequestStart) -> Prediction:
        if not self.models:
            raise ConfigError("emoe: call fit(store) before the replay")
        rid, n = ctx.request.request_id, self._started
        self._started += 1
        self._running[rid] = ctx.request
        L, J = self.dims.num_layers, self.dims.num_experts
        self._acc[rid] = np.zeros((L, J))
        if n == 0:
            self._mode[rid] = "all"
            self.sets = [None] * L
            self.scores = np.ones((L, J))
            self._current_memo.clear()
            return self._all_experts(0)
        if (n - 1) % self.period:
            self._mode[rid] = "reuse"
            return self._current(range(L))
        self._mode[rid] = "predict"
        self.invocations += 1
        hist = self._history_now()
        t0 = time.perf_counter_ns()
        if self.variant == "emoe_a":
            f = np.stack([m.predict(hist.reshape(1, -1))[0] for m in self.models])
            out = self._select(f, range(L))
        else:
            f = self.prior.copy()
            f[0] = self.models[0].predict(hist[0][None])[0]
            out = self._select(f, [0])
            self._pending.add(rid)
        self._query_ns += time.perf_counter_ns() - t0
        self._queries += 1
        return out

    def _history_now(self) -> np.ndarray:
        """float[L, J]: the previous prompt's distribution (store prior if none yet)."""
        if self._history is not None:
            return self._history
        partial = [a for a in self._acc.values() if a.sum() > 0]
        return _normalise(partial[-1]) if partial else self.prior

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        self._token_request = np.asarray(ctx.token_request, dtype=np.int64)
        self._iter_rids = [int(r) for r in ctx.request_ids]
        modes = {self._mode.get(int(r), "reuse") for r in ctx.request_ids}
        if "all" in modes:
            return self._all_experts(0)
        L = self.dims.num_layers
        # emoe_l: layers >= 1 of a prediction prompt are chosen as its prefill runs
        skip = set(range(1, L)) if self._pending & set(self._iter_rids) else set()
        # re-requesting the set is a no-op for resident experts; it completes a set whose
        # loading the end of the previous iteration cut short
        return self._current([layer for layer in range(L) if layer not in skip])

    previews = True

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """A pass in which no request streams the model (the first prompt) or predicts
        from its prefill: every layer's router top-K counts per request at once (the
        same stable argsort per token row, stacked over layers; integer counts as
        float64), which :meth:`observe_layer` then adds layer by layer. Other passes are
        not previewed."""
        self._pre = None
        L = self.dims.num_layers
        rids = self._iter_rids
        if (len(obs) != L or any(self._mode.get(r) == "all" for r in rids)
                or any(r in self._pending for r in rids)):
            return
        probs = [o.probs for o in obs]
        T = len(probs[0])
        if any(len(p) != T for p in probs):
            return
        K, J = self.dims.top_k, self.dims.num_experts
        top = np.argsort(-np.asarray(probs, dtype=np.float64), axis=2, kind="stable")[:, :, :K]
        tok_req = self._token_request if len(self._token_request) == T else None
        base = (np.arange(L, dtype=np.int64) * J)[:, None, None]  # [L, 1, 1]
        counts: dict[int, np.ndarray] = {}
        for rid in rids:
            if rid not in self._acc:
                continue
            rows = top if tok_req is None else top[:, tok_req == rid]  # [L, T_r, K]
            if rows.shape[1] == 0:
                continue
            counts[rid] = np.bincount((rows + base).reshape(-1), minlength=L * J).reshape(
                L, J).astype(np.float64)
        self._pre = (probs, counts)

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        pre = self._pre
        if pre is not None and pre[0][obs.layer] is obs.probs:  # previewed: nothing to
            for rid, c in pre[1].items():  # predict, only the history to extend
                self._acc[rid][obs.layer] += c[obs.layer]
            return Prediction()
        K, J = self.dims.top_k, self.dims.num_experts
        top = np.argsort(-np.asarray(obs.probs, dtype=np.float64), axis=1, kind="stable")[:, :K]
        tok_req = self._token_request if len(self._token_request) == len(top) else None
        out = Prediction()
        if any(self._mode.get(r) == "all" for r in self._iter_rids):
            out.extend(self._all_experts(obs.layer + 1))
        for rid in self._iter_rids:
            if rid not in self._acc:
                continue
            # without a token map (never in a replay) the rows count for every request
            rows = top if tok_req is None else top[tok_req == rid]
            if len(rows) == 0:
                continue
            c = np.bincount(rows.reshape(-1), minlength=J).astype(np.float64)
            self._acc[rid][obs.layer] += c
            if rid in self._pending:
                self._prefill.setdefault(rid, np.zeros_like(self._acc[rid]))[obs.layer] += c
                nxt = obs.layer + 1
                if nxt < self.dims.num_layers:
                    t0 = time.perf_counter_ns()
                    f = self.prior.copy()
                    f[nxt] = self.models[nxt].predict(_normalise(c[None]))[0]
                    out.extend(self._select(f, [nxt]))
                    self._query_ns += time.perf_counter_ns() - t0
                    self._queries += 1
        return out

    def end_iteration(self) -> None:
        self._pre = None
        for rid in list(self._pending):
            if rid in self._prefill:  # its first (prefill) iteration has run
                self._pending.discard(rid)
                self._prefill.pop(rid, None)

    def end_request(self, request_id: int) -> None:
        acc = self._acc.pop(request_id, None)
        if acc is not None and acc.sum() > 0:
            self._history = _normalise(acc)
        self._running.pop(request_id, None)
        self._mode.pop(request_id, None)
        self._pending.discard(request_id)

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        return {"params": float(sum(m.num_params for m in self.models)),
                "query_us_mean": q, "invocations": float(self.invocations),
                "experts_per_layer": float(self.experts_per_layer)}


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a``, made read-only (a memoised Prediction's arrays are shared)."""
    a.setflags(write=False)
    return a


def _normalise(a: np.ndarray) -> np.ndarray:
    """Rows of ``a`` (float[..., J]) scaled to sum 1 (uniform where a row is empty)."""
    s = a.sum(axis=-1, keepdims=True)
    return np.where(s > 0, a / np.where(s > 0, s, 1.0), 1.0 / a.shape[-1])
