"""Continuous (iteration-level) batching: requests join and leave the running batch between
forward passes, under a token budget and a device memory shared by experts and KV cache.

::

    serve: until every request finished
      arrivals up to now join the waiting queue          (Poisson, seeded; offline: all at 0)
      scheduler.admit(view)  (every boundary; an event-driven one after an arrival or a
                              completion, or when nothing runs)   -> units that join now
        checked against T_max, max_running and the KV pool        (budgeted schedulers)
        start_request of each                                    -> predictions
      one forward pass over the running batch: each request's next trace iteration (its
        prefill, or one decode step); a layer's experts are the union over the batch
        (Plan.group); time, hits, stalls from the same Replay.forward_pass as simulate
      scheduler.on_pass(units, finished); the finished leave (end_request)

Decisions are the scheduler's (:mod:`moeexp.schedulers`); the loop, its budgets and its
records are :mod:`moeexp.serving` (shared with the engine); this module is the simulator's
side of it: the simulated clock and how one pass runs (:class:`_SimPasses`).

**Memory**: the device holds the always-resident weights, the expert cache
(``capacity_slots`` x expert bytes) and a KV pool, the rest of ``device_memory_gb``; a
request reserves ``kv_bytes_per_token`` x (its prompt + its task's profiled mean output
length) when admitted and frees it when it finishes. Reservations never exceed the pool;
what the KV cache really holds (context so far) is reported beside them
(``kv_used_peak_bytes``; longer-than-expected outputs can overrun a reservation).
**Tokens**: a forward pass processes at most ``max_batch_tokens`` (T_max) tokens: one per
decoding request plus the prompts of the requests joining it (no chunked prefill, so a
prompt longer than T_max is a configuration error). The KV-cache reads of each request's
context are the cost model's attention term (:meth:`CostModel.dense_s`, via Plan.group).

``scheduler=static`` runs today's static batches through this loop and gives exactly the
numbers of :func:`~moeexp.simulator.simulate` (a test checks it). Policies that need the
whole future access stream (``cache.needs_future``: Belady) are **not applicable**: under
continuous batching the stream depends on the schedule, which depends on the timing, which
depends on the policy; :func:`~moeexp.serving.settings.not_applicable_reason` says so and
:func:`serve` refuses them. A predictor needing ``future`` (oracle) gets the current
pass's true accesses, which are known once its members are, so it runs honestly. A mixed
pass (``mix_prefill``) reports the step of its first member to ``IterationStart.step``: a
decode step, as running requests come first, so a predictor keyed on the step
(moe_infinity's prefill / decode EAM phases) files the joining prompts' prefill tokens
under decode; ``mix_prefill=false`` keeps every pass one phase. Metrics:
:mod:`moeexp.simulator.serving_report` (the serving quantities of
:mod:`moeexp.serving.report`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.predictors.base import Prediction, Predictor, RequestStart
from moeexp.schedulers.base import Scheduler, ServingProfile
from moeexp.serving.loop import BatchingLoop, PassMembers, RequestSpec
from moeexp.serving.report import ServedRun
from moeexp.serving.settings import (
    ServingSettings,
    check_budgets,
    kv_reservation_bytes,
    not_applicable_reason,
)
from moeexp.simulator.plan import Plan
from moeexp.simulator.replay import Replay, SimResult, check_inputs
from moeexp.simulator.serving_report import serving_metrics
from moeexp.traces.schema import Trace


@dataclass
class _Units:
    """Per served request (unit), fixed before serving: ``iters[u]``, its trace iterations
    in step order; ``specs[u]``, what the batching loop knows of it; ``arrival``: float[n]
    s (NaN: a static offline unit, arriving when its batch starts)."""

    iters: list[list[int]]
    specs: list[RequestSpec]
    arrival: np.ndarray

    @property
    def n(self) -> int:
        return len(self.iters)


def slo_targets_s(plan: Plan, settings: ServingSettings) -> list[tuple[float, float]]:
    """Per unit of ``plan`` (batch_size 1: one request each), its (TTFT, e2e) SLO targets in
    seconds: the task's scales (``settings.scales``) x the request's latency alone with every
    expert resident under the plan's cost model; TTFT NaN without a prefill. The one rule
    both backends' serving runs are held to."""
    start, first, finish = plan.no_offload_times()  # alone, every expert resident
    out = []
    for u, meta in enumerate(plan.unit_request):
        sc_ttft, sc_e2e = settings.scales(meta.task)
        out.append((sc_ttft * (first[u] - start[u]) if plan.has_prefill(u) else float("nan"),
                    sc_e2e * (finish[u] - start[u])))
    return out


def _units(plan: Plan, settings: ServingSettings, profile: ServingProfile,
           kv_per_token: int, offline_at_zero: bool) -> _Units:
    """The :class:`_Units` of ``plan`` (built with batch_size 1: one batch per unit)."""
    lens = np.diff(plan.trace.iter_offsets)
    iters = [[i for g in b.groups for i in g] for b in plan.batches]
    n = len(iters)
    targets = slo_targets_s(plan, settings)
    specs = []
    for u, meta in enumerate(plan.unit_request):
        prefill = plan.has_prefill(u)
        prompt = int(lens[iters[u][0]]) if prefill and iters[u] else int(meta.prompt_len)
        specs.append(RequestSpec(
            task=meta.task, pass_tokens=[int(lens[i]) for i in iters[u]],
            kv_bytes=kv_reservation_bytes(kv_per_token, prompt, meta.task, profile),
            slo_ttft_s=targets[u][0], slo_e2e_s=targets[u][1], has_prefill=prefill,
            cached_tokens=0 if prefill else prompt))
    arrival = plan.arrivals if plan.arrivals is not None else np.zeros(n)
    return _Units(iters=iters, specs=specs,
                  arrival=np.asarray(arrival, dtype=np.float64) if offline_at_zero or
                  plan.arrivals is not None else np.full(n, np.nan))


def _check_budgets(units: _Units, settings: ServingSettings, pool: int, weights: int,
                   memory: int, trace: Trace) -> None:
    """The pool is positive, every request's first pass fits T_max and its reservation the
    KV pool alone, every task named in ``slo_task_scales`` exists (ConfigError naming the
    numbers otherwise)."""
    if pool <= 0:
        raise ConfigError(f"backend.serving: the weights and the expert cache take {weights} "
                          f"bytes of the {memory} bytes of device memory: no room for a KV "
                          "cache (raise device_memory_gb or lower cache.capacity)")
    check_budgets([s.pass_tokens[0] if s.pass_tokens else 0 for s in units.specs],
                  [s.kv_bytes for s in units.specs], settings, pool,
                  pool_detail=f" = device memory {memory} - weights and experts {weights}",
                  remedy="raise device_memory_gb")
    tasks = {r.task for r in trace.requests}
    unknown = sorted(set(settings.slo_task_scales) - tasks)
    if unknown:
        raise ConfigError(f"backend.serving.slo_task_scales: unknown task(s) "
                          f"{', '.join(map(repr, unknown))}; the trace's tasks: "
                          f"{', '.join(sorted(map(repr, tasks)))}")


class _SimPasses:
    """The simulator's side of the batching loop: the simulated clock, and each pass
    timed through ``Replay.forward_pass`` (``replay`` None: every expert resident, the
    no-offload reference)."""

    def __init__(self, plan: Plan, iters: list[list[int]], replay: Replay | None) -> None:
        self.plan, self.iters, self.replay = plan, iters, replay
        self.t = 0.0
        self.preds: list[Prediction] = []  # of the requests started since the last pass

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def start_requests(self, units: list[int], t: float) -> None:
        rp = self.replay
        if rp is None:
            return
        rp.dev.advance(t)
        for unit in units:
            meta = self.plan.unit_request[unit]
            pe = (rp.tr.prompt_embed[rp.req_pos[meta.request_id]]  # type: ignore[index]
                  if rp.want_pe else None)
            self.preds.append(rp.timed(rp.predictor.start_request,
                                       RequestStart(request=meta, prompt_embed=pe)))

    def run_pass(self, members: PassMembers) -> float:
        gd = self.plan.group(tuple(self.iters[r][k]
                                   for r, k in zip(members.units, members.steps, strict=True)))
        if self.replay is None:
            self.t = members.start_s + gd.compute_s
        else:
            self.t = self.replay.forward_pass(gd, members.start_s, self.preds)
            self.preds = []
        return self.t

    def end_request(self, unit: int) -> None:
        if self.replay is not None:
            self.replay.predictor.end_request(self.plan.unit_request[unit].request_id)


def _loop(plan: Plan, units: _Units, scheduler: Scheduler, settings: ServingSettings,
          pool: int, kv_per_token: int, replay: Replay | None, progress: bool) -> ServedRun:
    """One run of the batching loop on the simulated clock."""
    return BatchingLoop(units.specs, units.arrival, scheduler, settings, pool, kv_per_token,
                        _SimPasses(plan, units.iters, replay), desc="serve",
                        progress=progress).serve()

def serve(trace_test: Trace, predictor: Predictor, cache: CachePolicy, cost: CostModel,
          scheduler: Scheduler, profile: ServingProfile, *,
          settings: ServingSettings | None = None, kv_bytes_per_token: int | None = None,
          arrival_rate: float | None = None, restricted_routing: bool = False, seed: int = 0,
          progress: bool = True, num_requests: int | None = None,
          predictor_feed_s: float = 0.0, record_usable: bool = False) -> SimResult:
    """Serve ``trace_test`` with continuous batching under ``scheduler``.

    Args:
        trace_test, predictor, cache, cost, restricted_routing, seed, progress,
            predictor_feed_s: as in :func:`~moeexp.simulator.simulate`.
        scheduler: the admission policy (``fit`` is called here with ``profile``).
        profile: fitted on the store split (:func:`~moeexp.simulator.serving_profile.
            fit_serving_profile`): expected output lengths (KV reservations) and eMoE's c, ΔE.
        settings: budgets and SLO targets (default :class:`ServingSettings`).
        kv_bytes_per_token: KV-cache bytes per token (:func:`moeexp.costmodel.roofline.
            kv_bytes_per_token` of the model's config); None = ``cost.kv_bytes_per_token()``.
        arrival_rate: Poisson arrivals in requests/s (seeded by ``seed``); None: offline, every
            request arrives at t = 0 (``scheduler=static``: each when its batch starts, as in
            ``simulate``).
        num_requests: requests to serve (None: each test request once; more cycles them).
        record_usable: restricted routing only: ``series["restricted_usable"]`` holds, per
            forward pass, per layer, the experts resident and ready when the layer ran
            (sorted ints): the simulated residency, which the engine can replay
            (:func:`moeexp.engine.continuous.serve_continuous`'s ``residency``).

    Raises:
        ConfigError: bad settings, a prompt over T_max, a request whose KV reservation
            exceeds the pool, or a policy that needs the future (:func:`not_applicable_reason`).
    """
    wall0 = perf_counter()
    settings = settings or ServingSettings()
    check_inputs(trace_test, predictor, cache, cost, 1, arrival_rate, num_requests)
    reason = not_applicable_reason(cache)
    if reason is not None:
        raise ConfigError(reason)
    if not (predictor_feed_s >= 0.0 and np.isfinite(predictor_feed_s)):
        raise ConfigError(f"predictor_feed_s={predictor_feed_s} must be a finite number >= 0")
    kv_per_token = cost.kv_bytes_per_token() if kv_bytes_per_token is None else int(kv_bytes_per_token)
    if kv_per_token < 0:
        raise ConfigError(f"kv_bytes_per_token must be >= 0, got {kv_per_token}")
    plan = Plan(trace_test, cost, batch_size=1, arrival_rate=arrival_rate,
                num_requests=num_requests, seed=seed)
    units = _units(plan, settings, profile, kv_per_token,
                   offline_at_zero=scheduler.name != "static")
    memory = int(round((settings.device_memory_gb if settings.device_memory_gb is not None
                        else cost.profile.memory_gb) * 1e9))
    weights = cost.gpu_mem_bytes(cache.capacity_slots)
    pool = memory - weights
    if scheduler.budgeted:
        _check_budgets(units, settings, pool, weights, memory, trace_test)
    scheduler.fit(profile)
    reference = copy.deepcopy(scheduler)
    if record_usable and not restricted_routing:
        raise ConfigError("record_usable needs restricted_routing (only restricted layers "
                          "read residency without loading)")
    predictor.bind(cost, [cache])  # a policy that reads the cost model it runs under
    replay = Replay(trace_test, predictor, cache, cost, plan, restricted=restricted_routing,
                     feed_s=predictor_feed_s)
    if record_usable:
        replay.dev.usable_log = []
    served = _loop(plan, units, scheduler, settings, pool, kv_per_token, replay, progress)
    alone = _loop(plan, units, reference, settings, pool, kv_per_token, None, False)
    metrics, series = serving_metrics(
        served=served, reference=alone, plan=plan, replay=replay, cache=cache, cost=cost,
        slo_ttft=[s.slo_ttft_s for s in units.specs], slo_e2e=[s.slo_e2e_s for s in units.specs],
        tasks=[s.task for s in units.specs],
        restricted=restricted_routing, wall_s=perf_counter() - wall0,
        extras=_extras(scheduler, settings, pool, weights))
    if record_usable:
        series["restricted_usable"] = _per_pass(replay.dev.usable_log or [],
                                                trace_test.dims.num_layers,
                                                len(served.it_requests))
    return SimResult(metrics=metrics, series=series)


def _per_pass(log: list[tuple[int, ...]], num_layers: int,
              passes: int) -> list[list[list[int]]]:
    """The usable-expert log (one entry per restricted layer call, in order) cut into
    forward passes: [pass][layer] -> sorted expert ids."""
    if len(log) != passes * num_layers:
        raise RuntimeError(f"restricted residency log holds {len(log)} layer calls, expected "
                           f"{passes} passes x {num_layers} layers")
    return [[list(log[p * num_layers + layer]) for layer in range(num_layers)]
            for p in range(passes)]


def _extras(scheduler: Scheduler, settings: ServingSettings, pool: int,
            weights: int) -> dict[str, Any]:
    """The run's serving settings and the scheduler's counters, as flat metrics."""
    out: dict[str, Any] = {
        "scheduler": scheduler.name,
        "max_batch_tokens": float(settings.max_batch_tokens),
        "max_running": float(settings.max_running),
        "slo_ttft_scale": float(settings.slo_ttft_scale),
        "slo_e2e_scale": float(settings.slo_e2e_scale),
        "kv_pool_bytes": float(pool),
        "weights_bytes": float(weights),
    }
    for k, v in scheduler.stats().items():
        out[f"scheduler_{k}"] = v
    return out
