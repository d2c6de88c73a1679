"""moeexp.serving.loop.BatchingLoop over a scripted PassRunner (one second per pass):
hand-worked admission and pass composition (mixed and split prefill), idle waits for the
next arrival, the records, the scheduler-bug errors, and conservation under random
arrivals and budgets."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.schedulers import build_scheduler
from moeexp.schedulers.base import Scheduler, SchedulerView
from moeexp.serving.arrivals import poisson_arrivals
from moeexp.serving.loop import BatchingLoop, PassMembers, RequestSpec
from moeexp.serving.settings import ServingSettings

NAN = float("nan")


class _Script:
    """A PassRunner on a simulated clock: every pass takes ``pass_s`` seconds; it logs
    what the loop asked of it."""

    def __init__(self, pass_s: float = 1.0) -> None:
        self.t, self.pass_s = 0.0, pass_s
        self.waits: list[float] = []
        self.started: list[tuple[list[int], float]] = []
        self.passes: list[PassMembers] = []
        self.ended: list[int] = []

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.waits.append(t)
        self.t = max(self.t, t)

    def start_requests(self, units: list[int], t: float) -> None:
        self.started.append((list(units), t))

    def run_pass(self, members: PassMembers) -> float:
        self.passes.append(members)
        self.t = members.start_s + self.pass_s
        return self.t

    def end_request(self, unit: int) -> None:
        self.ended.append(unit)


def _spec(*tokens: int, kv: int = 10, prefill: bool = True, cached: int = 0) -> RequestSpec:
    return RequestSpec(task="t", pass_tokens=list(tokens), kv_bytes=kv, slo_ttft_s=NAN,
                       slo_e2e_s=NAN, has_prefill=prefill, cached_tokens=cached)


def _serve(specs, arrival, *, scheduler="fcfs", pool=1000, kv_per_token=1, **settings):  # type: ignore[no-untyped-def]
    script = _Script()
    sched = scheduler if isinstance(scheduler, Scheduler) else build_scheduler({"name": scheduler})
    loop = BatchingLoop(specs, np.asarray(arrival, dtype=np.float64), sched,
                        ServingSettings(**settings), pool, kv_per_token, script)
    return loop.serve(), script


THREE = [_spec(4, 1, 1), _spec(2, 1), _spec(3)]


def test_mixed_passes_hand_worked() -> None:
    """All at 0, at most 2 running: 0 and 1 prefill together (t 0 -> 1), decode (1 -> 2,
    1 finishes), 2 joins 0's last decode step in one mixed pass (2 -> 3, both finish)."""
    run, s = _serve(THREE, [0.0, 0.0, 0.0], max_running=2)
    assert [(p.units, p.steps, p.start_s) for p in s.passes] == [
        ([0, 1], [0, 0], 0.0), ([0, 1], [1, 1], 1.0), ([0, 2], [2, 0], 2.0)]
    assert s.started == [([0, 1], 0.0), ([2], 2.0)] and s.ended == [1, 0, 2]
    assert run.start == {0: 0.0, 1: 0.0, 2: 2.0}
    assert run.first == {0: 1.0, 1: 1.0, 2: 3.0}
    assert run.finish == {1: 2.0, 0: 3.0, 2: 3.0}
    assert run.n_decode == {0: 2, 1: 1, 2: 0}
    assert run.it_requests == [2, 2, 2] and run.it_tokens == [6, 2, 4]
    # KV in use after each pass (1 B/token): 6, 8 (0: 5, 1: 3), then 0's 6 + 2's 3
    assert run.kv_used_peak == 9 and run.kv_reserved_peak == 20


def test_split_prefill_runs_joining_prompts_alone_first() -> None:
    """mix_prefill=false: 2's prefill is a pass of its own (2 -> 3), 0's last decode
    step waits for it (3 -> 4)."""
    run, s = _serve(THREE, [0.0, 0.0, 0.0], max_running=2, mix_prefill=False)
    assert [(p.units, p.steps) for p in s.passes] == [
        ([0, 1], [0, 0]), ([0, 1], [1, 1]), ([2], [0]), ([0], [2])]
    assert run.finish == {1: 2.0, 2: 3.0, 0: 4.0} and run.it_tokens == [6, 2, 3, 1]


def test_tokens_budget_holds_a_prompt_back() -> None:
    """T_max = 5: 0's prompt (4) fits, 1's (2) does not beside it; once 0 decodes
    (1 token), 1 joins (1 + 2 <= 5), then 2 (3 tokens) only when 1 decodes."""
    run, s = _serve(THREE, [0.0, 0.0, 0.0], max_batch_tokens=5)
    assert [(p.units, p.steps) for p in s.passes] == [
        ([0], [0]), ([0, 1], [1, 0]), ([0, 1, 2], [2, 1, 0])]
    assert max(run.it_tokens) <= 5


def test_idle_until_the_next_arrival() -> None:
    """Nothing runs between 0's finish (t = 1) and 1's arrival at 10: the loop waits for
    it; 1 starts on arrival (no queueing)."""
    run, s = _serve([_spec(3), _spec(2, 1)], [0.0, 10.0])
    assert s.waits == [10.0]
    assert run.start == {0: 0.0, 1: 10.0} and run.finish == {0: 1.0, 1: 12.0}
    assert run.queueing() == [0.0, 0.0]


def test_nan_arrival_arrives_when_admitted_and_no_prefill_starts_cached() -> None:
    """A static offline unit (NaN arrival) gets its admission time as arrival; a unit whose
    trace holds no prefill gets its first token at its first pass's start and counts its
    prompt (5) as cached from the start."""
    run, s = _serve([_spec(1, 1, prefill=False, cached=5), _spec(2)], [NAN, NAN],
                    scheduler=build_scheduler({"name": "static"}, batch_size=1))
    assert run.arrival.tolist() == [0.0, 2.0]
    assert run.first == {0: 0.0, 1: 3.0} and run.n_decode == {0: 2, 1: 0}
    assert run.kv_used_peak == 7  # 5 cached + 2 decoded


class _Nothing(Scheduler):
    name = "nothing_test"

    def admit(self, view: SchedulerView) -> list[int]:
        return []


class _Everyone(Scheduler):
    name = "everyone_test"

    def admit(self, view: SchedulerView) -> list[int]:
        return [w.unit for w in view.waiting]


def test_scheduler_bugs_are_caught() -> None:
    """Admitting nothing with nothing running and no arrival left, or admitting beyond
    max_running / the KV pool: RuntimeError before any pass."""
    with pytest.raises(RuntimeError, match="admitted nothing.*a scheduler bug"):
        _serve(THREE, [0.0, 0.0, 0.0], scheduler=_Nothing())
    with pytest.raises(RuntimeError, match="broke max_running"):
        _serve(THREE, [0.0, 0.0, 0.0], scheduler=_Everyone(), max_running=2)
    with pytest.raises(RuntimeError, match="broke the KV pool"):
        _serve(THREE, [0.0, 0.0, 0.0], scheduler=_Everyone(), pool=25)


@pytest.mark.parametrize("scheduler", ["fcfs", "emoe"])
@pytest.mark.parametrize("mix", [True, False])
def test_every_request_and_token_is_served_once_in_order(scheduler: str, mix: bool) -> None:
    """40 requests of random sizes, Poisson arrivals, tight budgets: each unit takes part
    in exactly len(pass_tokens) passes with steps 0, 1, ... in order, every pass holds
    distinct units within max_running (and T_max when mixed), the passes' tokens add up,
    reservations stay within the pool, and finish >= first >= start >= arrival."""
    from moeexp.schedulers.base import ServingProfile

    rng = np.random.default_rng(0)
    specs = [_spec(int(rng.integers(1, 9)), *([1] * int(rng.integers(0, 6))),
                   kv=int(rng.integers(5, 30))) for _ in range(40)]
    sched = build_scheduler({"name": scheduler})
    sched.fit(ServingProfile(output_len_by_task={}, output_len_mean=3.0, token_s=0.1,
                             expert_load_s=0.0, token_s_batched=0.05))
    run, s = _serve(specs, poisson_arrivals(2.0, 40, seed=1), scheduler=sched, pool=60,
                    max_batch_tokens=12, max_running=4, mix_prefill=mix)
    steps: dict[int, list[int]] = {}
    for p in s.passes:
        assert len(set(p.units)) == len(p.units) <= 4
        for u, k in zip(p.units, p.steps, strict=True):
            steps.setdefault(u, []).append(k)
    assert steps == {u: list(range(len(sp.pass_tokens))) for u, sp in enumerate(specs)}
    assert sum(run.it_tokens) == sum(sum(sp.pass_tokens) for sp in specs)
    if mix:
        assert max(run.it_tokens) <= 12
    assert run.kv_reserved_peak <= 60 and sorted(s.ended) == list(range(40))
    assert max(run.it_requests) > 1  # requests did overlap
    for u in range(40):
        assert run.arrival[u] <= run.start[u] <= run.first[u] <= run.finish[u]
