"""``oracle``: perfect knowledge of the current iteration's accesses (``needs={"future"}``).

At every iteration start it prefetches the true experts of the next ``lookahead`` layers
(default: all), nearest layer first (priority ``L - l``), and declares every layer's true
experts as its prediction (recall = precision = 1). After layer l's router it re-issues
the whole window l+1 .. l+lookahead (``reissue``, default): a prefetch the cache refused
earlier may be accepted now (``belady`` admits a prefetch only once MIN's victim for it is
no longer needed); the mechanism ignores keys already queued or resident. With
``reissue: false`` only the layer entering the window is issued (cheaper; on a Mixtral-
shaped random trace at 25 % capacity: hit rate 0.792 instead of 0.811). With ``belady``
it forms the ``oracle`` system (MIN's replacements, made early: prefetch_rule
conservative) and ``oracle_aggressive`` (Cao et al.'s Aggressive rule: prefetches in
access order as soon as the link is free; the latency reference, at or above every exact
system; see :mod:`moeexp.cache.belady`).
"""

from __future__ import annotations

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
from moeexp.traces.schema import TraceDims


@PREDICTORS.register("oracle")
class OraclePredictor(Predictor):
    """Prefetch the true experts of upcoming layers.

    Args:
        dims: trace dims.
        lookahead: how many layers ahead to prefetch (None: the rest of the iteration).
        reissue: re-issue the whole window after each layer (default true; false: only the
            layer entering the window is issued).
    """

    needs = frozenset({"future"})

    def __init__(self, *, dims: TraceDims, lookahead: int | None = None, reissue: bool = True) -> None:
        super().__init__(dims=dims)
        if lookahead is not None and lookahead < 1:
            raise ConfigError(f"oracle: lookahead must be >= 1 or null, got {lookahead}")
        self.lookahead = dims.num_layers if lookahead is None else int(lookahead)
        self.reissue = bool(reissue)
        self._flat: list[Prefetch] = []
        self._offsets: list[int] = [0] * (dims.num_layers + 1)
        # every request this predictor can make (priority L - layer), built once
        L = dims.num_layers
        self._table = [[Prefetch(float(L - layer), layer, e) for e in range(dims.num_experts)]
                       for layer in range(L)]

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        if ctx.future is None:
            raise ConfigError("oracle needs the future accesses (IterationStart.future); the mechanism gave none")
        L = self.dims.num_layers
        table = self._table
        flat: list[Prefetch] = []
        offsets = [0]
        for layer, experts in enumerate(ctx.future):
            es = np.asarray(experts).tolist()
            if es and not (0 <= min(es) and max(es) < self.dims.num_experts):
                raise ValueError(f"oracle: layer {layer}'s future experts {es} are outside "
                                 f"0..{self.dims.num_experts - 1}")
            row = table[layer]
            flat.extend(row[e] for e in es)
            offsets.append(len(flat))
        self._flat, self._offsets = flat, offsets
        predicted = {layer: np.asarray(e, dtype=np.int64) for layer, e in enumerate(ctx.future)}
        return Prediction(prefetch=flat[: offsets[min(L, self.lookahead)]], predicted=predicted)

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        L = self.dims.num_layers
        hi = min(L, obs.layer + 1 + self.lookahead)
        lo = obs.layer + 1 if self.reissue else hi - 1
        if lo >= hi or lo < obs.layer + 1:
            return Prediction()
        return Prediction(prefetch=self._flat[self._offsets[lo]: self._offsets[hi]])
