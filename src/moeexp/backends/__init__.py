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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeexp.backends.base import BACKENDS, Backend, BackendContext, BackendResult
from moeexp.costmodel.fitted import load_cost_model
from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.registry import typed
from moeexp.schedulers import build_scheduler
from moeexp.schedulers.base import ServingProfile
from moeexp.serving.settings import ServingSettings, not_applicable_reason
from moeexp.simulator import simulate
from moeexp.simulator.continuous import serve
from moeexp.simulator.serving_profile import fit_serving_profile

__all__ = ["BACKENDS", "Backend", "BackendContext", "BackendResult"]



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
        progress: show a progress bar.
        cost_profile: path of a calibrated profile (``calibration.json`` of a
            ``sim_vs_engine`` run, :mod:`moeexp.costmodel.fitted`): its fitted cost model
            replaces the ``hardware`` profile's roofline; None = the hardware profile.
        serving: the batching loop's budgets and SLO targets for a continuous scheduler
            (``scheduler=fcfs|emoe``; keys of
            :class:`~moeexp.serving.settings.ServingSettings`); ignored by ``static``.
        predictor_feed_us: host µs charged on the critical path of every MoE layer of a
            pass handed to a predictor (any but ``none``): what feeding it costs a
            host-bound engine (``simulate(predictor_feed_s=...)``; the H200 engine's fitted
            gap was ~1280, ``experiments/real_scale/README.md``); 0 = free (the default).
            One number charges every predictor alike; a mapping ``{predictor: µs}`` (keys:
            ``predictor`` config names) charges each its own (the engine's measured feeds,
            ``sim_predictor_feed_us`` of a ``sim_vs_engine`` job with
            ``backend.predictor_feed=true``), and a run whose predictor it does not name
            raises. The run's charge is reported as the metric ``predictor_feed_us``.

    With ``scheduler=static`` (the default) it runs :func:`moeexp.simulator.simulate` as
    before; otherwise :func:`moeexp.simulator.continuous.serve` with the scheduler fitted
    on the store split (:func:`~moeexp.simulator.serving_profile.fit_serving_profile`).
    """

    batch_size: int = 1
    arrival_rate: float | None = None
    num_online_requests: int = 256
    restricted_routing: bool = False
    progress: bool = True
    cost_profile: str | None = None
    serving: Mapping[str, Any] | None = None
    predictor_feed_us: float | Mapping[str, float] = 0.0

    def __post_init__(self) -> None:
        _check_feed(self.predictor_feed_us)
        if self.batch_size < 1:
            raise ConfigError(f"backend=sim: batch_size must be >= 1, got {self.batch_size}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ConfigError(f"backend=sim: arrival_rate must be > 0 req/s or null, "
                              f"got {self.arrival_rate}")
        if self.num_online_requests < 1:
            raise ConfigError("backend=sim: num_online_requests must be >= 1")
        if self.cost_profile is not None and not Path(self.cost_profile).expanduser().is_file():
            raise ConfigError(f"backend=sim: cost_profile={self.cost_profile!r} does not exist "
                              "(a calibration.json written by +experiment=sim_vs_engine, or null)")
        self.settings()

    def settings(self) -> ServingSettings:
        """The ``serving`` block, typed and checked (ConfigError naming a bad key/value)."""
        return typed(ServingSettings, dict(self.serving or {}), "backend.serving")

    def run(self, ctx: BackendContext) -> BackendResult:
        online = self.arrival_rate is not None
        cost = ctx.cost
        if self.cost_profile is not None:
            cost = load_cost_model(self.cost_profile, ctx.trace.dims, dtype_bytes=cost.dtype_bytes)
        if ctx.scheduler is not None and ctx.scheduler.name != "static":
            return self._serve(ctx, cost)
        res = simulate(ctx.trace, ctx.predictor, ctx.cache, cost,
                       batch_size=self.batch_size, arrival_rate=self.arrival_rate,
                       restricted_routing=self.restricted_routing,
                       seed=ctx.seed, progress=self.progress,
                       num_requests=self.num_online_requests if online else None,
                       topology=ctx.topology, mechanics=ctx.mechanics,
                       execution=ctx.execution, predictor_feed_s=self._feed_s(ctx))
        metrics: dict[str, Any] = dict(res.metrics)
        if self.cost_profile is not None:
            metrics["cost_profile"] = str(self.cost_profile)
        return BackendResult(_with_feed(metrics, self._feed_us(ctx)), dict(res.series))

    def _feed_us(self, ctx: BackendContext) -> float:
        """µs per MoE layer fed: ``predictor_feed_us`` (the predictor's entry of a mapping)
        unless the predictor is none."""
        name = ctx.predictor.name
        if name == "none":
            return 0.0
        feed = self.predictor_feed_us
        if not isinstance(feed, Mapping):
            return float(feed)
        if name not in feed:
            raise ConfigError(f"backend.predictor_feed_us: no entry for predictor {name!r} "
                              f"(entries: {', '.join(sorted(feed)) or 'none'}); add one, or "
                              "give one number for every predictor")
        return float(feed[name])

    def _feed_s(self, ctx: BackendContext) -> float:
        """Seconds per MoE layer fed (:meth:`_feed_us`)."""
        return self._feed_us(ctx) * 1e-6

    def _serve(self, ctx: BackendContext, cost: Any) -> BackendResult:
        """Continuous batching under ``ctx.scheduler`` (a policy needing the whole future
        access stream is reported not applicable)."""
        assert ctx.scheduler is not None
        profile = _serving_profile(ctx, cost)
        if isinstance(profile, BackendResult):
            return profile
        online = self.arrival_rate is not None
        res = serve(ctx.trace, ctx.predictor, ctx.cache, cost, build_scheduler(ctx.scheduler),
                    profile, settings=self.settings(), kv_bytes_per_token=ctx.kv_bytes_per_token,
                    arrival_rate=self.arrival_rate, restricted_routing=self.restricted_routing,
                    seed=ctx.seed, progress=self.progress,
                    num_requests=self.num_online_requests if online else None,
                    predictor_feed_s=self._feed_s(ctx))
        metrics: dict[str, Any] = {
            **res.metrics, "serving_token_ms": profile.token_s * 1e3,
            "serving_token_batched_ms": profile.token_s_batched * 1e3,
            "serving_expert_load_ms": profile.expert_load_s * 1e3,
            "serving_output_len_mean": profile.output_len_mean,
            "kv_bytes_per_token": float(ctx.kv_bytes_per_token or cost.kv_bytes_per_token())}
        if self.cost_profile is not None:
            metrics["cost_profile"] = str(self.cost_profile)
        return BackendResult(_with_feed(metrics, self._feed_us(ctx)), dict(res.series))


def _check_feed(feed: Any) -> None:
    """``backend.predictor_feed_us``: a finite number >= 0, or a mapping of ``predictor``
    config names to such numbers (ConfigError naming what is wrong)."""
    def ok(v: Any) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and 0 <= v < float("inf"))

    if isinstance(feed, Mapping):
        unknown = sorted(str(k) for k in feed if k not in PREDICTORS)
        if unknown:
            raise ConfigError(f"backend.predictor_feed_us: unknown predictor(s) "
                              f"{', '.join(map(repr, unknown))}; valid: "
                              f"{', '.join(PREDICTORS.names())}")
        bad = {k: v for k, v in feed.items() if not ok(v)}
        if bad:
            raise ConfigError(f"backend.predictor_feed_us: every entry must be a finite "
                              f"number >= 0 (µs per MoE layer fed), got {bad!r}")
    elif not ok(feed):
        raise ConfigError(f"backend=sim: predictor_feed_us must be a finite number >= 0 "
                          f"(µs per MoE layer fed) or a mapping {{predictor: µs}}, "
                          f"got {feed!r}")


def _with_feed(metrics: dict[str, Any], feed_us: float) -> dict[str, Any]:
    """``metrics`` with ``predictor_feed_us``, the run's per-layer feed charge (µs), where
    one was charged (a free feed adds nothing: runs without one keep their metrics)."""
    if feed_us > 0.0:
        metrics["predictor_feed_us"] = feed_us
    return metrics


def _serving_profile(ctx: BackendContext, cost: Any) -> ServingProfile | BackendResult:
    """What both backends check before continuous batching: a policy needing the whole
    future access stream is reported not applicable (the result returned); else the
    serving profile fitted on the store split (a ConfigError without one)."""
    assert ctx.scheduler is not None
    reason = not_applicable_reason(ctx.cache)
    if reason is not None:
        return BackendResult({"status": "not_applicable", "not_applicable_reason": reason,
                              "scheduler": ctx.scheduler.name})
    if ctx.store is None:
        raise ConfigError(f"scheduler={ctx.scheduler.name}: needs the store split (its "
                          "serving profile is fitted there)")
    return fit_serving_profile(ctx.store, cost, ctx.cache.capacity_slots)


@BACKENDS.register("engine")
class EngineBackend:
    """The real engine (:func:`moeexp.engine.serve.serve_engine`), torch-backed.

    Accepts the keys of :class:`moeexp.engine.runtime.EngineSettings` plus ``sampling``,
    ``top_k``, ``temperature``, ``seed``, ``warmup``, ``progress``, ``device``,
    ``num_threads``, ``replay_tokens`` and ``reference`` (conf/backend/engine.yaml);
    anything else raises ConfigError, and so does ``device=cuda`` without CUDA (before
    any work). With ``replay_tokens`` the engine decodes the test trace's recorded tokens,
    so it serves the very forward passes ``backend=sim`` replays.
    """

    def __init__(self, **settings: Any) -> None:
        from moeexp.engine.serve import check_serve_settings  # torch: only when chosen

        check_serve_settings(settings)
        self.settings = dict(settings)
        rate = self.settings.get("arrival_rate")
        if rate is not None and not rate > 0:
            raise ConfigError(f"backend=engine: arrival_rate must be > 0 req/s or null, got {rate}")
        self.serving = typed(ServingSettings, dict(self.settings.get("serving") or {}),
                             "backend.serving")

    def run(self, ctx: BackendContext) -> BackendResult:
        from moeexp.engine.serve import serve_engine  # torch: only when chosen

        if ctx.scheduler is not None and ctx.scheduler.name != "static":
            return self._serve(ctx)
        settings = {"seed": ctx.seed, **self.settings}
        res = serve_engine(ctx.loaded, ctx.prompts, ctx.predictor, ctx.cache, settings,
                           trace=ctx.trace, execution=ctx.execution, cost=ctx.cost,
                           topology=ctx.topology, mechanics=ctx.mechanics)
        return BackendResult(dict(res.metrics), dict(res.series))

    def _serve(self, ctx: BackendContext) -> BackendResult:
        """Continuous batching under ``ctx.scheduler`` (:mod:`moeexp.engine.serve_continuous`),
        with the simulator's budgets, KV pool and SLO targets (:mod:`moeexp.backends.
        serving_check`); a policy needing the whole future stream is not applicable."""
        from moeexp.backends.serving_check import kv_pool_bytes, slo_targets
        from moeexp.engine.serve_continuous import serve_engine_continuous  # torch

        assert ctx.scheduler is not None
        if ctx.execution is not None and ctx.execution.name != "copy":
            raise ConfigError(f"backend=engine: execution={ctx.execution.name} runs with the "
                              f"static scheduler only; the continuous engine "
                              f"(scheduler={ctx.scheduler.name}) copies every miss")
        profile = _serving_profile(ctx, ctx.cost)
        if isinstance(profile, BackendResult):
            return profile
        slots = ctx.cache.capacity_slots
        kv = int(ctx.kv_bytes_per_token or ctx.cost.kv_bytes_per_token())
        run = serve_engine_continuous(
            ctx.loaded, ctx.prompts, ctx.predictor, ctx.cache, {"seed": ctx.seed, **self.settings},
            build_scheduler(ctx.scheduler), profile, serving=self.serving, kv_bytes_per_token=kv,
            kv_pool_bytes=kv_pool_bytes(ctx.cost, self.serving, slots),
            arrival_rate=self.settings.get("arrival_rate"), seed=ctx.seed, trace=ctx.trace,
            slo_s=slo_targets(ctx.trace, ctx.cost, self.serving), cost=ctx.cost)
        return BackendResult(dict(run.metrics), dict(run.series))


@BACKENDS.register("sim_vs_engine")
class SimVsEngineBackend:
    """Calibration (``+experiment=sim_vs_engine``): profile the engine, fit the simulator's
    cost model, run several systems both ways, write summary.csv (:mod:`moeexp.backends.sim_vs_engine`).
    Keys: those of :class:`moeexp.backends.sim_vs_engine.SimVsEngineSettings`."""

    def __init__(self, **settings: Any) -> None:
        from moeexp.backends.sim_vs_engine import SimVsEngineSettings  # pandas, torch: lazily

        self.settings = SimVsEngineSettings.from_mapping(settings)

    def run(self, ctx: BackendContext) -> BackendResult:
        from moeexp.backends.sim_vs_engine import run_sim_vs_engine  # pandas, torch: lazily

        metrics, series = run_sim_vs_engine(ctx, self.settings)
        return BackendResult(metrics, series)


@BACKENDS.register("eviction_landscape")
class EvictionLandscapeBackend:
    """``+experiment=eviction_landscape`` (issue 16): every cache policy x capacity x routing
    source on demand, moeexp's and libCacheSim's (:mod:`moeexp.landscape.backend`). Keys:
    those of :class:`moeexp.landscape.backend.LandscapeSettings` (conf/backend/
    eviction_landscape.yaml). libcachesim is the optional extra ``moeexp[cachesim]``."""

    def __init__(self, **settings: Any) -> None:
        from moeexp.landscape.backend import LandscapeBackend  # pandas, libcachesim: lazily

        self.impl = LandscapeBackend(**settings)

    def run(self, ctx: BackendContext) -> BackendResult:
        return self.impl.run(ctx)


@BACKENDS.register("serving_quality")
class ServingQualityBackend:
    """eMoE's quality at a serving operating point (issue 13, ``+experiment=
    emoe_serving_quality``): the simulator's substitution rate and the engine's measured
    agreement / perplexity for the same requests (:mod:`moeexp.eval.serving_quality`).
    Keys: those of :class:`moeexp.eval.serving_quality.ServingQualitySettings`."""

    def __init__(self, **settings: Any) -> None:
        from moeexp.eval.serving_quality import ServingQualityBackend as Impl  # torch: lazily

        self.impl = Impl(**settings)

    def run(self, ctx: BackendContext) -> BackendResult:
        return self.impl.run(ctx)
