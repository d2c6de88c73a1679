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

This is the loop of :mod:`moeexp.simulator.continuous` with the clock, the passes and the
tokens real: same view, same admission rule, same pass composition rule (``mix_prefill``:
the requests admitted at a boundary join the decoding ones in one pass, or run their
prefill in a pass of their own first), same KV reservations (``kv_bytes_per_token`` x
(prompt + the task's profiled mean output length)), same records
(:class:`~moeexp.simulator.serving_report.ServedRun`, hence the same TTFT / TPOT / e2e /
queueing definitions). With the same requests, scheduler and a timing-independent
admission (offline arrivals under fcfs), the engine and the simulator run the very same
passes, which :func:`moeexp.backends.serving_check.sim_vs_engine_serving` checks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moeexp.engine.batch_pass import Member, PassModel
from moeexp.errors import ConfigError
from moeexp.metrics import summarize
from moeexp.schedulers.base import (
    RunningRequest,
    Scheduler,
    SchedulerView,
    ServingProfile,
    WaitingRequest,
    check_admission,
)
from moeexp.simulator.continuous import ServingSettings
from moeexp.simulator.serving_report import ServedRun, slo_met
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
    pos: int = 0  # passes done
    done_tokens: int = 0
    generated: list[int] = field(default_factory=list)

    @property
    def next_tokens(self) -> int:
        return int(self.prompt.prompt_len) if self.pos == 0 else 1


def pass_future(trace: Trace, members: Sequence[tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """L int64 arrays: the experts each layer uses in a pass of ``members`` ((request id,
    step) pairs) according to ``trace`` (oracle's future: the union of their iterations)."""
    its = []
    for rid, step in members:
        cand = trace.request_iterations(rid)
        hit = cand[trace.iter_step[cand] == step]
        if len(hit) != 1:
            raise ConfigError(f"the future trace has no step {step} of request {rid}")
        its.append(int(hit[0]))
    counts = sum(trace.iteration_counts(i) for i in its)
    return tuple(np.flatnonzero(row).astype(np.int64) for row in np.asarray(counts))


def _cache_bytes(cache: Any) -> int:
    """Bytes held by an HF cache's key and value tensors (0 for None)."""
    total = 0
    for layer in getattr(cache, "layers", ()) or ():
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class _EngineLoop:
    """One run of the batching loop on a :class:`PassModel` (the simulator's ``_Loop``
    with a wall clock: seconds since :meth:`serve` began)."""

    def __init__(self, pm: PassModel, reqs: list[_Req], arrival: np.ndarray,
                 scheduler: Scheduler, settings: ServingSettings, pool: int, kv_per_token: int,
                 forced: Mapping[int, Sequence[int]] | None, future: Trace | None,
                 eos: Sequence[int], progress: bool) -> None:
        self.pm, self.reqs, self.sched, self.set = pm, reqs, scheduler, settings
        self.pool, self.kv_per_token = pool, kv_per_token
        self.forced, self.future, self.eos = forced, future, list(eos)
        self.run = ServedRun(n=len(reqs), arrival=np.asarray(arrival, dtype=np.float64).copy())
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.fresh: list[int] = []
        self.passes: list[tuple[int, ...]] = []
        self.admitted: list[int] = []
        self.iter_rows: list[tuple[int, int, float, float]] = []  # hits, misses, stall, ms
        self.kv_cache_peak = 0
        self.t0 = 0.0
        self.bar = tqdm(total=len(reqs), desc=f"engine serve ({scheduler.name})", unit="req",
                        disable=not progress)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def serve(self) -> ServedRun:
        n, arrival = len(self.reqs), self.run.arrival
        nxt = n_done = 0
        event = True
        self.t0 = time.perf_counter()
        while n_done < n:
            now = self._now()
            while nxt < n and arrival[nxt] <= now:
                self.waiting.append(nxt)
                nxt += 1
                event = True
            if event or not self.sched.event_driven or not self.running:
                self._admit(now, remaining=n - n_done - len(self.running))
                event = False
            if not self.running:
                if nxt >= n:
                    raise RuntimeError(f"scheduler={self.sched.name} admitted nothing with "
                                       f"{len(self.waiting)} requests waiting, nothing "
                                       "running and no arrival left (a scheduler bug)")
                time.sleep(max(0.0, float(arrival[nxt]) - self._now()))
                continue
            finished = self._pass()
            if finished:
                n_done += len(finished)
                event = True
                self.bar.update(len(finished))
        self.bar.close()
        return self.run

    def _view(self, t: float, remaining: int) -> SchedulerView:
        """The simulator's view: the same fields from the same quantities."""
        rq = self.reqs
        running = [RunningRequest(
            unit=r, task=rq[r].meta.task, arrival_s=float(self.run.arrival[r]),
            slo_ttft_s=rq[r].slo_ttft_s, slo_e2e_s=rq[r].slo_e2e_s, start_s=self.run.start[r],
            passes_done=rq[r].pos, next_tokens=rq[r].next_tokens) for r in self.running]
        waiting = [WaitingRequest(
            unit=w, task=rq[w].meta.task, arrival_s=float(self.run.arrival[w]),
            first_tokens=int(rq[w].prompt.prompt_len), kv_bytes=rq[w].kv_bytes,
            slo_ttft_s=rq[w].slo_ttft_s, slo_e2e_s=rq[w].slo_e2e_s) for w in self.waiting]
        return SchedulerView(
            now_s=t, waiting=waiting, running=running, remaining=remaining,
            tokens_left=self.set.max_batch_tokens - (sum(r.next_tokens for r in running)
                                                     if self.set.mix_prefill else 0),
            running_left=self.set.max_running - len(running),
            kv_left_bytes=self.pool - sum(rq[r].kv_bytes for r in self.running))

    def _admit(self, t: float, remaining: int) -> None:
        if not self.waiting:
            return
        view = self._view(t, remaining)
        chosen = self.sched.admit(view)
        if not chosen:
            return
        check_admission(view, chosen, self.sched)
        for w in chosen:
            self.waiting.remove(w)
            self.running.append(w)
            self.fresh.append(w)
            self.run.start[w] = t
            req = self.reqs[w]
            self.admitted.append(req.meta.request_id)
            self.pm.start_request(req.meta, req.embed)
        self.run.note_reserved(sum(self.reqs[r].kv_bytes for r in self.running))

    def _member(self, r: int) -> Member:
        req = self.reqs[r]
        dev = self.pm.engine.device
        ids = (list(req.prompt.input_ids) if req.pos == 0 else [req.generated[-1]])
        return Member(request_id=req.meta.request_id, cache=req.cache, step=req.pos,
                      input_ids=torch.tensor([ids], dtype=torch.long, device=dev))

    def _next_token(self, req: _Req, logits: torch.Tensor) -> int:
        """The token generated at this pass: the recorded one (``forced``) or greedy
        with EOS suppressed (``min_new_tokens = output_len``, as generate decodes)."""
        rec = None if self.forced is None else self.forced[req.meta.request_id]
        if rec is not None and req.pos < len(rec):
            return int(rec[req.pos])
        scores = logits[0].float().clone()
        if self.eos:
            scores[self.eos] = float("-inf")
        return int(torch.argmax(scores).item())

    def _pass(self) -> list[int]:
        """One forward pass of the running batch (or of the fresh ones); the finished."""
        members = list(self.fresh if self.fresh and not self.set.mix_prefill else self.running)
        self.fresh = []
        mem = [self._member(r) for r in members]
        self.passes.append(tuple(m.request_id for m in mem))
        fut = (None if self.future is None
               else pass_future(self.future, [(m.request_id, m.step) for m in mem]))
        c = self.pm.engine.counters
        h0, a0, s0, w0 = c.hits, c.accesses, c.stall_s, time.perf_counter()
        out = self.pm.run_pass(mem, fut)
        t = self._now()
        c = self.pm.engine.counters
        self.iter_rows.append((c.hits - h0, (c.accesses - a0) - (c.hits - h0),
                               (c.stall_s - s0) * 1e3, (time.perf_counter() - w0) * 1e3))
        finished = []
        for r, m, (logits, cache) in zip(members, mem, out, strict=True):
            req = self.reqs[r]
            req.cache = cache
            req.generated.append(self._next_token(req, logits))
            if req.pos == 0:
                self.run.first[r] = t
            req.done_tokens += int(m.input_ids.shape[1])
            req.pos += 1
            if req.pos == int(req.prompt.output_len):
                finished.append(r)
        self.run.note_pass(len(members), sum(int(m.input_ids.shape[1]) for m in mem),
                           sum(self.kv_per_token * self.reqs[r].done_tokens for r in self.running))
        self.kv_cache_peak = max(self.kv_cache_peak,
                                 sum(_cache_bytes(self.reqs[r].cache) for r in self.running))
        self.sched.on_pass(members, finished)
        for r in finished:
            req = self.reqs[r]
            self.run.finish[r] = t
            self.run.n_decode[r] = int(req.prompt.output_len) - 1
            self.pm.end_request(req.meta.request_id)
            self.running.remove(r)
            req.cache = None  # its KV cache leaves with it
        return finished


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
                        kv_bytes=kv_per_token * int(round(int(p.prompt_len)
                                                          + profile.output_len(task))),
                        embed=None if prompt_embeds is None else np.asarray(prompt_embeds[i])))
    return out


def _check(reqs: list[_Req], settings: ServingSettings, pool: int, budgeted: bool) -> None:
    """Each prompt fits T_max (no chunked prefill) and each reservation the pool, output
    lengths >= 1, ids distinct: ConfigError naming the numbers otherwise."""
    if not reqs:
        raise ConfigError("continuous serving needs at least one request")
    ids = [r.meta.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise ConfigError("continuous serving: request ids must be distinct")
    if min(r.meta.output_len for r in reqs) < 1:
        raise ConfigError("continuous serving: every request's output_len must be >= 1")
    if not budgeted:
        return
    longest = max(r.meta.prompt_len for r in reqs)
    if longest > settings.max_batch_tokens:
        raise ConfigError(f"backend.serving: max_batch_tokens={settings.max_batch_tokens} is "
                          f"below one prompt ({longest} tokens); T_max must be >= {longest} "
                          "(no chunked prefill)")
    k = max(reqs, key=lambda r: r.kv_bytes)
    if k.kv_bytes > pool:
        raise ConfigError(f"backend.serving: one request's KV cache ({k.kv_bytes} bytes) "
                          f"exceeds the KV pool ({pool} bytes)")


def serve_continuous(pm: PassModel, prompts: Sequence[Any], scheduler: Scheduler,
                     profile: ServingProfile, *, settings: ServingSettings | None = None,
                     kv_bytes_per_token: int = 0, kv_pool_bytes: int | None = None,
                     arrivals_s: Sequence[float] | None = None,
                     forced: Mapping[int, Sequence[int]] | None = None,
                     future: Trace | None = None,
                     slo_s: Mapping[int, tuple[float, float]] | None = None,
                     prompt_embeds: np.ndarray | None = None, eos_token_ids: Sequence[int] = (),
                     progress: bool = False) -> ContinuousRun:
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
            (:func:`moeexp.simulator.plan.poisson_arrivals`); None: offline, all at 0.
        forced: request id -> the tokens to feed at steps 1..N-1 (token replay); None: greedy.
        future: a trace of these very requests' passes (oracle's per-pass future).
        slo_s: request id -> (TTFT target s, e2e target s) (NaN TTFT: not checked); None:
            no targets (SLO keys left out; eMoE then never refuses for an SLO).
        prompt_embeds: float32[n, E] prompt embeddings, or None.
        eos_token_ids: suppressed while greedy (exactly ``output_len`` tokens per request).
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
    scheduler.fit(profile)
    wall0 = time.perf_counter()
    loop = _EngineLoop(pm, reqs, arrival, scheduler, settings, pool, kv_per_token, forced,
                       future if "future" in pm.engine.runner.predictor.needs else None,
                       eos_token_ids, progress)
    served = loop.serve()
    metrics, series = _report(pm, loop, served, slo_s is not None, time.perf_counter() - wall0)
    metrics.update({"scheduler": scheduler.name,
                    "max_batch_tokens": float(settings.max_batch_tokens),
                    "max_running": float(settings.max_running),
                    "kv_pool_bytes": float(pool) if kv_pool_bytes is not None else NAN,
                    "kv_bytes_per_token": float(kv_per_token)})
    for k, v in scheduler.stats().items():
        metrics[f"scheduler_{k}"] = v
    return ContinuousRun(metrics=metrics, series=series,
                         tokens={r.meta.request_id: list(r.generated) for r in reqs},
                         passes=loop.passes, admitted=loop.admitted)


def _report(pm: PassModel, loop: _EngineLoop, served: ServedRun, with_slo: bool,
            wall_s: float) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Engine counters + the loop's latencies (ServedRun's definitions) + serving keys."""
    from moeexp.engine.report import RequestTiming

    ttft, tpot, e2e = served.latencies()
    pm.timing = RequestTiming(ttft=list(ttft), tpot=[x for x in tpot if np.isfinite(x)],
                              e2e=list(e2e))
    m: dict[str, Any] = pm.metrics()
    u = range(served.n)
    queue = [(served.start[i] - served.arrival[i]) * 1e3 for i in u]
    span = max(served.finish.values()) - float(np.min(served.arrival))
    per_s = 1.0 / span if span > 0 else NAN
    m.update({
        "span_s": float(span), "throughput_rps": served.n * per_s,
        "throughput_tokens_per_s": m["output_tokens_total"] * per_s,
        **summarize("queue_ms", np.asarray(queue)),
        "batch_requests_mean": float(np.mean(served.it_requests)),
        "batch_requests_peak": float(max(served.it_requests)),
        "batch_tokens_mean": float(np.mean(served.it_tokens)),
        "kv_reserved_peak_bytes": float(served.kv_reserved_peak),
        "kv_used_peak_bytes": float(served.kv_used_peak),
        "kv_cache_bytes_peak": float(loop.kv_cache_peak),
        "engine_wall_s": wall_s, "passes_total": float(len(loop.passes))})
    rq = loop.reqs
    series: dict[str, list[Any]] = {
        "request_id": [r.meta.request_id for r in rq],
        "arrival_ms": [served.arrival[i] * 1e3 for i in u],
        "ttft_ms": [x * 1e3 for x in ttft], "tpot_ms": [x * 1e3 for x in tpot],
        "e2e_ms": [x * 1e3 for x in e2e], "queue_ms": queue,
        "service_ms": [(served.finish[i] - served.start[i]) * 1e3 for i in u],
        "iter_hits": [float(r[0]) for r in loop.iter_rows],
        "iter_misses": [float(r[1]) for r in loop.iter_rows],
        "iter_stall_ms": [r[2] for r in loop.iter_rows], "iter_ms": [r[3] for r in loop.iter_rows],
        "iter_requests": list(served.it_requests), "iter_tokens": list(served.it_tokens)}
    if with_slo:
        st, se = [r.slo_ttft_s for r in rq], [r.slo_e2e_s for r in rq]
        t_ok, e_ok, ok = slo_met(ttft, e2e, st, se)
        m.update({"slo_attainment": float(ok.mean()), "slo_ttft_attainment": float(t_ok.mean()),
                  "slo_e2e_attainment": float(e_ok.mean()), "goodput_rps": float(ok.sum()) * per_s})
        series.update({"slo_ttft_ms": [x * 1e3 for x in st], "slo_e2e_ms": [x * 1e3 for x in se],
                       "slo_met": [float(x) for x in ok]})
    return m, series
