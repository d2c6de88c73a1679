"""Speculative gating: a later layer's router applied to the current hidden state.

``speculative_gate`` (Mixtral-Offloading, algorithms.md §2): while layer l runs, apply layer
l+d's router to layer l's input hidden state h_l and prefetch its top-K for layer l+d
(``distance`` d, default 1 as in Mixtral-Offloading and FineMoE's re-implementation).

``promoe`` (FineMoE's emulation of ProMoE's "stride" prefetch, algorithms.md §3): at layer l,
apply the router of layer l+d-1 to the current hidden state h_l and prefetch its top-K for
that one layer l+d-1, with d = ``distance`` (the model's prefetch distance by default).
So ``promoe`` with distance d predicts exactly what ``speculative_gate`` with distance d-1
predicts. With d = 1 the "router of layer l+d-1" is layer l's own router: the prefetch is
for the running layer, from the real router output, i.e. no look-ahead at all (it
degenerates to on-demand loading and its prediction recall is trivially 1); a warning says
so.

Both read the recorded speculative gate outputs ``spec_probs[t, l, d-1] =
softmax(gate_{l+d}(h_l))`` (trace option ``trace.spec_depth >= d``). With several tokens in
an iteration (prefill, batches) the layer will use the union of every token's top-K, so
by default (``aggregate: union``) the prediction is the union of each token's top-K of the
speculative probabilities; ``aggregate: mean`` takes the top-K of the token-mean instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    PREDICTORS,
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
)
from moeexp.traces.schema import Trace, TraceDims

log = logging.getLogger(__name__)

Aggregate = Literal["union", "mean"]


def aggregate_topk(probs: np.ndarray, k: int, how: Aggregate = "union") -> tuple[np.ndarray, np.ndarray]:
    """Experts predicted from per-token expert probabilities.

    Args:
        probs: float[T, J] per-token probabilities (or scores) over the J experts.
        k: experts per token.
        how: ``union`` = union over tokens of each token's top-k, ordered by how many tokens
            chose the expert, then by mean probability; ``mean`` = top-k of the token-mean.

    Returns:
        (experts int64[n] best first, mean float64[J] token-mean probabilities).
    """
    p = np.asarray(probs, dtype=np.float64).reshape(-1, probs.shape[-1])
    J = p.shape[1]
    k = min(k, J)
    if p.shape[0] == 1:  # one token: its row is the mean (the same bits as mean(axis=0))
        mean = p[0].copy()
        # stable descending order: ties by index, as lexsort((arange(J), -mean)) orders
        return np.argsort(-mean, kind="stable")[:k].astype(np.int64), mean
    mean = p.mean(axis=0)
    if how == "mean":
        order = np.lexsort((np.arange(J), -mean))[:k]
        return order.astype(np.int64), mean
    top = np.argsort(-p, axis=1, kind="stable")[:, :k]
    votes = np.bincount(top.reshape(-1), minlength=J)
    chosen = np.flatnonzero(votes > 0)
    order = chosen[np.lexsort((chosen, -mean[chosen], -votes[chosen]))]
    return order.astype(np.int64), mean


def one_token_topk(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`aggregate_topk` of n one-token passes at once: ``rows`` float[n, J], one
    token's probabilities each. Returns (read-only int64[n, min(k, J)] each row's experts
    best first, read-only float64[n, J] the rows, each one's token-mean): the same values
    as its one-token branch row by row (the same stable argsort per row)."""
    mean = np.array(rows, dtype=np.float64)
    mean.setflags(write=False)
    order = np.argsort(-mean, axis=1, kind="stable")[:, :min(k, mean.shape[1])].astype(np.int64)
    order.setflags(write=False)
    return order, mean


#: :func:`layer_prediction`'s memo: (layer, experts best first) -> (the prefetch requests,
#: the experts as a read-only int64 array); both shared by the Predictions made from it
Made = dict[tuple[int, ...], tuple[list[Prefetch], np.ndarray]]
#: entries a :data:`Made` memo holds before it is cleared (many experts: many orders)
MADE_ENTRIES = 1 << 16


def layer_prediction(layer: int, experts: np.ndarray, scores: np.ndarray | None,
                     num_layers: int, made: Made | None = None) -> Prediction:
    """Prefetch ``experts`` (best first) for ``layer``; nearer layers get higher priority.

    Priority = (L - layer) - 1e-3 * rank, so a predictor's earlier target layers are issued
    before later ones and, within a layer, the better experts first. ``made``: the
    caller's memo (:data:`Made`) of what depends on (layer, experts) only: the same
    requests and experts, made once (the mechanisms only read a Prediction; a read-only
    array's set is remembered by :class:`~moeexp.prefetching.PredictionSets`).
    """
    if made is None:
        base = float(num_layers - layer)
        pf = [Prefetch(base - 1e-3 * i, layer, int(e)) for i, e in enumerate(experts)]
        chosen = np.asarray(experts, dtype=np.int64)
    else:
        key = (layer, *experts.tolist())
        got = made.get(key)
        if got is None:
            if len(made) >= MADE_ENTRIES:
                made.clear()
            base = float(num_layers - layer)
            chosen = np.array(key[1:], dtype=np.int64)
            chosen.setflags(write=False)
            got = made[key] = ([Prefetch(base - 1e-3 * i, layer, e)
                                for i, e in enumerate(key[1:])], chosen)
        pf, chosen = got
    out = Prediction(prefetch=pf, predicted={layer: chosen})
    if scores is not None:
        out.scores[layer] = np.asarray(scores, dtype=np.float64)
    return out


def require_array(store: Trace, field: str, option: str, who: str) -> None:
    """ConfigError naming the trace option when ``store`` lacks an optional array."""
    if getattr(store, field) is None:
        raise ConfigError(
            f"predictor={who} needs the trace's {field!r} array, which this trace does not "
            f"hold; record it with {option}")


class _SpecBase(Predictor):
    """Shared machinery: prefetch for ``layer + offset`` from speculative index ``spec``."""

    needs = frozenset({"spec_probs"})

    def __init__(self, *, dims: TraceDims, offset: int, top_k: int | None,
                 aggregate: Aggregate) -> None:
        super().__init__(dims=dims)
        if aggregate not in ("union", "mean"):
            raise ConfigError(f"{self.name}: aggregate must be 'union' or 'mean', got {aggregate!r}")
        self.offset = offset
        self.top_k = dims.top_k if top_k is None else int(top_k)
        if self.top_k < 1:
            raise ConfigError(f"{self.name}: top_k must be >= 1, got {self.top_k}")
        self.aggregate: Aggregate = aggregate
        self._query_ns = 0
        self._queries = 0
        self._pre: tuple[list[np.ndarray], np.ndarray, np.ndarray] | None = None
        self._made: Made = {}

    previews = True

    def _source(self, obs: LayerObservation) -> np.ndarray | None:
        """float[T, J]: what layer ``obs.layer`` ranks (its router, or the gate at offset)."""
        if self.offset == 0:
            return obs.probs
        return None if obs.spec_probs is None else obs.spec_probs[:, self.offset - 1, :]

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """A pass of one token: every layer's :func:`aggregate_topk` at once (its one-token
        branch: the float64 row and its stable descending order, by one argsort over the
        stacked rows), bit-identical. Passes of several tokens are not previewed."""
        self._pre = None
        if len(obs) != self.dims.num_layers or self.offset != 0 and any(
                o.spec_probs is None for o in obs):
            return
        src = [self._source(o) for o in obs]
        if any(a is None or len(a) != 1 for a in src):
            return
        order, rows = one_token_topk(np.asarray([a[0] for a in src if a is not None]),
                                     self.top_k)  # [L, k], [L, J]
        self._pre = ([obs[i].spec_probs if self.offset else obs[i].probs  # type: ignore[misc]
                      for i in range(len(obs))], order, rows)

    def fit(self, store: Trace) -> None:
        if self.offset == 0:
            return
        require_array(store, "spec_probs", f"trace.spec_depth >= {self.offset}", self.name)
        if store.dims.spec_depth < self.offset:
            raise ConfigError(
                f"predictor={self.name} needs speculative gates at distance {self.offset}, but "
                f"the trace recorded spec_depth={store.dims.spec_depth}; set "
                f"trace.spec_depth >= {self.offset}")

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        t0 = time.perf_counter_ns()
        target = obs.layer + self.offset
        L = self.dims.num_layers
        if target >= L:
            return Prediction()
        pre = self._pre
        if pre is not None and pre[0][obs.layer] is (obs.spec_probs if self.offset
                                                     else obs.probs):
            experts, mean = pre[1][obs.layer], pre[2][obs.layer]
        else:
            probs = self._source(obs)
            if probs is None:
                raise ConfigError(
                    f"predictor={self.name}: the mechanism passed no spec_probs; record the "
                    f"trace with trace.spec_depth >= {self.offset}")
            experts, mean = aggregate_topk(probs, self.top_k, self.aggregate)
        out = layer_prediction(target, experts, mean, L, self._made)
        self._query_ns += time.perf_counter_ns() - t0
        self._queries += 1
        return out

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        return {"params": 0.0, "query_us_mean": q}


@PREDICTORS.register("speculative_gate")
class SpeculativeGate(_SpecBase):
    """Mixtral-Offloading's speculative prefetch: top-K of gate_{l+d}(h_l) for layer l+d.

    Args:
        dims: trace dimensions.
        distance: d >= 1 (default 1).
        top_k: experts per token to prefetch (default: the model's K).
        aggregate: ``union`` (default) or ``mean`` over the iteration's tokens.
    """

    def __init__(self, *, dims: TraceDims, distance: int = 1, top_k: int | None = None,
                 aggregate: Aggregate = "union") -> None:
        L = dims.num_layers
        if not 1 <= int(distance) <= L - 1:  # layer l + d must exist for some layer l
            raise ConfigError(f"speculative_gate: distance must be in 1..{L - 1} (the model "
                              f"has {L} MoE layers), got {distance}")
        super().__init__(dims=dims, offset=int(distance), top_k=top_k, aggregate=aggregate)
        self.distance = int(distance)


@PREDICTORS.register("promoe")
class ProMoEStride(_SpecBase):
    """FineMoE's ProMoE emulation: at layer l, router of layer l+d-1 on h_l, for layer l+d-1.

    Args:
        dims: trace dimensions.
        distance: d >= 1 (config default: the model's ``prefetch_distance``).
        top_k: experts per token to prefetch (default: the model's K).
        aggregate: ``union`` (default) or ``mean`` over the iteration's tokens.
    """

    def __init__(self, *, dims: TraceDims, distance: int = 2, top_k: int | None = None,
                 aggregate: Aggregate = "union") -> None:
        L = dims.num_layers
        if not 1 <= int(distance) <= L:  # layer l + d - 1 must exist for some layer l
            raise ConfigError(f"promoe: distance must be in 1..{L} (the model has {L} MoE "
                              f"layers), got {distance}")
        if int(distance) == 1:
            log.warning("promoe with distance 1 prefetches the running layer from its own "
                        "router: no look-ahead (on-demand), prediction recall is trivially 1")
        super().__init__(dims=dims, offset=int(distance) - 1, top_k=top_k, aggregate=aggregate)
        self.distance = int(distance)
