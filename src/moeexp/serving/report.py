"""What a batching loop records (:class:`ServedRun`) and the serving quantities read from it.

The simulator's and the engine's continuous batching report these with one definition
(:mod:`moeexp.simulator.serving_report` adds the simulator's core keys, the engine its
counters). Per request u with arrival a_u, admission s_u, first token f_u, finish e_u:

* targets: ``slo_ttft_s`` = TTFT scale x u's **unloaded** TTFT, ``slo_e2e_s`` = end-to-end
  scale x its unloaded end-to-end latency (unloaded: u served alone, every expert
  resident, same cost model); a request *meets its SLO* when TTFT <= its TTFT target
  (not checked without a prefill: no TTFT) and e2e <= its end-to-end target;
* ``slo_attainment`` (and ``slo_ttft_attainment`` / ``slo_e2e_attainment``, and
  ``slo_attainment_task_<task>`` per task label where tasks are given): fraction of
  requests meeting it, in [0, 1];
* ``span_s``: last finish - first arrival; ``throughput_rps`` = requests / span,
  ``throughput_tokens_per_s`` = output tokens / span, ``goodput_rps`` = requests meeting
  their SLO / span (<= ``throughput_rps``);
* ``queue_ms_{mean,p50,p99}``: s_u - a_u; TTFT f_u - a_u, TPOT (e_u - f_u) / decode
  steps, e2e e_u - a_u (:meth:`ServedRun.latencies`);
* ``batch_requests_mean`` / ``_peak``: running requests per forward pass;
  ``batch_tokens_mean``: tokens per pass; ``kv_reserved_peak_bytes`` (reservations) and
  ``kv_used_peak_bytes`` (context actually cached) against the KV pool.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeexp.metrics import summarize

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

    def queueing(self) -> list[float]:
        """s_u - a_u per unit, s."""
        return [self.start[i] - self.arrival[i] for i in range(self.n)]

    def per_s(self) -> float:
        """1 / span (last finish - first arrival), 1/s; NaN for an empty span."""
        span = self.span_s()
        return 1.0 / span if span > 0 else NAN

    def span_s(self) -> float:
        """Last finish - first arrival, s."""
        return float(max(self.finish.values()) - float(np.min(self.arrival)))


def slo_met(ttft: list[float], e2e: list[float], slo_ttft: list[float],
            slo_e2e: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bool[n] each: TTFT met (True where no TTFT target), e2e met, both met."""
    t_ok = np.asarray([not np.isfinite(s) or x <= s for x, s in zip(ttft, slo_ttft, strict=True)])
    e_ok = np.asarray([x <= s for x, s in zip(e2e, slo_e2e, strict=True)])
    return t_ok, e_ok, t_ok & e_ok


def serving_quantities(served: ServedRun, output_tokens: float) -> dict[str, float]:
    """Span, throughput, queueing, batch sizes and KV peaks (the module docstring)."""
    per_s = served.per_s()
    return {
        "span_s": served.span_s(),
        "throughput_rps": served.n * per_s,
        "throughput_tokens_per_s": output_tokens * per_s,
        **summarize("queue_ms", np.asarray([q * 1e3 for q in served.queueing()])),
        "batch_requests_mean": float(np.mean(served.it_requests)),
        "batch_requests_peak": float(max(served.it_requests)),
        "batch_tokens_mean": float(np.mean(served.it_tokens)),
        "kv_reserved_peak_bytes": float(served.kv_reserved_peak),
        "kv_used_peak_bytes": float(served.kv_used_peak),
    }


def slo_quantities(served: ServedRun, slo_ttft: list[float], slo_e2e: list[float],
                   tasks: Sequence[str] | None = None) -> dict[str, float]:
    """SLO attainment (overall, TTFT, e2e; per task label when ``tasks`` are given, one
    per unit) and goodput, against the targets ``slo_ttft`` / ``slo_e2e`` (s per unit)."""
    ttft, _, e2e = served.latencies()
    t_ok, e_ok, ok = slo_met(ttft, e2e, slo_ttft, slo_e2e)
    m: dict[str, float] = {
        "slo_attainment": float(ok.mean()),
        "slo_ttft_attainment": float(t_ok.mean()),
        "slo_e2e_attainment": float(e_ok.mean()),
        "goodput_rps": float(ok.sum()) * served.per_s(),
    }
    for task in sorted(set(tasks or ())):
        if task:
            sel = np.asarray([t == task for t in tasks or ()])
            m[f"slo_attainment_task_{re.sub(r'[^0-9A-Za-z_]', '_', task)}"] = float(ok[sel].mean())
    return m


def request_series(served: ServedRun, request_ids: Sequence[int],
                   slo_ttft: list[float] | None = None,
                   slo_e2e: list[float] | None = None) -> dict[str, list[Any]]:
    """Per-request series, ms: arrival, TTFT, TPOT, e2e, queueing, service (admission to
    finish); with targets, also the targets and whether each request met them."""
    ttft, tpot, e2e = served.latencies()
    u = range(served.n)
    series: dict[str, list[Any]] = {
        "request_id": list(request_ids),
        "arrival_ms": [served.arrival[i] * 1e3 for i in u],
        "ttft_ms": [x * 1e3 for x in ttft], "tpot_ms": [x * 1e3 for x in tpot],
        "e2e_ms": [x * 1e3 for x in e2e],
        "queue_ms": [q * 1e3 for q in served.queueing()],
        "service_ms": [(served.finish[i] - served.start[i]) * 1e3 for i in u],
    }
    if slo_ttft is not None and slo_e2e is not None:
        _, _, ok = slo_met(ttft, e2e, slo_ttft, slo_e2e)
        series.update({"slo_ttft_ms": [x * 1e3 for x in slo_ttft],
                       "slo_e2e_ms": [x * 1e3 for x in slo_e2e],
                       "slo_met": [float(x) for x in ok]})
    return series
