"""The engine's metric dict: the same keys as the simulator (moeexp.metrics.CORE_KEYS).

Timing (``ttft_ms``, ``tpot_ms``, ``e2e_ms``) comes from the generate calls: TTFT is the
time from the call to the end of the prefill forward pass, TPOT the mean gap between later
forward passes of the request, e2e the whole call. On CUDA the forward hook synchronises the
device at the end of each forward pass so these are device times, and
``gpu_mem_peak_bytes`` is ``torch.cuda.max_memory_allocated``; on a CPU run it is NaN.
``stall_ms_total`` is the time compute waited for expert copies (CPU: the compute thread
blocked; CUDA: the compute stream waited, measured with events around each wait).
:class:`IterationProbe` records the same quantities per forward pass: the simulator's
``iter_*`` series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moeexp.engine.devices import DeviceCaches
from moeexp.engine.runtime import Engine
from moeexp.errors import ConfigError
from moeexp.metrics import CORE_KEYS, f1, summarize, traffic_metrics

NAN = float("nan")


@dataclass
class RequestTiming:
    """Per-request timings in seconds."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


def build_metrics(engine: Engine, timing: RequestTiming, requests: int) -> dict[str, Any]:
    """Flat metric dict: every CORE_KEY plus engine-only extras."""
    c = engine.counters
    stall_ms = c.stall_s * 1e3
    parts_ms = [c.stall_demand_s * 1e3, c.stall_late_s * 1e3, c.stall_link_s * 1e3]
    if c.cuda_stalls:
        torch.cuda.synchronize(engine.device)
        stall_ms += sum(a.elapsed_time(b) for a, b in c.cuda_stalls)
        _add_cuda_parts(c.cuda_stall_parts, parts_ms)
    recall, precision = c.pred.recall, c.pred.precision
    runner = engine.runner
    out: dict[str, Any] = {
        "hit_rate": c.hits / c.accesses if c.accesses else NAN,
        "prediction_recall": recall,
        "prediction_precision": precision,
        "prediction_f1": f1(precision, recall),
        **summarize("ttft_ms", [t * 1e3 for t in timing.ttft]),
        **summarize("tpot_ms", [t * 1e3 for t in timing.tpot]),
        **summarize("e2e_ms", [t * 1e3 for t in timing.e2e]),
        "stall_ms_total": stall_ms,
        "h2d_bytes_total": float(sum(cp.bytes_copied for cp in engine.copiers)
                                 - c.preload_bytes),
        "prefetch_waste_bytes": float(c.waste_bytes
                                      + len(engine.unused_prefetch) * engine.spec.nbytes),
        "expert_cache_bytes": float(engine.budget.budget_bytes),
        "gpu_mem_peak_bytes": (float(torch.cuda.max_memory_allocated(engine.device))
                               if engine.device.type == "cuda" else NAN),
        "predictor_query_us_mean": (runner.query_seconds / runner.queries * 1e6
                                    if runner.queries else NAN),
        "accesses_total": float(c.accesses),
        "hits_total": float(c.hits),
        "misses_total": float(c.accesses - c.hits),
        "requests_total": float(requests),
        **traffic_metrics(
            expert_bytes=engine.spec.nbytes, output_tokens=c.output_tokens,
            demand_loads=c.demand_loads, prefetches_issued=c.prefetches,
            prefetches_used=c.prefetches_used,
            prefetches_wasted=c.prefetches_wasted + len(engine.unused_prefetch),
            prefetches_dropped=sum(q.dropped for q in engine.queues),
            stall_demand_ms=parts_ms[0],
            stall_late_prefetch_ms=parts_ms[1], stall_link_ms=parts_ms[2]),
    }
    missing = [k for k in CORE_KEYS if k not in out]
    assert not missing, f"engine metrics lack {missing}"
    out.update({
        "preload_bytes": float(c.preload_bytes),
        "resident_expert_bytes_peak": float(c.resident_bytes_peak),
        "expert_slots": float(engine.pool.num_slots),
        "streamed_layers_total": float(c.streamed_layers),
        "substitution_rate": (c.substituted / c.routed_choices if c.routed_choices else
                              (0.0 if engine.settings.restricted_routing else NAN)),
        "routing_dropped_rate": (c.dropped / c.routed_choices if c.routed_choices else NAN),
        "copy_seconds_total": float(sum(cp.copy_seconds for cp in engine.copiers)),
        **execution_metrics(engine),
    })
    if engine.where is None:
        out.update(one_device_metrics(out["h2d_bytes_total"], engine.copier.copy_seconds,
                                      out["expert_cache_bytes"]))
    else:
        out.update(device_metrics(engine))
    if engine.mechanics is not None:
        out["demand_load"] = engine.mechanics.demand_load
        out["flush_per_token"] = float(engine.mechanics.flush_per_token)
    return out


def device_metrics(engine: Engine) -> dict[str, Any]:
    """The simulator's topology keys for the engine's N emulated devices
    (:mod:`moeexp.engine.devices`): per device ``d`` the bytes its copy thread moved
    (preloads left out), its measured copy seconds as link busy time, its slots' bytes;
    ``dev{d}_link_utilization`` is NaN (no makespan of the engine's own to divide by)."""
    topo, nbytes = engine.topology, engine.spec.nbytes  # (mechanics: build_metrics)
    assert topo is not None and isinstance(engine.cache, DeviceCaches)
    busy = [cp.copy_seconds for cp in engine.copiers]
    out: dict[str, Any] = {"demand_load": "activated", "flush_per_token": 0.0,
                           "devices": float(len(engine.copiers)),
                           "demand_concurrency": topo.demand_concurrency,
                           "cache_budget_scope": topo.budget,
                           "link_busy_ms_total": sum(busy) * 1e3}
    for d, (cp, pol) in enumerate(zip(engine.copiers, engine.cache.caches, strict=True)):
        out[f"dev{d}_h2d_bytes_total"] = float(cp.bytes_copied - engine.preload_by_device[d])
        out[f"dev{d}_link_busy_ms_total"] = busy[d] * 1e3
        out[f"dev{d}_link_utilization"] = NAN
        out[f"dev{d}_expert_cache_bytes"] = float(pol.capacity_slots * nbytes)
    return out


def execution_metrics(engine: Engine) -> dict[str, Any]:
    """Where the misses ran (:mod:`moeexp.engine.host_experts`), the simulator's names:
    ``cpu_expert_calls`` ((layer call, expert) pairs computed on the host CPU),
    ``cpu_ms_total`` (their measured host kernel time), ``cpu_tokens_total`` (their routing
    rows), ``stream_h2d_bytes_total`` (experts copied for one pass only; not part of
    ``h2d_bytes_total``), ``gpu_pinned_experts`` (kept on the device for the run); and the
    engine's own ``cpu_transfer_ms_total`` (hidden states both ways), ``stream_copies_total``,
    ``stream_ms_total``, ``execution`` (the policy's name), with ``late_to_cpu``
    ``cpu_late_experts_total`` (in-flight experts computed on the CPU, part of
    ``cpu_expert_calls``), and ``cpu_model_ms_total``: what
    the policy's cost model predicts for these very calls (the sum of
    :meth:`~moeexp.costmodel.roofline.CostModel.cpu_expert_s` over each call's rows; NaN
    without a CPU block): the calibration's check of the simulator's CPU times against the
    measured ones. Zeros under ``copy``."""
    c = engine.counters
    host = engine.host
    model_ms = 0.0 if host is None else float("nan")
    cost = None if host is None else host.cost
    if cost is not None and cost.profile.cpu is not None:
        try:
            model_ms = sum(cost.cpu_expert_s(n) for n, _ in c.cpu_samples) * 1e3
        except ConfigError:  # no kernel efficiency for the format: nothing to predict
            pass
    late = ({"cpu_late_experts_total": float(c.cpu_late_experts)}
            if host is not None and host.policy.late_to_cpu else {})
    return late | {"execution": "copy" if host is None else host.policy.name,
            "cpu_model_ms_total": model_ms,
            "cpu_expert_calls": float(c.cpu_expert_calls),
            "cpu_ms_total": c.cpu_s * 1e3,
            "cpu_tokens_total": float(c.cpu_tokens),
            "cpu_transfer_ms_total": c.cpu_transfer_s * 1e3,
            "stream_h2d_bytes_total": float(c.stream_bytes),
            "stream_copies_total": float(c.stream_copies),
            "stream_ms_total": c.stream_s * 1e3,
            "gpu_pinned_experts": float(len(engine.pinned))}


def one_device_metrics(h2d_bytes: float, copy_s: float, cache_bytes: float) -> dict[str, Any]:
    """The simulator's topology keys (:func:`moeexp.simulator.report.topology_metrics`) for
    the engine, which runs one device, one copy thread and the paper's mechanics: its link
    busy time is the copier's measured copy seconds; ``dev0_link_utilization`` is NaN (the
    engine has no makespan of its own to divide by)."""
    return {"demand_load": "activated", "flush_per_token": 0.0, "devices": 1.0,
            "demand_concurrency": "single", "cache_budget_scope": "total",
            "link_busy_ms_total": copy_s * 1e3, "dev0_h2d_bytes_total": h2d_bytes,
            "dev0_link_busy_ms_total": copy_s * 1e3, "dev0_link_utilization": NAN,
            "dev0_expert_cache_bytes": cache_bytes}


def _add_cuda_parts(parts: list[tuple[Any, Any, bool, Any]], out_ms: list[float]) -> None:
    """Add the CUDA stall segments (ms, device synchronised) to ``out_ms`` = [demand, late
    prefetch, link]: a prefetch's segment is a late prefetch; a demand load's is link time
    until its copy's start event (clamped to the segment), demand time after."""
    for begin, end, demand, started in parts:
        seg = begin.elapsed_time(end)
        if not demand:
            out_ms[1] += seg
            continue
        link = min(max(begin.elapsed_time(started), 0.0), seg) if started is not None else 0.0
        out_ms[2] += link
        out_ms[0] += seg - link


class IterationProbe:
    """Per-forward-pass hits, misses, stall (ms) and duration (ms) of an offloaded model.

    Its pre-hook runs before the engine's, its post-hook after (so a CUDA pass has been
    synchronised). ``remove()`` detaches it.
    """

    def __init__(self, om: Any) -> None:
        self.om = om
        self.rows: list[tuple[int, int, float, int, int, float]] = []
        self._start: tuple[int, int, float, int, float] | None = None
        m = om.model
        self._handles = [m.register_forward_pre_hook(self._pre, prepend=True),
                         m.register_forward_hook(self._post)]

    def _snap(self) -> tuple[int, int, float, int]:
        c = self.om.engine.counters
        return c.hits, c.accesses, c.stall_s, len(c.cuda_stalls)

    def _pre(self, module: Any, args: Any) -> None:
        self._start = (*self._snap(), time.perf_counter())

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if self._start is None:
            return
        h0, a0, s0, c0, t0 = self._start
        h1, a1, s1, c1 = self._snap()
        self.rows.append((h1 - h0, (a1 - a0) - (h1 - h0), (s1 - s0) * 1e3, c0, c1,
                          (time.perf_counter() - t0) * 1e3))
        self._start = None

    def series(self) -> dict[str, list[float]]:
        """``iter_hits``, ``iter_misses``, ``iter_stall_ms``, ``iter_ms`` (one per pass)."""
        stalls = self.om.engine.counters.cuda_stalls
        if stalls:
            torch.cuda.synchronize(self.om.engine.device)
        cuda_ms = [sum(a.elapsed_time(b) for a, b in stalls[c0:c1]) if c1 > c0 else 0.0
                   for _, _, _, c0, c1, _ in self.rows]
        return {"iter_hits": [float(r[0]) for r in self.rows],
                "iter_misses": [float(r[1]) for r in self.rows],
                "iter_stall_ms": [r[2] + c for r, c in zip(self.rows, cuda_ms, strict=True)],
                "iter_ms": [r[5] for r in self.rows]}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
