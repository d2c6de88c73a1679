"""The iteration-level batching loop both mechanisms run, over a clock they provide.

::

    BatchingLoop(requests, arrival, scheduler, settings, pool, kv_per_token, runner).serve()
    until every request finished:
      t = runner.now()
      arrivals up to t join the waiting queue             (NaN: arrives when admitted)
      scheduler.admit(SchedulerView)  (every boundary; an event-driven one after an
                                       arrival or a completion, or when nothing runs)
        check_admission: only waiting units, within T_max, max_running, the KV pool
        runner.start_requests(chosen, t)                  (predictor start_request ...)
      nothing running: runner.wait_until(next arrival)    (none left: a scheduler bug)
      members = the running batch (mix_prefill) or the units admitted since the last
                pass (their prefill first, mix_prefill=false)
      t_end = runner.run_pass(PassMembers)               (one forward pass)
      each member's pass count, first-token / finish times, KV in use
      scheduler.on_pass(members, finished); runner.end_request(each finished)

The loop owns the queue, the running batch, the budgets' accounting and the records
(:class:`~moeexp.serving.report.ServedRun`); a :class:`PassRunner` owns how one pass runs
and how time advances: the simulator's (:mod:`moeexp.simulator.continuous`) on the cost
model's clock, the engine's (:mod:`moeexp.engine.continuous`) on the wall clock.
Decisions are the scheduler's (:mod:`moeexp.schedulers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from moeexp.schedulers.base import (
    RunningRequest,
    Scheduler,
    SchedulerView,
    WaitingRequest,
    check_admission,
)
from moeexp.serving.report import ServedRun
from moeexp.serving.settings import ServingSettings


@dataclass(frozen=True)
class RequestSpec:
    """What the loop knows of one served request (a unit) before serving.

    Attributes:
        task: its task label ("" = untyped).
        pass_tokens: tokens of each of its forward passes, in order (its prompt for a
            prefill, then 1 per decode step); it finishes after ``len(pass_tokens)``.
        kv_bytes: KV bytes it reserves while running (:func:`~moeexp.serving.settings.
            kv_reservation_bytes`).
        slo_ttft_s: its TTFT target, s (NaN: none).
        slo_e2e_s: its end-to-end target, s (NaN: none).
        has_prefill: its first pass is a prefill (TTFT is that pass's end; without one,
            its start).
        cached_tokens: tokens in its KV cache before its first pass (its prompt when the
            trace holds no prefill, else 0).
    """

    task: str
    pass_tokens: Sequence[int]
    kv_bytes: int
    slo_ttft_s: float
    slo_e2e_s: float
    has_prefill: bool = True
    cached_tokens: int = 0


@dataclass(frozen=True)
class PassMembers:
    """One forward pass to run.

    Attributes:
        units: the members, in pass order (running requests in admission order).
        steps: each member's passes done before this one (0: its first pass).
        start_s: the clock when the pass starts, s.
    """

    units: list[int]
    steps: list[int]
    start_s: float


class PassRunner(Protocol):
    """How a mechanism runs passes and keeps time (seconds since serving began)."""

    def now(self) -> float:
        """The clock, s."""
        ...

    def wait_until(self, t: float) -> None:
        """Idle (nothing running) until ``t`` s, the next arrival."""
        ...

    def start_requests(self, units: list[int], t: float) -> None:
        """``units`` join the running batch at ``t`` s, in this order."""
        ...

    def run_pass(self, members: PassMembers) -> float:
        """Run one forward pass of ``members``; returns the clock at its end, s."""
        ...

    def end_request(self, unit: int) -> None:
        """``unit`` finished (after the pass that finished it)."""
        ...


class BatchingLoop:
    """One run of the batching loop (module docstring).

    Args:
        requests: one spec per unit, in arrival order.
        arrival: float[n] arrival times, s, non-decreasing (NaN: arrives when admitted).
        scheduler: the admission policy (fitted).
        settings: T_max, max_running, mix_prefill.
        pool: the KV pool, bytes.
        kv_per_token: KV bytes per cached token (the ``kv_used`` record).
        runner: the mechanism.
        desc / progress: the progress bar's label, and whether to show it.
    """

    def __init__(self, requests: Sequence[RequestSpec], arrival: np.ndarray,
                 scheduler: Scheduler, settings: ServingSettings, pool: int, kv_per_token: int,
                 runner: PassRunner, *, desc: str = "serve", progress: bool = False) -> None:
        self.req, self.sched, self.set = list(requests), scheduler, settings
        self.pool, self.kv_per_token, self.runner = pool, kv_per_token, runner
        self.tokens = [list(r.pass_tokens) for r in self.req]
        self.kv = [r.kv_bytes for r in self.req]
        self.run = ServedRun(n=len(self.req), arrival=np.asarray(arrival, dtype=np.float64).copy())
        self.pos = [0] * len(self.req)  # passes done by each unit
        self.done_tokens = [r.cached_tokens for r in self.req]  # tokens in its KV cache
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.fresh: list[int] = []  # admitted since the last pass (their prefill is next)
        self.bar = tqdm(total=len(self.req), desc=f"{desc} ({scheduler.name})", unit="req",
                        disable=not progress)

    def serve(self) -> ServedRun:
        """Serve every request; the records."""
        n, arrival = len(self.req), self.run.arrival
        nxt = n_done = 0
        event = True
        while n_done < n:
            t = self.runner.now()
            while nxt < n and (np.isnan(arrival[nxt]) or arrival[nxt] <= t):
                self.waiting.append(nxt)
                nxt += 1
                event = True
            if event or not self.sched.event_driven or not self.running:
                self._admit(t, remaining=n - n_done - len(self.running))
                event = False
            if not self.running:
                if nxt >= n:
                    raise RuntimeError(f"scheduler={self.sched.name} admitted nothing with "
                                       f"{len(self.waiting)} requests waiting, nothing "
                                       "running and no arrival left (a scheduler bug)")
                self.runner.wait_until(float(arrival[nxt]))
                continue
            finished = self._pass(t)
            if finished:
                n_done += len(finished)
                event = True
                self.bar.update(len(finished))
        self.bar.close()
        return self.run

    def view(self, t: float, remaining: int) -> SchedulerView:
        """The state the scheduler sees at ``t`` s (``remaining``: units not admitted)."""
        rq, run, pos, tok = self.req, self.run, self.pos, self.tokens
        running = [RunningRequest(
            unit=r, task=rq[r].task, arrival_s=float(run.arrival[r]),
            slo_ttft_s=rq[r].slo_ttft_s, slo_e2e_s=rq[r].slo_e2e_s, start_s=run.start[r],
            passes_done=pos[r], next_tokens=tok[r][pos[r]]) for r in self.running]
        waiting = [WaitingRequest(
            unit=w, task=rq[w].task,
            arrival_s=float(t if np.isnan(run.arrival[w]) else run.arrival[w]),
            first_tokens=tok[w][0] if tok[w] else 0, kv_bytes=self.kv[w],
            slo_ttft_s=rq[w].slo_ttft_s, slo_e2e_s=rq[w].slo_e2e_s) for w in self.waiting]
        return SchedulerView(
            now_s=t, waiting=waiting, running=running, remaining=remaining,
            tokens_left=self.set.max_batch_tokens - (sum(r.next_tokens for r in running)
                                                     if self.set.mix_prefill else 0),
            running_left=self.set.max_running - len(running),
            kv_left_bytes=self.pool - sum(self.kv[r] for r in self.running))

    def _admit(self, t: float, remaining: int) -> None:
        """Ask the scheduler; hold its choice to the budgets; start the chosen."""
        if not self.waiting:
            return
        view = self.view(t, remaining)
        chosen = self.sched.admit(view)
        if not chosen:
            return
        check_admission(view, chosen, self.sched)
        for w in chosen:
            self.waiting.remove(w)
            self.running.append(w)
            self.fresh.append(w)
            self.run.start[w] = t
            if np.isnan(self.run.arrival[w]):
                self.run.arrival[w] = t
        self.runner.start_requests(list(chosen), t)
        self.run.note_reserved(sum(self.kv[r] for r in self.running))

    def _pass(self, t0: float) -> list[int]:
        """One forward pass of the running batch (or of the fresh ones) from ``t0``; the
        units it finished."""
        run, pos = self.run, self.pos
        members = list(self.fresh if self.fresh and not self.set.mix_prefill else self.running)
        self.fresh = []
        t = self.runner.run_pass(PassMembers(units=members, steps=[pos[r] for r in members],
                                             start_s=t0))
        finished = []
        tokens = 0
        for r in members:
            spec, k = self.req[r], pos[r]
            if k == 0:
                run.first[r] = t if spec.has_prefill else t0
            tokens += self.tokens[r][k]
            self.done_tokens[r] += self.tokens[r][k]
            pos[r] = k + 1
            if pos[r] == len(self.tokens[r]):
                finished.append(r)
        run.note_pass(len(members), tokens,
                      sum(self.kv_per_token * self.done_tokens[r] for r in self.running))
        self.sched.on_pass(members, finished)
        for r in finished:
            run.finish[r] = t
            run.n_decode[r] = max(0, len(self.tokens[r]) - int(self.req[r].has_prefill))
            self.runner.end_request(r)
            self.running.remove(r)
        return finished
