"""Metrics of a continuous-batching run (:mod:`moeexp.simulator.continuous`).

The ``CORE_KEYS`` and the simulator's extras keep the definitions of
:mod:`moeexp.simulator.report` (hit rate, prediction overlap, traffic, stalls; latencies
per request from its arrival), so a continuous run and a static one read the same way,
except the ``bound_*`` floor, whose model is static batches (left out here). The serving
quantities (what serving papers report), per request u with arrival a_u, admission s_u,
first token f_u, finish e_u:

* targets: ``slo_ttft_s`` = TTFT scale x u's **unloaded** TTFT, ``slo_e2e_s`` = end-to-end
  scale x its unloaded end-to-end latency (unloaded: u served alone, every expert
  resident, same cost model); a request *meets its SLO* when TTFT <= its TTFT target
  (not checked without a prefill: no TTFT) and e2e <= its end-to-end target;
* ``slo_attainment`` (and ``slo_ttft_attainment`` / ``slo_e2e_attainment``, and
  ``slo_attainment_task_<task>`` per task label): fraction of requests meeting it, in [0, 1];
* ``span_s``: last finish - first arrival; ``throughput_rps`` = requests / span,
  ``throughput_tokens_per_s`` = output tokens / span, ``goodput_rps`` = requests meeting
  their SLO / span (<= ``throughput_rps``);
* ``queue_ms_{mean,p50,p99}``: s_u - a_u; p50/p99 TTFT, TPOT and e2e are the core keys;
* ``batch_requests_mean`` / ``_peak``: running requests per forward pass;
  ``batch_tokens_mean``: tokens per pass; ``kv_reserved_peak_bytes`` (reservations) and
  ``kv_used_peak_bytes`` (context actually cached) against ``kv_pool_bytes``;
  ``gpu_mem_with_kv_peak_bytes`` = weights + expert cache + ``kv_used_peak_bytes``
  (``gpu_mem_peak_bytes`` stays the weights-only core key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.metrics import CORE_KEYS, f1, summarize, traffic_metrics

if TYPE_CHECKING:
    from moeexp.simulator.plan import Plan
    from moeexp.simulator.replay import Replay

NAN = float("nan")


@dataclass
class ServedRun:
    """What the batching loop records. Times in s, keyed by unit; per-pass lists.

    ``arrival``: float[n] (a static offline run fills each when its batch starts)."""

    n: int
    arrival: np.ndarray
    start: dict[int, float] = field(default_factory=dict)
    first: dict[int, float] = field(default_factory=dict)
    finish: dict[int, float] = field(default_factory=dict)
    n_decode: dict[int, int] = field(default_factory=dict)
    it_requests: list[int] = field(default_factory=list)
    it_tokens: list[int] = field(default_factory=list)
    kv_used_peak: int = 0
    kv_reserved_peak: int = 0

    def note_pass(self, requests: int, tokens: int, kv_used: int) -> None:
        self.it_requests.append(requests)
        self.it_tokens.append(tokens)
        self.kv_used_peak = max(self.kv_used_peak, kv_used)

    def note_reserved(self, reserved: int) -> None:
        self.kv_reserved_peak = max(self.kv_reserved_peak, reserved)

    def latencies(self) -> tuple[list[float], list[float], list[float]]:
        """(TTFT, TPOT, e2e) per unit, s (TPOT NaN without decode steps)."""
        u = range(self.n)
        a = self.arrival
        ttft = [self.first[i] - a[i] for i in u]
        e2e = [self.finish[i] - a[i] for i in u]
        tpot = [(self.finish[i] - self.first[i]) / self.n_decode[i] if self.n_decode[i] > 0
                else NAN for i in u]
        return ttft, tpot, e2e


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
    if restricted:
        n = tally.assignments
        m["substitution_rate"] = tally.substitutions / n if n else NAN
        m["routing_dropped_rate"] = tally.dropped_assignments / n if n else NAN
    for k, v in replay.predictor.stats().items():
        m.setdefault(f"predictor_{k}", float(v))
    return m


def slo_met(ttft: list[float], e2e: list[float], slo_ttft: list[float],
            slo_e2e: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bool[n] each: TTFT met (True where no TTFT target), e2e met, both met."""
    t_ok = np.asarray([not np.isfinite(s) or x <= s for x, s in zip(ttft, slo_ttft, strict=True)])
    e_ok = np.asarray([x <= s for x, s in zip(e2e, slo_e2e, strict=True)])
    return t_ok, e_ok, t_ok & e_ok


def _serving(served: ServedRun, slo_ttft: list[float], slo_e2e: list[float], tasks: list[str],
             output_tokens: float, weights: float) -> dict[str, float]:
    """The serving quantities of the module docstring."""
    ttft, _, e2e = served.latencies()
    t_ok, e_ok, ok = slo_met(ttft, e2e, slo_ttft, slo_e2e)
    span = max(served.finish.values()) - float(np.min(served.arrival))
    per_s = 1.0 / span if span > 0 else NAN
    m: dict[str, float] = {
        "slo_attainment": float(ok.mean()),
        "slo_ttft_attainment": float(t_ok.mean()),
        "slo_e2e_attainment": float(e_ok.mean()),
        "span_s": float(span),
        "throughput_rps": served.n * per_s,
        "throughput_tokens_per_s": output_tokens * per_s,
        "goodput_rps": float(ok.sum()) * per_s,
        **summarize("queue_ms", np.asarray([(served.start[u] - served.arrival[u]) * 1e3
                                            for u in range(served.n)])),
        "batch_requests_mean": float(np.mean(served.it_requests)),
        "batch_requests_peak": float(max(served.it_requests)),
        "batch_tokens_mean": float(np.mean(served.it_tokens)),
        "kv_reserved_peak_bytes": float(served.kv_reserved_peak),
        "kv_used_peak_bytes": float(served.kv_used_peak),
        "gpu_mem_with_kv_peak_bytes": weights + float(served.kv_used_peak),
    }
    for task in sorted(set(tasks)):
        if task:
            sel = np.asarray([t == task for t in tasks])
            m[f"slo_attainment_task_{re.sub(r'[^0-9A-Za-z_]', '_', task)}"] = float(ok[sel].mean())
    return m


def serving_metrics(*, served: ServedRun, reference: ServedRun, plan: Plan, replay: Replay,
                    cache: CachePolicy, cost: CostModel, slo_ttft: list[float],
                    slo_e2e: list[float], tasks: list[str], restricted: bool, wall_s: float,
                    extras: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The flat metrics (CORE_KEYS + extras + serving) and the series of one run."""
    m: dict[str, Any] = _core(served, reference, plan, replay, cache, cost, restricted, wall_s)
    m.update(_serving(served, slo_ttft, slo_e2e, tasks, m["output_tokens_total"],
                      m["gpu_mem_peak_bytes"]))
    m.update(extras)
    missing = [k for k in CORE_KEYS if k not in m]
    assert not missing, missing
    ttft, tpot, e2e = served.latencies()
    _, _, ok = slo_met(ttft, e2e, slo_ttft, slo_e2e)
    u = range(served.n)
    series: dict[str, list[Any]] = {
        "request_id": [plan.unit_request[i].request_id for i in u],
        "arrival_ms": [served.arrival[i] * 1e3 for i in u],
        "ttft_ms": [x * 1e3 for x in ttft], "tpot_ms": [x * 1e3 for x in tpot],
        "e2e_ms": [x * 1e3 for x in e2e],
        "queue_ms": [(served.start[i] - served.arrival[i]) * 1e3 for i in u],
        "service_ms": [(served.finish[i] - served.start[i]) * 1e3 for i in u],
        "slo_ttft_ms": [x * 1e3 for x in slo_ttft], "slo_e2e_ms": [x * 1e3 for x in slo_e2e],
        "slo_met": [float(x) for x in ok],
        "iter_hits": list(replay.tally.it_hits), "iter_misses": list(replay.tally.it_misses),
        "iter_stall_ms": [x * 1e3 for x in replay.tally.it_stall],
        "iter_ms": [x * 1e3 for x in replay.tally.it_time],
        "iter_requests": list(served.it_requests), "iter_tokens": list(served.it_tokens),
    }
    return m, series
