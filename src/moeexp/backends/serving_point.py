"""One serving operating point on both backends with a calibrated cost model
(``+experiment=emoe_serving_check``: ``backend=sim_vs_engine`` with a ``serving`` block).

::

    metrics, series = run_serving_point(ctx, settings, calibrated_cost, run_dir)

For every ``systems`` entry under its ``scheduler`` (conf/scheduler, default fcfs):
:func:`moeexp.backends.serving_check.sim_vs_engine_serving` serves the first
``test_requests`` test requests with continuous batching in the simulator (the calibrated
cost model) and on the engine (wall clock, decoding the trace's tokens), with the same
scheduler, budgets, seeded Poisson arrivals and SLO targets. The operating point is an
``emoe_serving`` one: its ``arrival_rate`` is given as the run's ``hardware`` profile would
serve it, and the SLO targets are multiples of each request's unloaded latency under the
cost model in use; so that the calibrated machine carries the same load (arrival rate x
service time), the rate served is ``arrival_rate x U_hw / U_cal`` (``rescale_rate``), U
the mean unloaded end-to-end latency (alone, every expert resident) of the served test
requests under the hardware profile and under the calibrated model. The device memory
(expert cache + KV pool) is the hardware profile's unless ``serving.device_memory_gb``
says otherwise (a calibrated profile has no memory size).

Written into the run directory: ``summary.csv`` / ``summary.md`` (one row per system),
``requests.csv`` (per request both sides' TTFT / TPOT / e2e / queueing) and ``passes.csv``
(per pass both sides' members, tokens, hits, ms). ``metrics.json`` holds every row's
values as ``<system>_<key>``, and with a single system the row's values unprefixed too (a
multirun of one system per job collects into one row per job, ``moeexp collect``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeexp.atomic import write_text
from moeexp.backends.serving_check import sim_vs_engine_serving
from moeexp.costmodel.roofline import CostModel
from moeexp.simulator.plan import Plan
from moeexp.traces.schema import Trace

log = logging.getLogger(__name__)

#: Columns of summary.md (summary.csv holds every key of a row).
SHOWN = ["system", "scheduler", "arrival_rate", "ttft_mean_err_pct", "tpot_mean_err_pct",
         "e2e_mean_err_pct", "ttft_mape_pct", "tpot_mape_pct", "e2e_mape_pct",
         "sim_slo_attainment", "engine_slo_attainment", "admission_match", "passes_match",
         "pass_hits_match", "sim_hit_rate", "engine_hit_rate"]
#: Serving metrics of each backend copied into a row as ``sim_<k>`` / ``engine_<k>``.
SIDE_KEYS = ("throughput_rps", "goodput_rps", "substitution_rate", "h2d_bytes_total",
             "stall_ms_total", "prediction_recall", "batch_requests_mean", "queue_ms_p99",
             "e2e_ms_p50", "e2e_ms_p99")


def unloaded_e2e_s(trace: Trace, cost: CostModel) -> float:
    """Mean end-to-end latency (s) of ``trace``'s requests, each alone with every expert
    resident under ``cost`` (what the SLO targets are multiples of)."""
    plan = Plan(trace, cost, batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    start, _, finish = plan.no_offload_times()
    return float(np.mean([finish[u] - start[u] for u in start]))


def served_rate(s: Any, trace: Trace, hw_cost: CostModel, cost: CostModel
                ) -> tuple[float | None, dict[str, float]]:
    """The arrival rate to serve (module docstring) and how it was derived (with both cost
    regimes' copy / compute ratio: the rescaled load is the same, the regime is not)."""
    from moeexp.costmodel.projection import copy_to_compute

    u_hw, u_cal = unloaded_e2e_s(trace, hw_cost), unloaded_e2e_s(trace, cost)
    k = trace.dims.top_k
    info = {"unloaded_e2e_ms_hardware": u_hw * 1e3, "unloaded_e2e_ms_calibrated": u_cal * 1e3,
            "copy_to_compute_hardware": copy_to_compute(hw_cost, k),
            "copy_to_compute_calibrated": copy_to_compute(cost, k),
            "arrival_rate_hardware": float(s.arrival_rate) if s.arrival_rate else float("nan"),
            "rate_scale": u_hw / u_cal if s.rescale_rate else 1.0}
    if s.arrival_rate is None:
        return None, info
    rate = float(s.arrival_rate) * info["rate_scale"]
    return rate, info


def scheduler_of(name: str) -> dict[str, Any]:
    """The ``scheduler`` group option ``name`` (conf/scheduler/<name>.yaml) as a mapping."""
    from moeexp.paths import CONF_DIR, read_option

    return dict(read_option(CONF_DIR / "scheduler", name, "scheduler"))


def run_serving_point(ctx: Any, s: Any, cost: CostModel, run_dir: Path
                      ) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Every ``s.systems`` entry at the operating point (module docstring).

    Args:
        ctx: the pipeline's BackendContext (test prompts and trace, store, the hardware
            profile's cost model in ``ctx.cost``); the run's own ``scheduler`` stays
            ``static`` (each entry names its own).
        s: :class:`~moeexp.backends.sim_vs_engine.SimVsEngineSettings` with ``serving``.
        cost: the cost model calibrated on this machine's engine.
    Returns:
        (metrics, series): series = the summary rows as columns.
    """
    prompts, trace = list(ctx.prompts), ctx.trace
    if s.test_requests is not None:
        prompts = prompts[: s.test_requests]
        trace = trace.select([p.request_id for p in prompts])
    serving = s.serving_settings()
    tasks = {r.task for r in trace.requests}
    scales = {t: v for t, v in serving.slo_task_scales.items() if t in tasks}
    if scales != dict(serving.slo_task_scales):  # the cut may drop a task of the split
        log.info("serving point: SLO scales of tasks not among the %d served requests dropped: "
                 "%s", len(prompts), ", ".join(sorted(set(serving.slo_task_scales) - tasks)))
        serving = dataclasses.replace(serving, slo_task_scales=scales)
    if serving.device_memory_gb is None:  # the operating point's memory, not the fit's 0 GB
        serving = dataclasses.replace(serving, device_memory_gb=float(ctx.cost.profile.memory_gb))
    rate, info = served_rate(s, trace, ctx.cost, cost)
    log.info("serving point: %d test requests at %s req/s (%s req/s on %s x %.4f: unloaded "
             "e2e %.1f ms there, %.1f ms calibrated)", len(prompts), rate, s.arrival_rate,
             ctx.cost.profile.name, info["rate_scale"], info["unloaded_e2e_ms_hardware"],
             info["unloaded_e2e_ms_calibrated"])
    engine = {"device": s.device, "bandwidth_bps": s.bandwidth_bps, "num_threads": s.num_threads,
              "max_inflight": s.max_inflight, "predictor_async": s.predictor_async,
              "batch_decode": s.batch_decode}
    rows: list[dict[str, Any]] = []
    reqs: list[dict[str, Any]] = []
    passes: list[dict[str, Any]] = []
    for entry in s.systems:
        sched = scheduler_of(entry.scheduler or "fcfs")
        out = sim_vs_engine_serving(
            ctx.loaded, prompts, trace, ctx.store, cost, system=entry.system, scheduler=sched,
            capacity=s.capacity, serving=serving, arrival_rate=rate, seed=ctx.seed,
            kv_bytes_per_token=ctx.kv_bytes_per_token, prefetch_distance=s.prefetch_distance,
            engine=engine)
        row = {**out.metrics, "system": entry.name, "scheduler": sched["name"],
               "arrival_rate": rate if rate is not None else float("nan"),
               "test_requests": float(len(prompts)), **info}
        for side, m in (("sim", out.sim), ("engine", out.engine)):
            for k in SIDE_KEYS:
                row[f"{side}_{k}"] = float(m.get(k, float("nan")))
        rows.append(row)
        reqs.extend({**r, "system": entry.name} for r in out.requests)
        passes.extend({**p, "system": entry.name} for p in out.passes)
        log.info("%-12s %s: TTFT err %+.1f%% TPOT err %+.1f%% e2e err %+.1f%% (MAPE %.1f / %.1f "
                 "/ %.1f%%), SLO sim %.3f engine %.3f, admission %s passes %s hits %s",
                 entry.name, sched["name"], row["ttft_mean_err_pct"], row["tpot_mean_err_pct"],
                 row["e2e_mean_err_pct"], row["ttft_mape_pct"], row["tpot_mape_pct"],
                 row["e2e_mape_pct"], row["sim_slo_attainment"], row["engine_slo_attainment"],
                 row["admission_match"], row["passes_match"], row["pass_hits_match"])
    return _write(run_dir, rows, reqs, passes)


def _write(run_dir: Path, rows: list[dict[str, Any]], reqs: list[dict[str, Any]],
           passes: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """summary.csv / .md, requests.csv, passes.csv; the flat metrics and the series."""
    df = pd.DataFrame(rows)
    df = df[[c for c in SHOWN if c in df.columns] + [c for c in df.columns if c not in SHOWN]]
    write_text(run_dir / "summary.csv", df.to_csv(index=False))
    write_text(run_dir / "summary.md", df[SHOWN].to_markdown(index=False, floatfmt=".3f") + "\n")
    write_text(run_dir / "requests.csv", pd.DataFrame(reqs).to_csv(index=False))
    write_text(run_dir / "passes.csv", pd.DataFrame(passes).to_csv(index=False))
    log.info("emoe_serving_check:\n%s",
             df[SHOWN].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    metrics: dict[str, Any] = {"systems": ",".join(df["system"]), "mode": "serving"}
    for r in rows:
        metrics.update({f"{r['system']}_{k}": v for k, v in r.items()
                        if k not in ("system", "scheduler")})
    if len(rows) == 1:
        metrics.update({k: v for k, v in rows[0].items() if k != "system"})
    series = {c: df[c].astype(float).tolist() for c in SHOWN[2:]}
    return metrics, series
