"""Metrics of a continuous-batching run of the simulator (:mod:`moeexp.simulator.continuous`).

The ``CORE_KEYS`` and the simulator's extras keep the definitions of
:mod:`moeexp.simulator.report` (hit rate, prediction overlap, traffic, stalls; latencies
per request from its arrival), so a continuous run and a static one read the same way,
except the ``bound_*`` floor, whose model is static batches (left out here). The serving
quantities (SLO attainment, goodput, throughput, queueing, batch sizes, KV peaks) are
:mod:`moeexp.serving.report`'s, the engine's definitions too, with per-task attainment and
``gpu_mem_with_kv_peak_bytes`` = weights + expert cache + ``kv_used_peak_bytes``
(``gpu_mem_peak_bytes`` stays the weights-only core key).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.metrics import CORE_KEYS, f1, summarize, traffic_metrics
from moeexp.serving.report import (
    ServedRun,
    request_series,
    serving_quantities,
    slo_quantities,
)
from moeexp.simulator.report import topology_metrics

if TYPE_CHECKING:
    from moeexp.simulator.plan import Plan
    from moeexp.simulator.replay import Replay

NAN = float("nan")


def _ratio_mean(a: list[float], b: list[float]) -> float:
    r = [x / y for x, y in zip(a, b, strict=True) if np.isfinite(x) and np.isfinite(y) and y > 0]
    return float(np.mean(r)) if r else NAN


def _core(served: ServedRun, reference: ServedRun, plan: Plan, replay: Replay,
          cache: CachePolicy, cost: CostModel, restricted: bool, wall_s: float) -> dict[str, float]:
    """CORE_KEYS and the simulator's extras, as :func:`moeexp.simulator.report.build_metrics`
    defines them (no ``bound_*``)."""
    ttft, tpot, e2e = served.latencies()
    ttft0, tpot0, _ = reference.latencies()
    tally, dev = replay.tally, replay.dev
    hits, misses = sum(tally.it_hits), sum(tally.it_misses)
    accesses = hits + misses
    recall, precision = tally.pred.recall, tally.pred.precision
    calls = replay.timed.calls
    m: dict[str, float] = {
        "hit_rate": hits / accesses if accesses else NAN,
        "prediction_recall": recall, "prediction_precision": precision,
        "prediction_f1": f1(precision, recall),
        **summarize("ttft_ms", np.asarray(ttft) * 1e3),
        **summarize("tpot_ms", np.asarray([x for x in tpot if np.isfinite(x)]) * 1e3),
        **summarize("e2e_ms", np.asarray(e2e) * 1e3),
        "stall_ms_total": float(sum(tally.it_stall) * 1e3),
        "h2d_bytes_total": float(dev.h2d_bytes),
        "prefetch_waste_bytes": float(dev.waste_bytes + len(dev.unused_prefetched) * cost.expert_bytes),
        "expert_cache_bytes": float(cache.capacity_slots * cost.expert_bytes),
        "gpu_mem_peak_bytes": float(cost.gpu_mem_bytes(cache.capacity_slots)),
        "predictor_query_us_mean": replay.timed.seconds / calls * 1e6 if calls else NAN,
        "accesses_total": float(accesses), "requests_total": float(served.n),
        "hits_total": float(hits), "misses_total": float(misses),
        **traffic_metrics(
            expert_bytes=cost.expert_bytes,
            output_tokens=sum(served.n_decode[u] + int(plan.has_prefill(u)) for u in range(served.n)),
            demand_loads=dev.demand_loads, prefetches_issued=dev.prefetches_issued,
            prefetches_used=dev.prefetches_used,
            prefetches_wasted=dev.prefetches_wasted + len(dev.unused_prefetched),
            prefetches_dropped=dev.prefetches_dropped, stall_demand_ms=dev.stall_demand_s * 1e3,
            stall_late_prefetch_ms=dev.stall_inflight_s * 1e3, stall_link_ms=dev.stall_link_s * 1e3),
        "ttft_norm_mean": _ratio_mean(ttft, ttft0), "tpot_norm_mean": _ratio_mean(tpot, tpot0),
        "makespan_ms": max(served.finish.values(), default=NAN) * 1e3,
        "sim_wall_s": wall_s, "accesses_per_s": accesses / wall_s if wall_s > 0 else NAN,
    }
    m.update(topology_metrics(replay.dev, cost, m["makespan_ms"] * 1e-3, None))
    if restricted:
        n = tally.assignments
        m["substitution_rate"] = tally.substitutions / n if n else NAN
        m["routing_dropped_rate"] = tally.dropped_assignments / n if n else NAN
    for k, v in replay.predictor.stats().items():
        m.setdefault(f"predictor_{k}", float(v))
    return m


def serving_metrics(*, served: ServedRun, reference: ServedRun, plan: Plan, replay: Replay,
                    cache: CachePolicy, cost: CostModel, slo_ttft: list[float],
                    slo_e2e: list[float], tasks: list[str], restricted: bool, wall_s: float,
                    extras: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The flat metrics (CORE_KEYS + extras + serving) and the series of one run."""
    m: dict[str, Any] = _core(served, reference, plan, replay, cache, cost, restricted, wall_s)
    m.update(slo_quantities(served, slo_ttft, slo_e2e, tasks))
    m.update(serving_quantities(served, m["output_tokens_total"]))
    m["gpu_mem_with_kv_peak_bytes"] = m["gpu_mem_peak_bytes"] + float(served.kv_used_peak)
    m.update(extras)
    missing = [k for k in CORE_KEYS if k not in m]
    assert not missing, missing
    series = request_series(served, [meta.request_id for meta in plan.unit_request[:served.n]],
                            slo_ttft, slo_e2e)
    tally = replay.tally
    series.update({
        "iter_hits": list(tally.it_hits), "iter_misses": list(tally.it_misses),
        "iter_stall_ms": [x * 1e3 for x in tally.it_stall],
        "iter_ms": [x * 1e3 for x in tally.it_time],
        "iter_requests": list(served.it_requests), "iter_tokens": list(served.it_tokens),
    })
    return m, series
