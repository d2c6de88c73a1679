"""``backend=engine`` with a continuous ``scheduler`` (fcfs, emoe): the test prompts served
by :func:`moeexp.engine.continuous.serve_continuous` on the run's device.

::

    run = serve_engine_continuous(loaded, prompts, predictor, cache, settings, scheduler,
                                  profile, serving=ServingSettings(...), kv_bytes_per_token=...,
                                  kv_pool_bytes=..., arrival_rate=..., seed=..., trace=test)

``settings`` is the engine backend group (conf/backend/engine.yaml): its EngineSettings
fields, ``device``, ``num_threads``, ``warmup``, ``progress``, ``replay_tokens`` (decode the
trace's tokens: the simulator's very passes; oracle's future). Decoding is greedy (EOS
suppressed, exactly ``output_len`` tokens) or token replay: ``sampling=top_k`` without
replay is refused (HF's sampler is not run per request here). ``reference`` is not served
(the normalised latencies of a continuous run are the simulator's ``ttft_norm_mean``).
``batch_decode``: the decoding requests of a pass run as one padded forward
(:mod:`moeexp.engine.padded_decode`) instead of one forward each (default False).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moeexp.engine.batch_pass import build_pass_model
from moeexp.engine.build import engine_settings
from moeexp.engine.continuous import ContinuousRun, serve_continuous
from moeexp.engine.serve import _warmup, resolve_device, run_on
from moeexp.engine.token_replay import recorded_tokens
from moeexp.errors import ConfigError
from moeexp.schedulers.base import Scheduler, ServingProfile
from moeexp.serving.arrivals import poisson_arrivals
from moeexp.serving.settings import ServingSettings
from moeexp.traces.schema import Trace


def eos_ids(model: Any) -> list[int]:
    """The model's EOS token ids (``generation_config``, else ``config``), possibly none."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def serve_engine_continuous(loaded: Any, prompts: Sequence[Any], predictor: Any, cache: Any,
                            settings: Mapping[str, Any], scheduler: Scheduler,
                            profile: ServingProfile, *, serving: ServingSettings,
                            kv_bytes_per_token: int, kv_pool_bytes: int | None,
                            arrival_rate: float | None, seed: int, trace: Trace | None,
                            slo_s: Mapping[int, tuple[float, float]] | None = None,
                            cost: Any = None) -> ContinuousRun:
    """Serve ``prompts`` (test split, arrival order) with continuous batching.

    Args:
        loaded: LoadedModel (model, adapter, ...).
        predictor / cache: fitted decision objects (the simulator's classes).
        settings: the engine backend group (module docstring).
        scheduler / profile / serving: admission policy, its fitted profile, the budgets.
        kv_bytes_per_token / kv_pool_bytes: KV reservation unit and pool (bytes).
        arrival_rate: Poisson requests/s (seeded by ``seed``: the simulator's arrivals,
            :func:`moeexp.serving.arrivals.poisson_arrivals`);
            None: offline, every request at 0.
        trace: the recorded test trace (token replay, the oracle's future).
        slo_s: request id -> (TTFT, e2e) targets in s, or None.
        cost: the run's cost model for ``Predictor.bind`` (None: not bound).
    """
    eng = engine_settings(settings)
    replay = bool(settings.get("replay_tokens", False)) and trace is not None
    forced = recorded_tokens(trace, prompts) if replay and trace is not None else None
    if forced is None and settings.get("sampling", "greedy") != "greedy":
        raise ConfigError("backend=engine with a continuous scheduler decodes greedily or "
                          "replays the trace's tokens (backend.replay_tokens=true); "
                          f"sampling={settings.get('sampling')!r} is not supported")
    if "future" in predictor.needs and forced is None:
        raise ConfigError(f"{predictor.name} needs the future: serve with "
                          "backend.replay_tokens=true (the recorded trace is its future)")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ConfigError(f"arrival_rate must be > 0 req/s or null, got {arrival_rate}")
    embeds = None
    if "prompt_embed" in predictor.needs:
        from moeexp.data.embed import embed_prompts

        embeds = embed_prompts([p.text for p in prompts])
    arrivals = (None if arrival_rate is None
                else poisson_arrivals(float(arrival_rate), len(prompts), int(seed)).tolist())
    device = resolve_device(settings.get("device"), loaded.model)
    with run_on(loaded.model, device, settings.get("num_threads")) as dev:
        _warmup(loaded, prompts, cache.capacity_slots, eng, settings)
        pm = build_pass_model(loaded.model, loaded.adapter, predictor, cache, eng,
                              system="engine", max_members=serving.max_running,
                              batch_decode=bool(settings.get("batch_decode", False)),
                              cost=cost)
        try:
            run = serve_continuous(
                pm, prompts, scheduler, profile, settings=serving,
                kv_bytes_per_token=kv_bytes_per_token, kv_pool_bytes=kv_pool_bytes,
                arrivals_s=arrivals, forced=forced,
                future=trace if "future" in predictor.needs else None, slo_s=slo_s,
                prompt_embeds=embeds, eos_token_ids=eos_ids(loaded.model),
                progress=bool(settings.get("progress", True)))
        finally:
            pm.close()
    for k, v in predictor.stats().items():
        run.metrics.setdefault(f"predictor_{k}", float(v))
    emulated = eng.bandwidth_bps if dev.type == "cpu" else None
    run.metrics["emulated_bandwidth_bps"] = float(emulated) if emulated else float("nan")
    run.metrics["arrival_rate"] = float(arrival_rate) if arrival_rate else float("nan")
    run.metrics["accesses_per_s"] = (run.metrics["accesses_total"] / run.metrics["engine_wall_s"]
                                     if run.metrics["engine_wall_s"] > 0 else float("nan"))
    if arrivals is not None:
        run.metrics["arrival_span_s"] = float(np.max(arrivals))
    return run
