"""Continuous (iteration-level) batching on the engine: requests join the running batch
between forward passes and leave when they finish, each with its own KV cache.

::

    run = serve_continuous(pm, prompts, scheduler, profile, settings=ServingSettings(...),
                           kv_bytes_per_token=..., kv_pool_bytes=..., arrivals_s=...)
    until every request finished (wall clock from the loop's start):
      arrivals up to now join the waiting queue              (offline: all at 0)
      scheduler.admit(SchedulerView)  -> who joins now       (the simulator's Scheduler
        objects and view, checked against T_max, max_running, the KV pool)
        predictor start_request of each
      one pass (PassModel.run_pass): each running request's next tokens (its prompt, or
        the token it generated last) on its own KV cache; a layer's experts are the union
        over the pass (moeexp.engine.batch_pass)
      each member's next token: greedy with EOS suppressed (exactly ``output_len`` tokens,
        as the recorder and serve_engine decode), or the trace's recorded token (``forced``)
      scheduler.on_pass(units, finished); the finished leave (predictor end_request)

The loop is :class:`moeexp.serving.loop.BatchingLoop`, the simulator's own (same view,
same admission rule, same pass composition rule ``mix_prefill``: the requests admitted at
a boundary join the decoding ones in one pass, or run their prefill in a pass of their own
first; same KV reservations, ``kv_bytes_per_token`` x (prompt + the task's profiled mean
output length); same records, :class:`~moeexp.serving.report.ServedRun`, hence the same
TTFT / TPOT / e2e / queueing definitions); this module is its engine side
(:class:`_EnginePasses`): the wall clock, the passes and the tokens real. With the same
requests, scheduler and a timing-independent admission (offline arrivals under fcfs), the
engine and the simulator run the very same passes, which
:func:`moeexp.backends.serving_check.sim_vs_engine_serving` checks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moeexp.engine.batch_pass import Member, PassModel, cache_bytes, pass_future
from moeexp.errors import ConfigError
from moeexp.schedulers.base import Scheduler, ServingProfile
from moeexp.serving.loop import BatchingLoop, PassMembers, RequestSpec
from moeexp.serving.report import ServedRun, request_series, serving_quantities, slo_quantities
from moeexp.serving.settings import ServingSettings, check_budgets, kv_reservation_bytes
from moeexp.traces.schema import RequestMeta, Trace

NAN = float("nan")


@dataclass
class ContinuousRun:
    """One engine run under continuous batching.

    Attributes:
        metrics: CORE_KEYS (engine counters, latencies from the loop's records) + serving
            quantities (queue_ms_*, throughput, batch sizes, KV peaks, SLO attainment when
            targets were given) + the scheduler's counters.
        series: per request (``request_id`` ... ``service_ms``) and per pass (``iter_*``).
        tokens: request id -> the ``output_len`` token ids it generated.
        passes: per pass, the request ids of its members in pass order.
        admitted: request ids in admission order.
    """

    metrics: dict[str, Any]
    series: dict[str, list[Any]]
    tokens: dict[int, list[int]] = field(default_factory=dict)
    passes: list[tuple[int, ...]] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)


@dataclass
class _Req:
    """A served request's live state (unit u = its index in ``prompts``)."""

    prompt: Any
    meta: RequestMeta
    kv_bytes: int
    slo_ttft_s: float
    slo_e2e_s: float
    embed: np.ndarray | None = None  # float32[E] prompt embedding (semantic predictors)
    cache: Any = None
    generated: list[int] = field(default_factory=list)

    def spec(self) -> RequestSpec:
        """What the batching loop knows of it: a prefill of its prompt, then one token per
        decode step, ``output_len`` passes in all."""
        n = int(self.meta.output_len)
        return RequestSpec(task=self.meta.task, pass_tokens=[int(self.meta.prompt_len)] + [1] * (n - 1),
                           kv_bytes=self.kv_bytes, slo_ttft_s=self.slo_ttft_s,
                           slo_e2e_s=self.slo_e2e_s)


class _EnginePasses:
    """The engine's side of the batching loop (a :class:`~moeexp.serving.loop.PassRunner`):
    the wall clock (seconds since it was made), each pass run on a :class:`PassModel`,
    each member's next token, per-pass counters."""

    def __init__(self, pm: PassModel, reqs: list[_Req],
                 forced: Mapping[int, Sequence[int]] | None, future: Trace | None,
                 eos: Sequence[int], pass_seconds: Sequence[float] | None = None,
                 residency: Sequence[Sequence[Sequence[int]]] | None = None) -> None:
        self.pm, self.reqs = pm, reqs
        self.residency = residency
        self.forced, self.future, self.eos = forced, future, list(eos)
        self.pass_s = None if pass_seconds is None else [float(x) for x in pass_seconds]
        self.clock = 0.0  # the simulated clock (pass_seconds given)
        self.passes: list[tuple[int, ...]] = []
        self.admitted: list[int] = []
        self.iter_rows: list[tuple[int, int, float, float]] = []  # hits, misses, stall, ms
        self.kv_cache_peak = 0
        self.live: set[int] = set()  # started, not finished
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return self.clock if self.pass_s is not None else time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        if self.pass_s is not None:
            self.clock = max(self.clock, t)
            return
        time.sleep(max(0.0, t - self.now()))

    def start_requests(self, units: list[int], t: float) -> None:
        for w in units:
            req = self.reqs[w]
            self.admitted.append(req.meta.request_id)
            self.live.add(w)
            self.pm.start_request(req.meta, req.embed)

    def _member(self, r: int, step: int) -> Member:
        req = self.reqs[r]
        dev = self.pm.engine.device
        ids = (list(req.prompt.input_ids) if step == 0 else [req.generated[-1]])
        return Member(request_id=req.meta.request_id, cache=req.cache, step=step,
                      input_ids=torch.tensor([ids], dtype=torch.long, device=dev))

    def _next_token(self, req: _Req, step: int, logits: torch.Tensor) -> int:
        """The token generated at pass ``step``: the recorded one (``forced``) or greedy
        with EOS suppressed (``min_new_tokens = output_len``, as generate decodes)."""
        rec = None if self.forced is None else self.forced[req.meta.request_id]
        if rec is not None and step < len(rec):
            return int(rec[step])
        scores = logits[0].float().clone()
        if self.eos:
            scores[self.eos] = float("-inf")
        return int(torch.argmax(scores).item())

    def run_pass(self, members: PassMembers) -> float:
        mem = [self._member(r, k) for r, k in zip(members.units, members.steps, strict=True)]
        self.passes.append(tuple(m.request_id for m in mem))
        fut = (None if self.future is None
               else pass_future(self.future, [(m.request_id, m.step) for m in mem]))
        c = self.pm.engine.counters
        h0, a0, s0, w0 = c.hits, c.accesses, c.stall_s, time.perf_counter()
        if self.residency is not None:
            i = len(self.passes) - 1
            if i >= len(self.residency):
                raise ConfigError(f"the residency replay holds {len(self.residency)} passes; "
                                  f"the engine ran more (pass {i + 1})")
            self.pm.engine.residency = self.residency[i]
        try:
            out = self.pm.run_pass(mem, fut)
        finally:
            self.pm.engine.residency = None
        if self.pass_s is not None:
            i = len(self.passes) - 1
            if i >= len(self.pass_s):
                raise ConfigError(f"pass_seconds holds {len(self.pass_s)} passes; the "
                                  f"engine ran more (pass {i + 1})")
            self.clock += self.pass_s[i]
        t = self.now()
        c = self.pm.engine.counters
        self.iter_rows.append((c.hits - h0, (c.accesses - a0) - (c.hits - h0),
                               (c.stall_s - s0) * 1e3, (time.perf_counter() - w0) * 1e3))
        for r, k, (logits, cache) in zip(members.units, members.steps, out, strict=True):
            req = self.reqs[r]
            req.cache = cache
            req.generated.append(self._next_token(req, k, logits))
        self.kv_cache_peak = max(self.kv_cache_peak,
                                 sum(cache_bytes(self.reqs[r].cache) for r in self.live))
        return t

    def end_request(self, unit: int) -> None:
        req = self.reqs[unit]
        self.pm.end_request(req.meta.request_id)
        self.live.discard(unit)
        req.cache = None  # its KV cache leaves with it


def _requests(prompts: Sequence[Any], profile: ServingProfile, kv_per_token: int,
              slo_s: Mapping[int, tuple[float, float]] | None,
              prompt_embeds: np.ndarray | None) -> list[_Req]:
    """Live state per prompt; KV reservation = kv_per_token x (prompt + the task's profiled
    mean output length), as the simulator reserves."""
    out = []
    for i, p in enumerate(prompts):
        task = str(getattr(p, "task", "") or "")
        meta = RequestMeta(request_id=int(p.request_id), prompt=str(getattr(p, "text", "")),
                           prompt_len=int(p.prompt_len), output_len=int(p.output_len),
                           split=getattr(p, "split", "test"),
                           dataset=str(getattr(p, "dataset", "engine")), task=task)
        slo = (NAN, NAN) if slo_s is None else slo_s[int(p.request_id)]
        out.append(_Req(prompt=p, meta=meta, slo_ttft_s=float(slo[0]), slo_e2e_s=float(slo[1]),
                        kv_bytes=kv_reservation_bytes(kv_per_token, int(p.prompt_len), task,
                                                      profile),
                        embed=None if prompt_embeds is None else np.asarray(prompt_embeds[i])))
    return out


def _check(reqs: list[_Req], settings: ServingSettings, pool: int, budgeted: bool) -> None:
    """Each prompt holds ``prompt_len`` ids, fits T_max (no chunked prefill) and its
    reservation the pool, output lengths >= 1, ids distinct: ConfigError naming the
    numbers otherwise."""
    if not reqs:
        raise ConfigError("continuous serving needs at least one request")
    ids = [r.meta.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise ConfigError("continuous serving: request ids must be distinct")
    if min(r.meta.output_len for r in reqs) < 1:
        raise ConfigError("continuous serving: every request's output_len must be >= 1")
    bad = [r.meta.request_id for r in reqs if len(r.prompt.input_ids) != r.meta.prompt_len]
    if bad:
        raise ConfigError(f"continuous serving: request(s) {bad[:5]} hold a prompt_len other "
                          "than the number of their input_ids")
    if budgeted:
        check_budgets([r.meta.prompt_len for r in reqs], [r.kv_bytes for r in reqs],
                      settings, pool)


def serve_continuous(pm: PassModel, prompts: Sequence[Any], scheduler: Scheduler,
                     profile: ServingProfile, *, settings: ServingSettings | None = None,
                     kv_bytes_per_token: int = 0, kv_pool_bytes: int | None = None,
                     arrivals_s: Sequence[float] | None = None,
                     forced: Mapping[int, Sequence[int]] | None = None,
                     future: Trace | None = None,
                     slo_s: Mapping[int, tuple[float, float]] | None = None,
                     prompt_embeds: np.ndarray | None = None, eos_token_ids: Sequence[int] = (),
                     progress: bool = False,
                     pass_seconds: Sequence[float] | None = None,
                     residency: Sequence[Sequence[Sequence[int]]] | None = None
                     ) -> ContinuousRun:
    """Serve ``prompts`` on ``pm`` with continuous batching under ``scheduler``.

    Args:
        pm: the offloaded model (:func:`~moeexp.engine.batch_pass.build_pass_model`).
        prompts: requests (``request_id``, ``input_ids``, ``prompt_len``, ``output_len``,
            optional ``task``/``text``), in arrival order.
        scheduler / profile: the admission policy (``fit(profile)`` is called here) and
            the fitted serving profile (expected output lengths, eMoE's c and ΔE).
        settings: T_max, max_running, mix_prefill (``backend.serving``); SLO scales unused
            (targets come as ``slo_s``).
        kv_bytes_per_token / kv_pool_bytes: the KV reservation unit (bytes per token) and
            the pool the reservations share (None: unbounded).
        arrivals_s: float[n] arrival times, s from the loop's start, non-decreasing
            (:func:`moeexp.serving.arrivals.poisson_arrivals`); None: offline, all at 0.
        forced: request id -> the tokens to feed at steps 1..N-1 (token replay); None: greedy.
        future: a trace of these very requests' passes (oracle's per-pass future).
        slo_s: request id -> (TTFT target s, e2e target s) (NaN TTFT: not checked); None:
            no targets (SLO keys left out; eMoE then never refuses for an SLO).
        prompt_embeds: float32[n, E] prompt embeddings, or None.
        eos_token_ids: suppressed while greedy (exactly ``output_len`` tokens per request).
        pass_seconds: None: the wall clock. Else a simulated clock: pass i lasts
            ``pass_seconds[i]`` s (e.g. the simulator's ``iter_ms`` of the same requests),
            arrivals wait on it, so admission and passes follow that timeline whatever
            this machine's speed (:mod:`moeexp.eval.serving_quality`); the latencies
            reported are then that clock's.
        residency: restricted routing only: per pass, per layer, the experts a lossy layer
            may use (e.g. the simulator's ``series["restricted_usable"]`` of the same
            passes, so the model computes under the simulated operating point's residency;
            those the engine lacks load on demand); None: what the engine holds ready.
    """
    settings = settings or ServingSettings()
    pool = int(kv_pool_bytes) if kv_pool_bytes is not None else np.iinfo(np.int64).max
    kv_per_token = int(kv_bytes_per_token)
    if kv_per_token < 0:
        raise ConfigError(f"kv_bytes_per_token must be >= 0, got {kv_per_token}")
    reqs = _requests(prompts, profile, kv_per_token, slo_s, prompt_embeds)
    _check(reqs, settings, pool, scheduler.budgeted)
    arrival = np.zeros(len(reqs)) if arrivals_s is None else np.asarray(arrivals_s, np.float64)
    if arrival.shape != (len(reqs),) or bool(np.any(np.diff(arrival) < 0)):
        raise ConfigError(f"arrivals_s must be {len(reqs)} non-decreasing times")
    if "future" in pm.engine.runner.predictor.needs and future is None:
        raise ConfigError(f"{pm.engine.runner.predictor.name} needs the future accesses: pass "
                          "future=<trace of these requests> (and forced=its tokens)")
    if residency is not None and not pm.engine.settings.restricted_routing:
        raise ConfigError("a residency replay needs restricted routing (an exact layer loads "
                          "what it needs whatever is resident)")
    scheduler.fit(profile)
    wall0 = time.perf_counter()
    runner = _EnginePasses(pm, reqs, forced,
                           future if "future" in pm.engine.runner.predictor.needs else None,
                           eos_token_ids, pass_seconds, residency)
    served = BatchingLoop([r.spec() for r in reqs], arrival, scheduler, settings, pool,
                          kv_per_token, runner, desc="engine serve", progress=progress).serve()
    metrics, series = _report(pm, runner, served, slo_s is not None, time.perf_counter() - wall0)
    metrics.update({"scheduler": scheduler.name,
                    "max_batch_tokens": float(settings.max_batch_tokens),
                    "max_running": float(settings.max_running),
                    "kv_pool_bytes": float(pool) if kv_pool_bytes is not None else NAN,
                    "kv_bytes_per_token": float(kv_per_token)})
    for k, v in scheduler.stats().items():
        metrics[f"scheduler_{k}"] = v
    return ContinuousRun(metrics=metrics, series=series,
                         tokens={r.meta.request_id: list(r.generated) for r in reqs},
                         passes=runner.passes, admitted=runner.admitted)


def _report(pm: PassModel, runner: _EnginePasses, served: ServedRun, with_slo: bool,
            wall_s: float) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Engine counters + the loop's latencies and serving quantities (the simulator's
    definitions, :mod:`moeexp.serving.report`) + the engine's own peaks and passes."""
    from moeexp.engine.report import RequestTiming

    ttft, tpot, e2e = served.latencies()
    pm.timing = RequestTiming(ttft=list(ttft), tpot=[x for x in tpot if np.isfinite(x)],
                              e2e=list(e2e))
    m: dict[str, Any] = pm.metrics()
    m.update(serving_quantities(served, m["output_tokens_total"]))
    m.update({"kv_cache_bytes_peak": float(runner.kv_cache_peak),
              "engine_wall_s": wall_s, "passes_total": float(len(runner.passes))})
    rq = runner.reqs
    st, se = [r.slo_ttft_s for r in rq], [r.slo_e2e_s for r in rq]
    if with_slo:
        m.update(slo_quantities(served, st, se))
    series = request_series(served, [r.meta.request_id for r in rq],
                            st if with_slo else None, se if with_slo else None)
    rows = runner.iter_rows
    series.update({
        "iter_hits": [float(r[0]) for r in rows], "iter_misses": [float(r[1]) for r in rows],
        "iter_stall_ms": [r[2] for r in rows], "iter_ms": [r[3] for r in rows],
        "iter_requests": list(served.it_requests), "iter_tokens": list(served.it_tokens)})
    return m, series
