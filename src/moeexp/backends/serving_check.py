"""Continuous batching on both backends at one operating point, and the simulator's error.

::

    out = sim_vs_engine_serving(loaded, prompts, test_trace, store, cost,
                                system="deepspeed", scheduler="fcfs", capacity=0.25,
                                serving=ServingSettings(max_running=4), arrival_rate=None)
    out.metrics["ttft_mean_err_pct"], out.metrics["passes_match"], ...

Both backends serve the same requests (the test prompts and the trace recorded for them;
the engine decodes the trace's tokens, so a request's passes route the same), with the
same scheduler (a fresh object each), the same fitted policies (fresh, fitted on the same
store), the same budgets (T_max, max_running, the KV pool = device memory - weights -
expert cache, reservations of ``kv_bytes_per_token`` x (prompt + profiled output)), the
same Poisson arrivals and the same SLO targets (the simulator's: scale x the unloaded
latency under ``cost``). What must match when the admission does not depend on timing
(offline arrivals under fcfs) and the system decides without timing (no prefetch, or
``prefetch_wait``): the admission order, every pass's members, hence its tokens, and for
a deterministic system (deepspeed, no_offload) the hits of every pass. Timing is the cost
model's against the wall clock: ``*_err_pct`` = (sim - engine) / engine of the means, and
request-by-request MAPE; ``*_pass_ms_intercept`` / ``*_pass_ms_per_request``: each
backend's least-squares line of a pass's time against its requests (:func:`pass_line`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeexp.cache import build_cache
from moeexp.costmodel.roofline import CostModel
from moeexp.predictors import build_predictor
from moeexp.schedulers import build_scheduler
from moeexp.serving.settings import ServingSettings
from moeexp.simulator.continuous import serve, slo_targets_s
from moeexp.simulator.plan import Plan
from moeexp.simulator.serving_profile import fit_serving_profile
from moeexp.systems import resolve_system
from moeexp.traces.schema import Trace


def slo_targets(trace: Trace, cost: CostModel, settings: ServingSettings
                ) -> dict[int, tuple[float, float]]:
    """request id -> (TTFT target s, e2e target s): the task's scales x the request's
    latency alone with every expert resident under ``cost`` (the simulator's targets;
    NaN TTFT without a prefill)."""
    plan = Plan(trace, cost, batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    return {meta.request_id: t
            for meta, t in zip(plan.unit_request, slo_targets_s(plan, settings), strict=True)}


def kv_pool_bytes(cost: CostModel, settings: ServingSettings, capacity_slots: int) -> int:
    """The KV pool: device memory (``device_memory_gb``, else the profile's) minus the
    always-resident weights and the expert cache, bytes (as the simulator's ``serve``)."""
    gb = settings.device_memory_gb if settings.device_memory_gb is not None else cost.profile.memory_gb
    return int(round(gb * 1e9)) - cost.gpu_mem_bytes(capacity_slots)


@dataclass
class ServingComparison:
    """``metrics``: flat errors and match flags; ``requests``: one row per request;
    ``passes``: one row per pass index (requests, tokens, hits, ms of each backend; NaN
    where one backend ran fewer passes); ``sim`` / ``engine``: each backend's metrics."""

    metrics: dict[str, Any]
    requests: list[dict[str, Any]]
    passes: list[dict[str, Any]]
    sim: dict[str, Any]
    engine: dict[str, Any]


def _err_pct(sim: float, eng: float) -> float:
    return float((sim - eng) / eng * 100) if np.isfinite(sim) and np.isfinite(eng) and eng else float("nan")


def _mape(sim: Sequence[float], eng: Sequence[float]) -> float:
    pairs = [(a, b) for a, b in zip(sim, eng, strict=True)
             if np.isfinite(a) and np.isfinite(b) and b > 0]
    return float(np.mean([abs(a - b) / b for a, b in pairs]) * 100) if pairs else float("nan")


def pass_line(requests: Sequence[float], ms: Sequence[float]) -> dict[str, float]:
    """Least-squares line of each pass's milliseconds against its requests:
    ``pass_ms_intercept`` + ``pass_ms_per_request`` x requests (NaN with fewer than two
    distinct request counts)."""
    x, y = np.asarray(requests, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    if len(np.unique(x[ok])) < 2:
        return {"pass_ms_intercept": float("nan"), "pass_ms_per_request": float("nan")}
    slope, icpt = np.polyfit(x[ok], y[ok], 1)
    return {"pass_ms_intercept": float(icpt), "pass_ms_per_request": float(slope)}


def _sim_admission(series: Mapping[str, list[Any]]) -> list[int]:
    """Request ids by admission time (arrival + queueing); ties keep arrival order."""
    start = np.asarray(series["arrival_ms"]) + np.asarray(series["queue_ms"])
    order = np.argsort(np.round(start, 9), kind="stable")
    return [int(series["request_id"][i]) for i in order]


def _policies(system: str, capacity: Any, prefetch_distance: int, store: Trace
              ) -> tuple[list[tuple[Any, Any]], dict[str, Any]]:
    """Two (predictor, cache) pairs of ``system``, each fitted on ``store``; its settings."""
    pcfg, ccfg, sys_settings = resolve_system(
        system, None, {"capacity": capacity}, model={"prefetch_distance": prefetch_distance})
    objs = []
    for _ in range(2):
        pred, pol = build_predictor(pcfg, store.dims), build_cache(ccfg, store.dims)
        pred.fit(store)
        pol.fit(store)
        objs.append((pred, pol))
    return objs, sys_settings


def sim_vs_engine_serving(loaded: Any, prompts: Sequence[Any], trace: Trace, store: Trace,
                          cost: CostModel, *, system: str = "deepspeed",
                          scheduler: str | Mapping[str, Any] = "fcfs",
                          capacity: float | int | str = 0.25,
                          serving: ServingSettings | None = None,
                          arrival_rate: float | None = None, seed: int = 0,
                          kv_bytes_per_token: int | None = None, prefetch_distance: int = 1,
                          engine: Mapping[str, Any] | None = None) -> ServingComparison:
    """Serve ``prompts`` with continuous batching in the simulator and on the engine.

    Args:
        loaded: LoadedModel; prompts: the test prompts, in arrival order; trace: the test
            trace recorded for exactly them (token replay); store: the store split (fits).
        cost: the simulator's cost model (a calibrated one for a meaningful timing error:
            :mod:`moeexp.backends.sim_vs_engine` fits it on the engine).
        system: a conf/system bundle (exact ones; Belady is not applicable).
        scheduler: ``fcfs`` | ``emoe`` or a mapping of the scheduler group.
        serving: budgets and SLO scales (default ServingSettings()).
        arrival_rate: Poisson req/s (seeded by ``seed``) or None (offline, all at 0).
        kv_bytes_per_token: None = ``cost.kv_bytes_per_token()``.
        engine: engine backend settings (conf/backend/engine.yaml keys; default: CPU,
            synchronous predictor, no warm-up, no progress bar).
    """
    from moeexp.engine.serve_continuous import serve_engine_continuous  # torch

    serving = serving or ServingSettings()
    choice = {"name": scheduler} if isinstance(scheduler, str) else dict(scheduler)
    objs, sys_settings = _policies(system, capacity, prefetch_distance, store)
    restricted = bool(sys_settings.get("restricted_routing", False))
    slots = objs[0][1].capacity_slots
    profile = fit_serving_profile(store, cost, slots)
    kv = int(kv_bytes_per_token if kv_bytes_per_token is not None else cost.kv_bytes_per_token())
    sim = serve(trace, objs[0][0], objs[0][1], cost, build_scheduler(choice), profile,
                settings=serving, kv_bytes_per_token=kv, arrival_rate=arrival_rate,
                restricted_routing=restricted, seed=seed, progress=False)
    eng_settings = {"predictor_async": False, "warmup": 0, "progress": False,
                    "spec_depth": trace.dims.spec_depth, **sys_settings, **dict(engine or {}),
                    "replay_tokens": True}
    eng = serve_engine_continuous(
        loaded, prompts, objs[1][0], objs[1][1], eng_settings, build_scheduler(choice), profile,
        serving=serving, kv_bytes_per_token=kv, kv_pool_bytes=kv_pool_bytes(cost, serving, slots),
        arrival_rate=arrival_rate, seed=seed, trace=trace, slo_s=slo_targets(trace, cost, serving),
        cost=cost)
    return _compare(system, sim.metrics, sim.series, eng.metrics, eng.series, eng.admitted)


def _compare(system: str, sm: dict[str, Any], ss: Mapping[str, list[Any]], em: dict[str, Any],
             es: Mapping[str, list[Any]], admitted: list[int]) -> ServingComparison:
    """The flat comparison: mean errors, MAPEs, hit rates, what must match."""
    by_id = {rid: i for i, rid in enumerate(ss["request_id"])}
    order = [by_id[rid] for rid in es["request_id"]]
    rows, out = [], {"system": system, "scheduler": sm.get("scheduler", "")}
    for key in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        sim_v = [float(ss[key][i]) for i in order]
        out[f"sim_{key}_mean"] = float(np.nanmean(sim_v))
        out[f"engine_{key}_mean"] = float(np.nanmean(es[key]))
        out[f"{key[:-3]}_mean_err_pct"] = _err_pct(out[f"sim_{key}_mean"], out[f"engine_{key}_mean"])
        out[f"{key[:-3]}_mape_pct"] = _mape(sim_v, es[key])
    for i, rid in enumerate(es["request_id"]):
        rows.append({"system": system, "request_id": rid, **{
            f"{side}_{k}": float(src[k][j]) for side, src, j in (("sim", ss, order[i]),
                                                                  ("engine", es, i))
            for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms")}})
    out.update({
        "sim_hit_rate": sm["hit_rate"], "engine_hit_rate": em["hit_rate"],
        "hit_rate_diff": sm["hit_rate"] - em["hit_rate"],
        "sim_hits_total": sm["hits_total"], "engine_hits_total": em["hits_total"],
        "sim_accesses_total": sm["accesses_total"], "engine_accesses_total": em["accesses_total"],
        "sim_slo_attainment": sm["slo_attainment"],
        "engine_slo_attainment": em.get("slo_attainment", float("nan")),
        "sim_passes": float(len(ss["iter_requests"])), "engine_passes": float(len(es["iter_requests"])),
        "admission_match": float(_sim_admission(ss) == list(admitted)),
        "passes_match": float(list(ss["iter_requests"]) == list(es["iter_requests"])
                              and list(ss["iter_tokens"]) == list(es["iter_tokens"])),
        "pass_hits_match": float(list(map(float, ss["iter_hits"])) == list(es["iter_hits"])),
    })
    for side, src in (("sim", ss), ("engine", es)):
        out.update({f"{side}_{k}": v for k, v in pass_line(src["iter_requests"],
                                                           src["iter_ms"]).items()})
    n = max(len(ss["iter_requests"]), len(es["iter_requests"]))

    def at(src: Mapping[str, list[Any]], key: str, i: int) -> float:
        return float(src[key][i]) if i < len(src[key]) else float("nan")

    passes = [{"pass": i, **{f"{side}_{k[5:]}": at(src, k, i) for side, src in
                            (("sim", ss), ("engine", es))
                            for k in ("iter_requests", "iter_tokens", "iter_hits", "iter_ms")}}
              for i in range(n)]
    return ServingComparison(metrics=out, requests=rows, passes=passes, sim=sm, engine=em)
