"""Backends (the ``backend`` config group): what serves a run's test split.

``sim`` replays the recorded trace through the simulator and the cost model; ``engine``
serves the test prompts through the real offloading engine (:mod:`moeexp.engine`, torch,
imported only when chosen). A backend is built as ``BACKENDS.build(name, **rest_of_group)``
(a misspelled key fails, naming the accepted ones) and run as::

    backend.run(ctx: BackendContext) -> BackendResult(metrics, series)

The pipeline fills the context (model, test prompts, test trace, fitted predictor and
cache, cost model, seed); a new backend registers a class here and gets the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.traces.schema import Trace


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend may need for one run.

    Attributes:
        loaded: the LoadedModel (model, tokenizer, adapter, name).
        prompts: the test-split prompts (moeexp.data.prompts.Prompt), in request order.
        trace: the test split of the routing trace.
        predictor: fitted on the store split.
        cache: fitted on the store split; ``capacity_slots`` is the budget.
        cost: the cost model (simulated hardware profile).
        seed: the run's seed (``trace.seed``).
    """

    loaded: Any
    prompts: list[Any]
    trace: Trace
    predictor: Any
    cache: Any
    cost: Any
    seed: int


@dataclass
class BackendResult:
    """``metrics``: flat scalars (moeexp.metrics.CORE_KEYS + extras); ``series``: per-step lists."""

    metrics: dict[str, Any]
    series: dict[str, list[Any]] = field(default_factory=dict)


class Backend(Protocol):
    """Serves the test split with a predictor and a cache policy."""

    def run(self, ctx: BackendContext) -> BackendResult: ...


BACKENDS: Registry[Backend] = Registry("backend")


@BACKENDS.register("sim")
@dataclass(frozen=True)
class SimBackend:
    """Trace replay (:func:`moeexp.simulator.simulate`).

    Args:
        batch_size: requests per batch (a layer's experts are the union over the batch).
        arrival_rate: requests per second for the online mode (Poisson arrivals, seeded by
            ``trace.seed``); None = offline (requests back to back).
        num_online_requests: requests served in the online mode (FineMoE: 256; the test
            split is cycled through); ignored offline.
        restricted_routing: eMoE's restricted routing (substitute a resident expert).
        renormalize: renormalise routing weights after a substitution (model output only).
        progress: show a progress bar.
    """

    batch_size: int = 1
    arrival_rate: float | None = None
    num_online_requests: int = 256
    restricted_routing: bool = False
    renormalize: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"backend=sim: batch_size must be >= 1, got {self.batch_size}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ConfigError(f"backend=sim: arrival_rate must be > 0 req/s or null, "
                              f"got {self.arrival_rate}")
        if self.num_online_requests < 1:
            raise ConfigError("backend=sim: num_online_requests must be >= 1")

    def run(self, ctx: BackendContext) -> BackendResult:
        from moeexp.simulator import simulate

        online = self.arrival_rate is not None
        res = simulate(ctx.trace, ctx.predictor, ctx.cache, ctx.cost,
                       batch_size=self.batch_size, arrival_rate=self.arrival_rate,
                       restricted_routing=self.restricted_routing, renormalize=self.renormalize,
                       seed=ctx.seed, progress=self.progress,
                       num_requests=self.num_online_requests if online else None)
        return BackendResult(dict(res.metrics), dict(res.series))


@BACKENDS.register("engine")
class EngineBackend:
    """The real engine (:func:`moeexp.engine.backend.run_engine_backend`), torch-backed.

    Accepts the keys of :class:`moeexp.engine.runtime.EngineSettings` plus the decoding
    keys ``sampling``, ``top_k``, ``temperature``, ``seed``, ``warmup``, ``progress``;
    anything else raises ConfigError.
    """

    def __init__(self, **settings: Any) -> None:
        from moeexp.engine.backend import _DECODE_KEYS
        from moeexp.engine.runtime import EngineSettings

        valid = {f.name for f in fields(EngineSettings)} | set(_DECODE_KEYS)
        unknown = sorted(set(settings) - valid)
        if unknown:
            raise ConfigError(f"backend=engine: unknown key(s) {unknown}. Accepted keys: "
                              f"{', '.join(sorted(valid))}")
        self.settings = dict(settings)

    def run(self, ctx: BackendContext) -> BackendResult:
        from moeexp.engine.backend import run_engine_backend

        settings = {"seed": ctx.seed, **self.settings}
        metrics = run_engine_backend(ctx.loaded, ctx.prompts, ctx.predictor, ctx.cache, settings)
        return BackendResult(dict(metrics))
