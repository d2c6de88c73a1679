"""Counters of one replay and the metric dictionary built from them (algorithms.md §8).

Definitions (the simulator's choices where §8 leaves room):

* ``hit_rate`` = hits / accesses; an access is a hit when its expert was resident *and*
  its copy had finished when the layer needed it. Restricted routing counts the router's
  original experts the same way (a substituted expert is a miss that loaded nothing).
* ``prediction_recall`` = mean over every (forward pass, layer) of |P ∩ A| / |A|;
  ``prediction_precision`` = mean of |P ∩ A| / |P| over the pairs where P is non-empty
  (NaN if P is always empty). P is the last ``Prediction.predicted`` given for the layer
  before its router ran, else the union of the experts prefetched for it during this pass
  before its router ran (resident or not): :class:`moeexp.prefetching.PredictionSets`,
  the engine's rule too. A = the experts the router chose.
* Latencies per request: TTFT = end of its prefill pass - arrival; e2e = end of its last
  pass - arrival; TPOT = (e2e - TTFT) / decode steps (requests without decode steps are
  left out). Offline, arrival = the moment its batch starts (no queueing).
* ``ttft_norm_mean`` / ``tpot_norm_mean``: mean over requests of latency / the same
  request's latency with every expert resident (same arrivals, same profile).
* ``prefetch_waste_bytes``: bytes of prefetched experts that left the device, or were
  still there at the end, without ever being used. The rest of the traffic and stall
  decomposition (demand / prefetch bytes, used / wasted prefetches, per output token;
  stalls on a demand copy, a late prefetch, the link) is :func:`moeexp.metrics.traffic_metrics`
  over the :class:`~moeexp.simulator.device.Device` counters.
* ``gpu_mem_peak_bytes``: expert cache bytes + always-resident weights (no KV cache).
* ``makespan_ms``: when the last forward pass ended (from time 0, the first batch's start
  or the first arrival's clock origin); ``bound_*``: the latency floor of
  :mod:`moeexp.simulator.bound` for this budget and one link (no exact system goes below
  it); NaN with several devices, whose parallel links the floor does not model, with a
  host-side limit (``topology.host_gbps``), and with any :mod:`moeexp.simulator.mechanics`
  option on.
* Topology (:func:`topology_metrics`): ``devices``, ``demand_concurrency`` and
  ``cache_budget_scope`` (how the capacity was split: ``total`` or ``per_device``;
  ``expert_cache_bytes`` is always the sum over devices), ``link_busy_ms_total`` (every
  link's copying time, summed), and per device ``d``: ``dev{d}_h2d_bytes_total``,
  ``dev{d}_link_busy_ms_total`` and ``dev{d}_link_utilization`` (busy time / makespan),
  ``dev{d}_expert_cache_bytes``; ``host_gbps`` only when a host-side limit is set (busy
  times then include the time the limit held a link); and the
  :mod:`moeexp.simulator.mechanics` options
  (``demand_load``, ``flush_per_token`` 0/1), so every row says how it was served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.metrics import CORE_KEYS, PredictionTally, f1, summarize, traffic_metrics
from moeexp.simulator.bound import BOUND_KEYS, bound_metrics

if TYPE_CHECKING:
    from moeexp.simulator.device import Device
    from moeexp.simulator.device_group import DeviceGroup
    from moeexp.simulator.mechanics import Mechanics
    from moeexp.simulator.plan import Plan
    from moeexp.simulator.topology import Topology

NAN = float("nan")


@dataclass
class Tally:
    """Counters filled by the replay loop. Times in seconds; dicts keyed by unit."""

    num_layers: int
    start: dict[int, float] = field(default_factory=dict)
    first: dict[int, float] = field(default_factory=dict)
    finish: dict[int, float] = field(default_factory=dict)
    n_decode: dict[int, int] = field(default_factory=dict)
    it_hits: list[int] = field(default_factory=list)
    it_misses: list[int] = field(default_factory=list)
    it_stall: list[float] = field(default_factory=list)
    it_time: list[float] = field(default_factory=list)
    pred: PredictionTally = field(default_factory=PredictionTally)
    substitutions: int = 0
    dropped_assignments: int = 0
    assignments: int = 0

    def iteration(self, hits: int, misses: int, stall_s: float, dur_s: float) -> None:
        self.it_hits.append(hits)
        self.it_misses.append(misses)
        self.it_stall.append(stall_s)
        self.it_time.append(dur_s)


def _latencies(units: list[int], arrival: dict[int, float], first: dict[int, float],
               finish: dict[int, float], n_decode: dict[int, int]) -> tuple[list[float], ...]:
    ttft = [first[u] - arrival[u] for u in units]
    e2e = [finish[u] - arrival[u] for u in units]
    tpot = [(finish[u] - first[u]) / n_decode[u] if n_decode[u] > 0 else NAN for u in units]
    return ttft, tpot, e2e


def _ratio_mean(a: list[float], b: list[float]) -> float:
    r = [x / y for x, y in zip(a, b, strict=True) if np.isfinite(x) and np.isfinite(y) and y > 0]
    return float(np.mean(r)) if r else NAN


def topology_metrics(dev: Device | DeviceGroup, cost: CostModel, makespan_s: float,
                     topology: Topology | None,
                     mechanics: Mechanics | None = None) -> dict[str, Any]:
    """Devices, links, budgets and mechanics of one replay (module docstring); times in ms."""
    members = dev.members
    m: dict[str, Any] = {
        "demand_load": mechanics.demand_load if mechanics else "activated",
        "flush_per_token": float(mechanics.flush_per_token) if mechanics else 0.0,
        "devices": float(len(members)),
        "demand_concurrency": topology.demand_concurrency if topology else "single",
        "cache_budget_scope": topology.budget if topology else "total",
        "link_busy_ms_total": float(sum(d.link.busy_s for d in members) * 1e3),
    }
    if topology is not None and topology.host_gbps is not None:  # only when set: the
        m["host_gbps"] = float(topology.host_gbps)  # default rows keep their keys
    for i, d in enumerate(members):
        busy = d.link.busy_s
        m[f"dev{i}_h2d_bytes_total"] = float(d.h2d_bytes)
        m[f"dev{i}_link_busy_ms_total"] = float(busy * 1e3)
        m[f"dev{i}_link_utilization"] = busy / makespan_s if makespan_s > 0 else NAN
        m[f"dev{i}_expert_cache_bytes"] = float(d.capacity * cost.expert_bytes)
    return m


def build_metrics(*, plan: Plan, dev: Device | DeviceGroup,
                  cache: CachePolicy | Sequence[CachePolicy], cost: CostModel, tally: Tally,
                  restricted: bool, query_s: float, query_calls: int, wall_s: float,
                  predictor_stats: dict[str, float],
                  topology: Topology | None = None,
                  mechanics: Mechanics | None = None,
                  floor_modelled: bool = True) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """The flat metrics (CORE_KEYS + extras) and the series of one replay (``cache``: the
    one device's policy, or one per device; ``floor_modelled`` False: ``bound_*`` NaN,
    e.g. experts computed on the CPU, which the floor does not model)."""
    caches = [cache] if isinstance(cache, CachePolicy) else list(cache)
    slots = sum(c.capacity_slots for c in caches)
    initial = [k for c in caches for k in c.initial_residents()]
    units = list(range(len(plan.unit_request)))
    if plan.arrivals is not None:
        arrival = {u: float(plan.arrivals[u]) for u in units}
        arrival0 = arrival
    else:
        arrival = dict(tally.start)
        arrival0 = None
    n_dec = {u: plan.num_decode(u) for u in units}
    ttft, tpot, e2e = _latencies(units, arrival, tally.first, tally.finish, n_dec)
    s0, f0, fin0 = plan.no_offload_times()
    ttft0, tpot0, _ = _latencies(units, arrival0 or s0, f0, fin0, n_dec)
    hits, misses = sum(tally.it_hits), sum(tally.it_misses)
    accesses = hits + misses
    recall, precision = tally.pred.recall, tally.pred.precision
    waste = dev.waste_bytes + len(dev.unused_prefetched) * cost.expert_bytes
    m: dict[str, float] = {
        "hit_rate": hits / accesses if accesses else NAN,
        "prediction_recall": recall,
        "prediction_precision": precision,
        "prediction_f1": f1(precision, recall),
        **summarize("ttft_ms", np.asarray(ttft) * 1e3),
        **summarize("tpot_ms", np.asarray([x for x in tpot if np.isfinite(x)]) * 1e3),
        **summarize("e2e_ms", np.asarray(e2e) * 1e3),
        "stall_ms_total": float(sum(tally.it_stall) * 1e3),
        "h2d_bytes_total": float(dev.h2d_bytes),
        "prefetch_waste_bytes": float(waste),
        "expert_cache_bytes": float(slots * cost.expert_bytes),
        "gpu_mem_peak_bytes": float(cost.gpu_mem_bytes(slots)),
        "predictor_query_us_mean": query_s / query_calls * 1e6 if query_calls else NAN,
        "accesses_total": float(accesses),
        "requests_total": float(len(units)),
        "hits_total": float(hits),
        "misses_total": float(misses),
        **traffic_metrics(
            expert_bytes=cost.expert_bytes,
            output_tokens=sum(n_dec[u] + int(plan.has_prefill(u)) for u in units),
            demand_loads=dev.demand_loads, prefetches_issued=dev.prefetches_issued,
            prefetches_used=dev.prefetches_used,
            prefetches_wasted=dev.prefetches_wasted + len(dev.unused_prefetched),
            prefetches_dropped=dev.prefetches_dropped,
            stall_demand_ms=dev.stall_demand_s * 1e3,
            stall_late_prefetch_ms=dev.stall_inflight_s * 1e3,
            stall_link_ms=dev.stall_link_s * 1e3),
        "ttft_norm_mean": _ratio_mean(ttft, ttft0),
        "tpot_norm_mean": _ratio_mean(tpot, tpot0),
        "makespan_ms": max(tally.finish.values(), default=NAN) * 1e3,
        **_bounds(plan, cost, slots, initial, floor_modelled and len(caches) == 1
                  and (mechanics is None or mechanics.default)
                  and (topology is None or topology.host_gbps is None)),
        "sim_wall_s": wall_s,
        "accesses_per_s": accesses / wall_s if wall_s > 0 else NAN,
    }
    m.update(topology_metrics(dev, cost, m["makespan_ms"] * 1e-3, topology, mechanics))
    if restricted:
        n = tally.assignments
        m["substitution_rate"] = tally.substitutions / n if n else NAN
        m["routing_dropped_rate"] = tally.dropped_assignments / n if n else NAN
    for k, v in predictor_stats.items():
        m.setdefault(f"predictor_{k}", float(v))
    missing = [k for k in CORE_KEYS if k not in m]
    assert not missing, missing
    return m, _series(plan, tally, units, arrival, ttft, tpot, e2e)


def _bounds(plan: Plan, cost: CostModel, slots: int, initial: list[Any],
            modelled: bool) -> dict[str, float]:
    """``bound_metrics``, or NaN where the floor's model does not hold (several links, or
    an artifact mechanic it does not model; not computed then)."""
    return bound_metrics(plan, cost, slots, initial) if modelled else dict.fromkeys(BOUND_KEYS, NAN)


def _series(plan: Plan, tally: Tally, units: list[int], arrival: dict[int, float],
            ttft: list[float], tpot: list[float], e2e: list[float]) -> dict[str, list[Any]]:
    """Per-request series (ms; latencies in seconds given per unit) and per-pass series."""
    return {
        "request_id": [plan.unit_request[u].request_id for u in units],
        "arrival_ms": [arrival[u] * 1e3 for u in units],
        "ttft_ms": [x * 1e3 for x in ttft],
        "tpot_ms": [x * 1e3 for x in tpot],
        "e2e_ms": [x * 1e3 for x in e2e],
        "queue_ms": [(tally.start[u] - arrival[u]) * 1e3 for u in units],
        "service_ms": [(tally.finish[u] - tally.start[u]) * 1e3 for u in units],
        "iter_hits": list(tally.it_hits),
        "iter_misses": list(tally.it_misses),
        "iter_stall_ms": [x * 1e3 for x in tally.it_stall],
        "iter_ms": [x * 1e3 for x in tally.it_time],
    }
