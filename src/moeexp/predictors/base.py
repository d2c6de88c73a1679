"""The predictor interface: pure decisions on numpy arrays, shared by simulator and engine.

A predictor sees, in order, for every request and iteration of a replay or a real run::

    start_request(RequestStart)            -> Prediction  (e.g. semantic kNN, eMoE)
      start_iteration(IterationStart)      -> Prediction  (e.g. FineMoE semantic search)
        observe_layer(LayerObservation)    -> Prediction  (after layer l's router, before
                                                           its experts run)
        ... for l = 0..L-1
      end_iteration()
    end_request(request_id)

Every hook returns a :class:`Prediction`: prefetch requests (layer, expert, priority;
higher priority is issued first) and optional per-layer expert scores that a cache policy
may use for eviction (FineMoE's p, MoE-Infinity's pEAM). The mechanism (simulator or
engine) decides *when* bytes move; the predictor never sees bytes, time or torch. It may
read the run's *prices* (:meth:`Predictor.bind`: the cost model, with its copy and compute
times, before the first request; the simulator calls it), never the mechanism's clock.

A predictor may also rest for a whole pass (:meth:`Predictor.feeding`, asked by the mechanism
as each pass begins): the pass's ``start_iteration``, ``observe_layer`` and ``end_iteration``
are then not called, and the host cost of feeding it (:meth:`Predictor.set_feed_cost`) is not
paid. The default predictor is always fed. While it rests the mechanism still hands each
layer's routing to :meth:`Predictor.rest_layer` (a :class:`RestLayer`: the layer, the
pass's token count and the experts it routes to, which a CPU execution holds on the host
anyway), where a predictor may return what it knows without being fed (``reuse_prob``'s model-free next-layer offers);
the default returns nothing, and this call is not priced.

``predicted`` in a Prediction lists, per layer, the experts the predictor believes will be
used even when it does not prefetch them (used for ``prediction_recall``); by default the
prefetched experts count as predicted.

A predictor that needs recorded extras declares them in ``needs``: ``"spec_probs"``
(speculative gate outputs), ``"hidden"`` (hidden states), ``"prompt_embed"`` (sentence
embedding of the prompt), ``"embed"`` (embedding-layer outputs), ``"router_probs"`` (full
router probabilities, for a predictor that cannot use the scattered top-k weights a
routing-only trace gives instead), ``"future"`` (the true accesses of the iteration:
oracle only). A predictor needing what a trace lacks is not applicable to it
(:func:`moeexp.traces.schema.missing_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from moeexp.registry import Registry
from moeexp.traces.schema import RequestMeta, Trace, TraceDims


@dataclass(frozen=True, order=True)
class Prefetch:
    """Fetch expert ``expert`` of MoE layer ``layer``; larger ``priority`` goes first."""

    priority: float
    layer: int
    expert: int


@dataclass
class Prediction:
    """What a predictor hook returns.

    Attributes:
        prefetch: requests to move experts to the device.
        scores: layer -> float[J] expert probabilities for that layer (cache hints).
        predicted: layer -> int[n] experts predicted for that layer (recall accounting);
            layers absent here fall back to the prefetched experts of that layer.

    A predictor may return the same Prediction object (and the same arrays in it) again
    (``expert_map`` memoises its one-query emits): the mechanisms only read a prediction;
    nothing may modify one it was given.
    """

    prefetch: list[Prefetch] = field(default_factory=list)
    scores: dict[int, np.ndarray] = field(default_factory=dict)
    predicted: dict[int, np.ndarray] = field(default_factory=dict)

    def extend(self, other: Prediction) -> None:
        self.prefetch.extend(other.prefetch)
        self.scores.update(other.scores)
        self.predicted.update(other.predicted)


EMPTY = Prediction()


@dataclass(frozen=True)
class RequestStart:
    """A request begins. ``prompt_embed``: float32[E] sentence embedding, if recorded."""

    request: RequestMeta
    prompt_embed: np.ndarray | None = None


@dataclass(frozen=True)
class IterationStart:
    """An iteration (one forward pass) begins.

    Attributes:
        request_ids: int[B] requests in the batch.
        step: 0 for prefill, s >= 1 for the s-th decode step.
        embed: float32[T, H] embedding-layer output of the iteration's tokens (all of the
            batch, concatenated); None when the trace has none (a routing-only trace: a
            predictor that reads it declares ``"embed"`` in ``needs``).
        token_request: int[T] request id of each token row.
        future: for ``needs={"future"}`` only: L arrays, the experts each layer will use.
    """

    request_ids: np.ndarray
    step: int
    embed: np.ndarray | None
    token_request: np.ndarray
    future: tuple[np.ndarray, ...] | None = None


@dataclass(frozen=True)
class LayerObservation:
    """Layer ``layer``'s router has run for this iteration's tokens.

    Attributes:
        layer: MoE layer index l in 0..L-1.
        probs: float32[T, J] router probabilities.
        experts: int[n] sorted union of the selected experts over the tokens.
        counts: int[J] tokens routed to each expert.
        spec_probs: float32[T, D, J] softmax(gate_{l+d}(h_l)) for d = 1..D, if needed.
        hidden: float32[T, H] hidden state entering layer l, if needed.
    """

    layer: int
    probs: np.ndarray
    experts: np.ndarray
    counts: np.ndarray
    spec_probs: np.ndarray | None = None
    hidden: np.ndarray | None = None


@dataclass(frozen=True)
class RestLayer:
    """Layer ``layer``'s router has run in a pass the predictor rests (:meth:`Predictor.
    rest_layer`); ``tokens``: T, the pass's tokens (1: a decode step of one request);
    ``experts``: int[n], the sorted union of the experts its tokens route to."""

    layer: int
    tokens: int
    experts: np.ndarray


def layer_observations(probs: np.ndarray, experts: Sequence[np.ndarray], counts: np.ndarray,
                       spec_probs: np.ndarray | None,
                       hidden: np.ndarray | None) -> list[LayerObservation]:
    """One :class:`LayerObservation` per layer l = 0..L-1 of a pass, from layer-major
    arrays: ``probs`` float32[L, T, J], ``counts`` int[L, J], ``spec_probs`` [L, T, D, J]
    and ``hidden`` [L, T, H] (None: not recorded), ``experts`` L int arrays.

    The same frozen objects as the constructor's, built by filling their ``__dict__``: the
    frozen ``__init__`` sets each field through ``object.__setattr__``, three times slower,
    and a replay builds one per layer of every pass."""
    new, cls = object.__new__, LayerObservation
    out: list[LayerObservation] = []
    for layer in range(len(probs)):
        obs = new(cls)
        obs.__dict__.update(layer=layer, probs=probs[layer], experts=experts[layer],
                            counts=counts[layer],
                            spec_probs=None if spec_probs is None else spec_probs[layer],
                            hidden=None if hidden is None else hidden[layer])
        out.append(obs)
    return out


class Predictor:
    """Base class: predicts nothing. Subclasses override the hooks they need.

    Constructors take keyword arguments only (the config keys) plus ``dims``.
    """

    name: ClassVar[str] = "none"
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, dims: TraceDims) -> None:
        self.dims = dims

    def fit(self, store: Trace) -> None:
        """Learn from the store split (never the test split). Default: nothing to learn."""

    def bind(self, cost: object, caches: Sequence[object]) -> None:
        """The run's cost model and cache policies, before the first request (the simulator
        calls it, and the engine when it is given a cost model). A policy that owns both
        decisions (``reuse_prob`` with the ``next_use`` cache) reads the copy and compute
        times here. Default: nothing."""

    def set_feed_cost(self, seconds: float) -> None:
        """What feeding this predictor costs the run per MoE layer of a pass it is fed
        (host seconds on the critical path: the simulator's ``predictor_feed_s``, or the
        engine's cost measured by :func:`moeexp.engine.profile.profile_feed`), before the
        first request; 0 = free. A policy that weighs running its predictor at all against
        that cost (``reuse_prob`` with the ``next_use`` cache) reads it here. Default:
        nothing."""

    def feeding(self, tokens: int = 1) -> bool:
        """Whether the pass about to begin, of ``tokens`` token rows (1 in a one-token
        decode step; a prefill or a decode pass of several requests has more), is handed
        to this predictor (asked once per pass, before ``start_iteration``; False: the
        pass's ``start_iteration``, ``observe_layer`` and ``end_iteration`` are skipped,
        and the simulator charges no feed cost for it). Default: always."""
        return True

    def rest_layer(self, obs: RestLayer) -> Prediction:
        """Layer ``obs.layer``'s router has run in a pass this predictor rests (``feeding``
        said False): what it can offer without being fed (no feed cost is charged for it,
        so it must need no more than the layer's routing and O(J) host work). Default: nothing (the
        mechanisms skip the call when a class does not override it)."""
        return EMPTY

    def start_request(self, ctx: RequestStart) -> Prediction:
        return Prediction()

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        return Prediction()

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        return Prediction()

    #: whether :meth:`preview_pass` does anything (the simulator skips the call otherwise)
    previews: ClassVar[bool] = False

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        """Optional speed hook (the simulator calls it when :attr:`previews`; the engine
        never does): every layer's observation of the pass that starts, after
        ``start_iteration`` and before ``observe_layer(obs[0])``.

        A predictor may batch with it the numpy work that ``observe_layer(obs[l])`` would do
        on ``obs[l]`` alone, with the same operations, so that what each ``observe_layer``
        returns is bit-identical with or without the preview: never use a layer's
        observation before that layer is observed. ``observe_layer`` must check that it
        receives the previewed observations (else compute as without a preview). Default:
        nothing."""

    def end_iteration(self) -> None:
        """The iteration finished (online predictors may learn from it here)."""

    def end_request(self, request_id: int) -> None:
        """The request finished."""

    def stats(self) -> dict[str, float]:
        """Extra metrics (e.g. parameter count, query time); flat scalars."""
        return {}


PREDICTORS: Registry[Predictor] = Registry("predictor")
PREDICTORS.register("none")(Predictor)


def overrides(predictor: Predictor, hook: str) -> bool:
    """Whether ``predictor``'s class overrides the base-class ``hook`` (else it is a no-op)."""
    return getattr(type(predictor), hook) is not getattr(Predictor, hook)


def topk_prefetch(layer: int, scores: np.ndarray, k: int, priority: float) -> list[Prefetch]:
    """Prefetches for the ``k`` highest ``scores`` (float[J]) of ``layer``, best first."""
    order = np.argsort(-scores, kind="stable")[:k]
    return [Prefetch(priority - 1e-6 * i, layer, int(e)) for i, e in enumerate(order)]
