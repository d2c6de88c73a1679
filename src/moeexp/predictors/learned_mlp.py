"""ProMoE-style learned predictor (algorithms.md §3): a small MLP per layer, in numpy.

For every layer l with l + d < L an MLP maps the hidden state entering layer l (float[H])
to independent probabilities that each expert of layer l+d is selected (multi-label: the
target is the K-hot vector of the token's top-K at layer l+d). Architecture::

    x -> standardise (store mean/std) -> [Linear -> ReLU] x len(hidden_units) -> Linear -> sigmoid

trained with the mean binary cross-entropy by Adam on mini-batches, with manual backprop,
seeded. Training uses the store split only: 90% of its requests train, the remaining
``holdout`` fraction (whole requests, chosen by the seed) measures recall@K, together with
the per-layer frequency baseline (always the store's K most used experts of layer l+d).

At run time, at layer l the MLP of layer l prefetches, for layer l+d, the union over the
iteration's tokens of each token's top-K (``aggregate: union``; ``mean`` = top-K of the
token-mean). ``stats()`` reports ``recall_at_k``, ``baseline_recall_at_k`` (the frequency
baseline), ``params``, ``train_s``, ``train_tokens`` and ``query_us_mean`` (microseconds);
the simulator publishes them as ``predictor_<key>``.

Why the training is hand-written and not scikit-learn's ``MLPClassifier`` (the same
network, K-hot multi-label targets, logistic outputs, Adam, the same epochs, batch, rate
and L2 as alpha = weight_decay·J·batch_size): quality is the same and the fit takes twice
as long. On the predictor ablation (``python -m moeexp +experiment=predictor_ablation``,
the tiny model's ShareGPT trace, FineMoE cache, 25 % capacity) ``MLPClassifier`` gave
hit rate 0.7939 against 0.7959 here, prediction recall 0.6380 against 0.6363, hold-out
recall@K 0.8490 against 0.8442, and ``train_s`` 4.18 s against 1.79 s; over seeds 0-3
the test-split recall@K was 0.8398 against 0.8389 on average, and the fit 2.0-2.3x slower
(its per-batch overhead: the loss every batch, ReLU's derivative by boolean indexing,
input checks). Its ``predict_proba`` also costs 107 us per one-token query against 14 us
for :meth:`MLP.probs`. ``moeexp.bench.predictor_fit`` repeats the comparison (BLAS on one
thread; ``run(trace=...)`` for a recorded trace).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from moeexp.errors import ConfigError
from moeexp.predictors.base import PREDICTORS, LayerObservation, Prediction, Predictor
from moeexp.predictors.speculative import (
    Aggregate,
    Made,
    aggregate_topk,
    layer_prediction,
    one_token_topk,
    require_array,
)
from moeexp.traces.schema import Trace, TraceDims

log = logging.getLogger(__name__)


@dataclass
class MLP:
    """One layer's network: weights[i] float32[in, out], biases[i] float32[out]."""

    mu: np.ndarray
    sd: np.ndarray
    weights: list[np.ndarray]
    biases: list[np.ndarray]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits float32[N, J] of x float[N, H] and the activations (inputs of each Linear)."""
        a = ((np.asarray(x, dtype=np.float32) - self.mu) / self.sd).astype(np.float32,
                                                                           copy=False)
        acts = [a]
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            a = a @ w + b
            if i < len(self.weights) - 1:
                a = np.maximum(a, 0.0)
                acts.append(a)
        return a, acts

    def probs(self, x: np.ndarray) -> np.ndarray:
        """float32[N, J] sigmoid probabilities."""
        z, _ = self.forward(x)
        return 1.0 / (1.0 + np.exp(-z))

    @property
    def num_params(self) -> int:
        return int(sum(w.size + b.size for w, b in zip(self.weights, self.biases, strict=True)))


@dataclass
class _Stacked:
    """The nets of layers 0..n-1 with their parameters stacked on a leading layer axis:
    ``mu``, ``sd`` float32[n, 1, H], ``weights[i]`` [n, in, out], ``biases[i]`` [n, 1, out]."""

    mu: np.ndarray
    sd: np.ndarray
    weights: list[np.ndarray]
    biases: list[np.ndarray]

    @classmethod
    def of(cls, nets: list[MLP]) -> _Stacked | None:
        """None unless every net has the same shapes (one architecture)."""
        if not nets or len({tuple(w.shape for w in n.weights) for n in nets}) != 1:
            return None
        return cls(np.stack([n.mu for n in nets])[:, None], np.stack([n.sd for n in nets])[:, None],
                   [np.stack(ws) for ws in zip(*(n.weights for n in nets), strict=True)],
                   [np.stack(bs)[:, None] for bs in zip(*(n.biases for n in nets), strict=True)])

    def probs(self, x: np.ndarray) -> np.ndarray:
        """float32[n, T, J]: :meth:`MLP.probs` of each layer's x[l] (float[n, T, H]), by the
        same operations (standardise, Linear, ReLU, ..., sigmoid) broadcast over layers."""
        a = ((np.asarray(x, dtype=np.float32) - self.mu) / self.sd).astype(np.float32,
                                                                           copy=False)
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            a = np.matmul(a, w) + b
            if i < len(self.weights) - 1:
                a = np.maximum(a, 0.0)
        return 1.0 / (1.0 + np.exp(-a))


def k_hot(idx: np.ndarray, J: int) -> np.ndarray:
    """float32[N, J] multi-hot targets from int[N, K] indices."""
    y = np.zeros((idx.shape[0], J), dtype=np.float32)
    np.put_along_axis(y, idx.astype(np.int64), 1.0, axis=1)
    return y


def train_mlp(x: np.ndarray, y: np.ndarray, hidden_units: Sequence[int], *, epochs: int,
              batch_size: int, lr: float, weight_decay: float,
              rng: np.random.Generator) -> MLP:
    """Fit one MLP by Adam on mean BCE; x float[N, H], y float32[N, J] in {0, 1}."""
    x = x.astype(np.float32)
    mu = x.mean(axis=0)
    sd = x.std(axis=0) + 1e-5
    sizes = [x.shape[1], *hidden_units, y.shape[1]]
    ws = [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
          for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
    bs = [np.zeros(b, dtype=np.float32) for b in sizes[1:]]
    net = MLP(mu.astype(np.float32), sd.astype(np.float32), ws, bs)
    params = [*ws, *bs]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    b1, b2, eps, step = 0.9, 0.999, 1e-8, 0
    n = x.shape[0]
    for _ in range(epochs):
        perm = rng.permutation(n)
        for s in range(0, n, batch_size):
            bi = perm[s:s + batch_size]
            z, acts = net.forward(x[bi])
            g = (1.0 / (1.0 + np.exp(-z)) - y[bi]) / (len(bi) * y.shape[1])  # dBCE/dlogit
            gws: list[np.ndarray] = []
            gbs: list[np.ndarray] = []
            for i in range(len(ws) - 1, -1, -1):
                gws.append(acts[i].T @ g + weight_decay * ws[i])
                gbs.append(g.sum(axis=0))
                if i:
                    g = (g @ ws[i].T) * (acts[i] > 0)
            grads = [*gws[::-1], *gbs[::-1]]
            step += 1
            for p, gp, mp, vp in zip(params, grads, m, v, strict=True):
                mp *= b1
                mp += (1 - b1) * gp
                vp *= b2
                vp += (1 - b2) * gp * gp
                p -= lr * (mp / (1 - b1**step)) / (np.sqrt(vp / (1 - b2**step)) + eps)
    return net


def recall_at_k(scores: np.ndarray, true_idx: np.ndarray) -> float:
    """Mean over rows of |top-K(scores) ∩ true| / K; scores float[N, J], true int[N, K]."""
    K = true_idx.shape[1]
    top = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    hit = (top[:, :, None] == true_idx[:, None, :].astype(np.int64)).any(axis=2)
    return float(hit.sum(axis=1).mean() / K) if len(top) else float("nan")


@PREDICTORS.register("learned_mlp")
class LearnedMLP(Predictor):
    """Per-layer MLP from hidden state at layer l to experts at layer l+d.

    Args:
        dims: trace dimensions.
        distance: d >= 1 (config default: the model's ``prefetch_distance``).
        hidden_units: widths of the hidden layers (default two of 64).
        epochs, batch_size, lr, weight_decay: Adam training settings.
        holdout: fraction of store requests held out for recall@K (0 = none).
        max_train_tokens: cap on training rows per layer (random subset), for big traces.
        top_k: experts per token to prefetch (default: K).
        aggregate: ``union`` or ``mean`` over the iteration's tokens.
        seed: initialisation, shuffling and hold-out choice.
        progress: show a bar over layers while training.
    """

    needs = frozenset({"hidden"})

    def __init__(self, *, dims: TraceDims, distance: int = 1,
                 hidden_units: Sequence[int] = (64, 64), epochs: int = 30,
                 batch_size: int = 256, lr: float = 3e-3, weight_decay: float = 1e-4,
                 holdout: float = 0.1, max_train_tokens: int | None = 50000,
                 top_k: int | None = None, aggregate: Aggregate = "union", seed: int = 0,
                 progress: bool = True) -> None:
        super().__init__(dims=dims)
        if int(distance) < 1 or int(distance) >= dims.num_layers:
            raise ConfigError(
                f"learned_mlp: distance must be in 1..{dims.num_layers - 1}, got {distance}")
        units = [int(u) for u in hidden_units]
        if any(u < 1 for u in units) or int(epochs) < 1 or int(batch_size) < 1 or lr <= 0:
            raise ConfigError("learned_mlp: hidden_units, epochs, batch_size must be >= 1 "
                              "and lr > 0")
        if not 0 <= holdout < 1:
            raise ConfigError(f"learned_mlp: holdout must be in [0, 1), got {holdout}")
        if aggregate not in ("union", "mean"):
            raise ConfigError(f"learned_mlp: aggregate must be 'union' or 'mean', got {aggregate!r}")
        self.distance = int(distance)
        self.hidden_units = units
        self.epochs, self.batch_size, self.lr = int(epochs), int(batch_size), float(lr)
        self.weight_decay, self.holdout = float(weight_decay), float(holdout)
        self.max_train_tokens = max_train_tokens
        self.top_k = dims.top_k if top_k is None else int(top_k)
        self.aggregate: Aggregate = aggregate
        self.seed, self.progress = int(seed), bool(progress)
        self.nets: dict[int, MLP] = {}
        self._stacked: _Stacked | None = None  # the nets' parameters stacked (preview_pass)
        # preview_pass: (the hidden states it saw, their float32[n, T, J] probabilities,
        # for one-token passes each layer's (experts, token-mean) as aggregate_topk's)
        self._pre: tuple[list[np.ndarray], np.ndarray,
                         tuple[np.ndarray, np.ndarray] | None] | None = None
        self._made: Made = {}  # layer_prediction's memo
        self._fit_stats: dict[str, float] = {}
        self._query_ns = 0
        self._queries = 0

    def split_rows(self, store: Trace, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Token rows (int64, into ``store``) of the training requests, at most
        ``max_train_tokens`` of them (a random subset), and of the held-out requests."""
        ids = np.array([r.request_id for r in store.requests])
        n_hold = int(round(self.holdout * len(ids))) if len(ids) >= 2 else 0
        if self.holdout > 0 and len(ids) >= 2:
            n_hold = max(1, n_hold)
        held = set(rng.permutation(ids)[:n_hold].tolist())
        tok_req = np.repeat(store.iter_request, np.diff(store.iter_offsets))
        mask = np.isin(tok_req, list(held))
        train = np.flatnonzero(~mask)
        if self.max_train_tokens is not None and len(train) > self.max_train_tokens:
            train = np.sort(rng.choice(train, self.max_train_tokens, replace=False))
        return train, np.flatnonzero(mask)

    def fit(self, store: Trace) -> None:
        """Train one MLP per source layer on ``store``; measure recall@K on its hold-out."""
        require_array(store, "hidden", "trace.record_hidden=true", self.name)
        assert store.hidden is not None
        t0 = time.perf_counter()
        self._stacked, self._pre = None, None
        rng = np.random.default_rng(self.seed)
        train, held = self.split_rows(store, rng)
        if len(train) == 0:
            raise ConfigError("learned_mlp: the store split holds no training tokens")
        L, J, d = self.dims.num_layers, self.dims.num_experts, self.distance
        rec, base = [], []
        for layer in tqdm(range(L - d), desc="learned_mlp fit", disable=not self.progress,
                          leave=False):
            y_idx = store.topk_idx[:, layer + d].astype(np.int64)
            net = train_mlp(store.hidden[train, layer], k_hot(y_idx[train], J),
                            self.hidden_units, epochs=self.epochs, batch_size=self.batch_size,
                            lr=self.lr, weight_decay=self.weight_decay, rng=rng)
            self.nets[layer] = net
            if len(held):
                rec.append(recall_at_k(net.probs(store.hidden[held, layer]), y_idx[held]))
                freq = np.bincount(y_idx[train].reshape(-1), minlength=J).astype(np.float64)
                base.append(recall_at_k(np.repeat(freq[None], len(held), 0), y_idx[held]))
        nan = float("nan")
        self._fit_stats = {
            "params": float(sum(n.num_params for n in self.nets.values())),
            "recall_at_k": float(np.mean(rec)) if rec else nan,
            "baseline_recall_at_k": float(np.mean(base)) if base else nan,
            "train_s": time.perf_counter() - t0,
            "train_tokens": float(len(train)),
        }
        log.info("learned_mlp: recall@K %.3f (frequency baseline %.3f), %d params, %.1f s",
                 self._fit_stats["recall_at_k"],
                 self._fit_stats["baseline_recall_at_k"],
                 self._fit_stats["params"], self._fit_stats["train_s"])

    previews = True

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """Every layer's :meth:`MLP.probs` of the pass at once: the nets of layers
        0..n-1 (n = L - d) stacked, the same operations on [n, T, ·] arrays (one
        matrix product per layer and Linear, as there), so each layer's probabilities
        are bit-identical; for a pass of one token also every layer's
        :func:`aggregate_topk` (:func:`one_token_topk`)."""
        self._pre = None
        n = self.dims.num_layers - self.distance
        if len(obs) != self.dims.num_layers or any(o.hidden is None for o in obs[:n]):
            return
        st = self._stacked
        if st is None:
            st = self._stacked = _Stacked.of([self.nets[layer] for layer in range(n)])
        if st is None:
            return
        hidden = [o.hidden for o in obs[:n] if o.hidden is not None]
        probs = st.probs(np.asarray(hidden))  # [n, T, J]
        top = one_token_topk(probs[:, 0, :], self.top_k) if probs.shape[1] == 1 else None
        self._pre = (hidden, probs, top)

    def _topk(self, net: MLP, hidden: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """:func:`aggregate_topk` of ``net.probs(hidden)``: (experts best first, token-mean),
        from the preview when it saw this very ``hidden`` at ``layer``."""
        pre = self._pre
        if pre is None or layer >= len(pre[0]) or pre[0][layer] is not hidden:
            return aggregate_topk(net.probs(hidden), self.top_k, self.aggregate)
        if pre[2] is not None:
            return pre[2][0][layer], pre[2][1][layer]
        return aggregate_topk(pre[1][layer], self.top_k, self.aggregate)

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        net = self.nets.get(obs.layer)
        if net is None:
            return Prediction()
        if obs.hidden is None:
            raise ConfigError("learned_mlp: the mechanism passed no hidden state; record the "
                              "trace with trace.record_hidden=true")
        t0 = time.perf_counter_ns()
        experts, mean = self._topk(net, obs.hidden, obs.layer)
        out = layer_prediction(obs.layer + self.distance, experts, mean, self.dims.num_layers,
                               self._made)
        self._query_ns += time.perf_counter_ns() - t0
        self._queries += 1
        return out

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        return {**self._fit_stats, "query_us_mean": q}
