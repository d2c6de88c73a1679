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

Decisions are the scheduler's (:mod:`moeexp.schedulers`); this loop is the mechanism: the
clock, the budgets, the accounting. **Memory**: the device holds the always-resident
weights, the expert cache (``capacity_slots`` x expert bytes) and a KV pool, the rest of
``device_memory_gb``; a request reserves ``kv_bytes_per_token`` x (its prompt + its task's
profiled mean output length) when admitted and frees it when it finishes. Reservations
never exceed the pool; what the KV cache really holds (context so far) is reported beside
them (``kv_used_peak_bytes``; longer-than-expected outputs can overrun a reservation).
**Tokens**: a forward pass processes at most ``max_batch_tokens`` (T_max) tokens: one per
decoding request plus the prompts of the requests joining it (no chunked prefill, so a
prompt longer than T_max is a configuration error). The KV-cache reads of each request's
context are the cost model's attention term (:meth:`CostModel.dense_s`, via Plan.group).

``scheduler=static`` runs today's static batches through this loop and gives exactly the
numbers of :func:`~moeexp.simulator.simulate` (a test checks it). Policies that need the
whole future access stream (``cache.needs_future``: Belady) are **not applicable**: under
continuous batching the stream depends on the schedule, which depends on the timing, which
depends on the policy; :func:`not_applicable_reason` says so and :func:`serve` refuses them.
A predictor needing ``future`` (oracle) gets the current pass's true accesses, which are
known once its members are, so it runs honestly. A mixed pass (``mix_prefill``) reports the step of its
first member to ``IterationStart.step``: a decode step, as running requests come first, so
a predictor keyed on the step (moe_infinity's prefill / decode EAM phases) files the
joining prompts' prefill tokens under decode; ``mix_prefill=false`` keeps every pass one
phase. Metrics: :mod:`moeexp.simulator.serving_report`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.predictors.base import Prediction, Predictor, RequestStart
from moeexp.schedulers.base import (
    RunningRequest,
    Scheduler,
    SchedulerView,
    ServingProfile,
    WaitingRequest,
    check_admission,
)
from moeexp.simulator.plan import Plan
from moeexp.simulator.replay import Replay, SimResult, check_inputs
from moeexp.simulator.serving_report import ServedRun, serving_metrics
from moeexp.traces.schema import Trace

_SLO_KEYS = frozenset({"ttft", "e2e"})


@dataclass(frozen=True)
class ServingSettings:
    """The batching loop's budgets and SLO targets (``backend.serving``).

    Attributes:
        max_batch_tokens: T_max, tokens one forward pass may process (>= 1).
        max_running: requests the running batch may hold (>= 1; vLLM's max_num_seqs).
        device_memory_gb: device memory, GB (1e9 bytes), shared by the weights, the
            expert cache and the KV pool; None = the hardware profile's ``memory_gb``.
        slo_ttft_scale: TTFT target = this x the request's unloaded TTFT (> 0).
        slo_e2e_scale: end-to-end target = this x its unloaded end-to-end latency (> 0).
        slo_task_scales: task -> {"ttft": x, "e2e": y}, per-task scales replacing the two
            above for that task's requests (each task must exist in the trace).
        mix_prefill: True: joining prompts share a pass with the decoding requests
            (Orca / FastGen-style mixed passes; T_max covers both). False: requests admitted
            at a boundary run their prefill in a pass of their own first, the decoding
            requests wait for it (vLLM's default without chunked prefill); every pass is
            then one phase, prefill or decode.
    """

    max_batch_tokens: int = 2048
    max_running: int = 256
    device_memory_gb: float | None = None
    slo_ttft_scale: float = 5.0
    slo_e2e_scale: float = 5.0
    slo_task_scales: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    mix_prefill: bool = True

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 1:
            bad.append(f"max_batch_tokens={self.max_batch_tokens!r} (an integer >= 1)")
        if not isinstance(self.max_running, int) or self.max_running < 1:
            bad.append(f"max_running={self.max_running!r} (an integer >= 1)")
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            bad.append(f"device_memory_gb={self.device_memory_gb!r} (> 0, or null)")
        for name in ("slo_ttft_scale", "slo_e2e_scale"):
            if not getattr(self, name) > 0:
                bad.append(f"{name}={getattr(self, name)!r} (an SLO must be > 0)")
        for task, scales in dict(self.slo_task_scales).items():
            unknown = set(scales) - _SLO_KEYS
            if unknown or not all(float(v) > 0 for v in scales.values()):
                bad.append(f"slo_task_scales[{task!r}]={dict(scales)!r} (keys ttft, e2e; "
                           "values > 0)")
        if bad:
            raise ConfigError("backend.serving: " + "; ".join(bad))

    def scales(self, task: str) -> tuple[float, float]:
        """(TTFT scale, end-to-end scale) of ``task``."""
        own = self.slo_task_scales.get(task, {})
        return (float(own.get("ttft", self.slo_ttft_scale)),
                float(own.get("e2e", self.slo_e2e_scale)))


def not_applicable_reason(cache: CachePolicy) -> str | None:
    """Why continuous batching cannot serve this system honestly, or None."""
    if cache.needs_future:
        return (f"not applicable: cache={cache.name} needs the whole future access stream, "
                "which under continuous batching depends on the schedule the replay itself "
                "makes (use scheduler=static for a Belady bound)")
    return None


@dataclass
class _Units:
    """Per served request (unit), fixed before serving: trace iterations, sizes, targets.

    ``iters[u]``: trace iterations in step order; ``tokens[u]``: int per iteration;
    ``arrival``: float[n] s; ``kv_bytes``, ``prompt``; ``slo_ttft`` / ``slo_e2e`` s."""

    iters: list[list[int]]
    tokens: list[list[int]]
    arrival: np.ndarray
    prefill: list[bool]
    prompt: list[int]
    task: list[str]
    kv_bytes: list[int]
    slo_ttft: list[float]
    slo_e2e: list[float]

    @property
    def n(self) -> int:
        return len(self.iters)


def _units(plan: Plan, settings: ServingSettings, profile: ServingProfile,
           kv_per_token: int, offline_at_zero: bool) -> _Units:
    """The :class:`_Units` of ``plan`` (built with batch_size 1: one batch per unit)."""
    lens = np.diff(plan.trace.iter_offsets)
    iters = [[i for g in b.groups for i in g] for b in plan.batches]
    n = len(iters)
    start, first, finish = plan.no_offload_times()  # alone, every expert resident
    metas = plan.unit_request
    prefill = [plan.has_prefill(u) for u in range(n)]
    prompt = [int(lens[iters[u][0]]) if prefill[u] and iters[u] else int(metas[u].prompt_len)
              for u in range(n)]
    kv = [kv_per_token * int(round(prompt[u] + profile.output_len(metas[u].task)))
          for u in range(n)]
    sc = [settings.scales(m.task) for m in metas]
    arrival = plan.arrivals if plan.arrivals is not None else np.zeros(n)
    return _Units(
        iters=iters, tokens=[[int(lens[i]) for i in its] for its in iters],
        arrival=np.asarray(arrival, dtype=np.float64) if offline_at_zero or
        plan.arrivals is not None else np.full(n, np.nan),
        prefill=prefill, prompt=prompt, task=[m.task for m in metas], kv_bytes=kv,
        slo_ttft=[sc[u][0] * (first[u] - start[u]) if prefill[u] else float("nan")
                  for u in range(n)],
        slo_e2e=[sc[u][1] * (finish[u] - start[u]) for u in range(n)])


def _check_budgets(units: _Units, settings: ServingSettings, pool: int, weights: int,
                   memory: int, trace: Trace) -> None:
    """Every request's first pass fits T_max and its reservation the KV pool alone; the pool is positive; every task
    named in ``slo_task_scales`` exists (ConfigError naming the numbers otherwise)."""
    if pool <= 0:
        raise ConfigError(f"backend.serving: the weights and the expert cache take {weights} "
                          f"bytes of the {memory} bytes of device memory: no room for a KV "
                          "cache (raise device_memory_gb or lower cache.capacity)")
    first = [toks[0] if toks else 0 for toks in units.tokens]  # a prefill: the prompt
    if max(first) > settings.max_batch_tokens:
        raise ConfigError(f"backend.serving: max_batch_tokens={settings.max_batch_tokens} is "
                          f"below one prompt ({max(first)} tokens); T_max must be >= "
                          f"{max(first)} (no chunked prefill)")
    k = int(np.argmax(units.kv_bytes))
    if units.kv_bytes[k] > pool:
        raise ConfigError(f"backend.serving: one request's KV cache ({units.kv_bytes[k]} bytes) "
                          f"exceeds the KV pool ({pool} bytes = device memory {memory} - "
                          f"weights and experts {weights}); raise device_memory_gb")
    tasks = {r.task for r in trace.requests}
    unknown = sorted(set(settings.slo_task_scales) - tasks)
    if unknown:
        raise ConfigError(f"backend.serving.slo_task_scales: unknown task(s) "
                          f"{', '.join(map(repr, unknown))}; the trace's tasks: "
                          f"{', '.join(sorted(map(repr, tasks)))}")


class _Loop:
    """One run of the batching loop; ``replay`` None times passes with every expert
    resident (the no-offload reference), else through ``Replay.forward_pass``."""

    def __init__(self, plan: Plan, units: _Units, scheduler: Scheduler,
                 settings: ServingSettings, pool: int, kv_per_token: int,
                 replay: Replay | None, progress: bool) -> None:
        self.plan, self.u, self.sched, self.set = plan, units, scheduler, settings
        self.pool, self.kv_per_token, self.replay = pool, kv_per_token, replay
        self.run = ServedRun(n=units.n, arrival=units.arrival.copy())
        self.pos = [0] * units.n  # next iteration index of each unit
        self.done_tokens = [0] * units.n
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.fresh: list[int] = []  # admitted since the last pass (their prefill is next)
        self.preds: list[Prediction] = []
        self.bar = tqdm(total=units.n, desc=f"serve ({scheduler.name})", unit="req",
                        disable=not progress)

    # ------------------------------------------------------------------ the loop
    def serve(self) -> ServedRun:
        u, t, nxt, event, n_done = self.u, 0.0, 0, True, 0
        while n_done < u.n:
            while nxt < u.n and self._arrived(nxt, t):
                self.waiting.append(nxt)
                nxt += 1
                event = True
            if event or not self.sched.event_driven or not self.running:
                self._admit(t, remaining=u.n - n_done - len(self.running))
                event = False
            if not self.running:
                if nxt >= u.n:
                    raise RuntimeError(f"scheduler={self.sched.name} admitted nothing with "
                                       f"{len(self.waiting)} requests waiting, nothing "
                                       "running and no arrival left (a scheduler bug)")
                t = max(t, float(u.arrival[nxt]))
                continue
            t, finished = self._pass(t)
            if finished:
                n_done += len(finished)
                event = True
                self.bar.update(len(finished))
        self.bar.close()
        return self.run

    def _arrived(self, unit: int, t: float) -> bool:
        a = self.u.arrival[unit]
        return bool(np.isnan(a) or a <= t)  # NaN: static offline, arrives when it starts

    def _view(self, t: float, remaining: int) -> SchedulerView:
        u = self.u
        running = [RunningRequest(
            unit=r, task=u.task[r], arrival_s=float(self.run.arrival[r]),
            slo_ttft_s=u.slo_ttft[r], slo_e2e_s=u.slo_e2e[r], start_s=self.run.start[r],
            passes_done=self.pos[r], next_tokens=u.tokens[r][self.pos[r]])
            for r in self.running]
        waiting = [WaitingRequest(
            unit=w, task=u.task[w], arrival_s=float(t if np.isnan(u.arrival[w]) else u.arrival[w]),
            first_tokens=u.tokens[w][0] if u.tokens[w] else 0, kv_bytes=u.kv_bytes[w],
            slo_ttft_s=u.slo_ttft[w], slo_e2e_s=u.slo_e2e[w]) for w in self.waiting]
        reserved = sum(u.kv_bytes[r] for r in self.running)
        return SchedulerView(
            now_s=t, waiting=waiting, running=running, remaining=remaining,
            tokens_left=self.set.max_batch_tokens - (sum(r.next_tokens for r in running)
                                                     if self.set.mix_prefill else 0),
            running_left=self.set.max_running - len(running),
            kv_left_bytes=self.pool - reserved)

    def _admit(self, t: float, remaining: int) -> None:
        if not self.waiting:
            return
        view = self._view(t, remaining)
        chosen = self.sched.admit(view)
        if not chosen:
            return
        self._validate(view, chosen)
        if self.replay is not None:
            self.replay.dev.advance(t)
        for w in chosen:
            self.waiting.remove(w)
            self.running.append(w)
            self.fresh.append(w)
            self.run.start[w] = t
            if np.isnan(self.run.arrival[w]):
                self.run.arrival[w] = t
            if self.replay is not None:
                self.preds.append(self._start_request(w))
        self.run.note_reserved(sum(self.u.kv_bytes[r] for r in self.running))

    def _start_request(self, unit: int) -> Prediction:
        rp = self.replay
        assert rp is not None
        meta = self.plan.unit_request[unit]
        pe = (rp.tr.prompt_embed[rp.req_pos[meta.request_id]]  # type: ignore[index]
              if rp.want_pe else None)
        return rp.timed(rp.predictor.start_request, RequestStart(request=meta, prompt_embed=pe))

    def _validate(self, view: SchedulerView, chosen: list[int]) -> None:
        """A scheduler admits only waiting units, once each, within the budgets."""
        check_admission(view, chosen, self.sched)

    def _pass(self, t0: float) -> tuple[float, list[int]]:
        """One forward pass of the running batch from ``t0``; returns (end s, finished)."""
        u, run = self.u, self.run
        members = list(self.fresh if self.fresh and not self.set.mix_prefill else self.running)
        self.fresh = []
        iters = tuple(u.iters[r][self.pos[r]] for r in members)
        gd = self.plan.group(iters)
        if self.replay is None:
            t = t0 + gd.compute_s
        else:
            t = self.replay.forward_pass(gd, t0, self.preds)
            self.preds = []
        finished = []
        for r in members:
            if self.pos[r] == 0:
                run.first[r] = t if u.prefill[r] else t0
            self.done_tokens[r] += u.tokens[r][self.pos[r]]
            self.pos[r] += 1
            if self.pos[r] == len(u.iters[r]):
                finished.append(r)
        kv_used = sum(self.kv_per_token * (self.done_tokens[r] + (0 if u.prefill[r]
                                                                  else u.prompt[r]))
                      for r in self.running)  # every running request's cache
        run.note_pass(len(members), gd.token_request.size, kv_used)
        self.sched.on_pass(members, finished)
        for r in finished:
            run.finish[r] = t
            run.n_decode[r] = max(0, len(u.iters[r]) - int(u.prefill[r]))
            if self.replay is not None:
                self.replay.predictor.end_request(self.plan.unit_request[r].request_id)
            self.running.remove(r)
        return t, finished


def serve(trace_test: Trace, predictor: Predictor, cache: CachePolicy, cost: CostModel,
          scheduler: Scheduler, profile: ServingProfile, *,
          settings: ServingSettings | None = None, kv_bytes_per_token: int | None = None,
          arrival_rate: float | None = None, restricted_routing: bool = False, seed: int = 0,
          progress: bool = True, num_requests: int | None = None,
          predictor_feed_s: float = 0.0) -> SimResult:
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
    replay = Replay(trace_test, predictor, cache, cost, plan, restricted=restricted_routing,
                     feed_s=predictor_feed_s)
    served = _Loop(plan, units, scheduler, settings, pool, kv_per_token, replay, progress).serve()
    alone = _Loop(plan, units, reference, settings, pool, kv_per_token, None, False).serve()
    metrics, series = serving_metrics(
        served=served, reference=alone, plan=plan, replay=replay, cache=cache, cost=cost,
        slo_ttft=units.slo_ttft, slo_e2e=units.slo_e2e, tasks=units.task,
        restricted=restricted_routing, wall_s=perf_counter() - wall0,
        extras=_extras(scheduler, settings, pool, weights))
    return SimResult(metrics=metrics, series=series)


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
