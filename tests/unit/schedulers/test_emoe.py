"""eMoE's admission on hand-worked cases: Eq. 3 by hand, refusals for SLO, tokens and
memory, SLO-stringency order, the G bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.schedulers import build_scheduler
from moeexp.schedulers.base import RunningRequest, SchedulerView, ServingProfile, WaitingRequest
from moeexp.schedulers.emoe import EMoEScheduler, expected_latency

#: c = 0.01 s/token, ΔE = 0.5 s; task "a" outputs 10 tokens, "b" 4, "n" 8.
PROFILE = ServingProfile(output_len_by_task={"a": 10.0, "b": 4.0, "n": 8.0},
                         output_len_mean=6.0, token_s=0.02, expert_load_s=0.5,
                         token_s_batched=0.01)


def test_eq3_by_hand() -> None:
    """Members A (G=10, arrived 0), B (G=4, arrived 1), new N (G=8, arrived 1.5), now 2,
    W = 5: n_A = 1, n_B = 3, n_N = 2, so
    t_A = 0.5 + (5 + 10)·0.01 + 2 = 2.65, t_B = 0.5 + (5 + 12)·0.01 + 1 = 1.67,
    t_N = 0.5 + (5 + 16)·0.01 + 0.5 = 1.21."""
    t = expected_latency(2.0, [0.0, 1.0, 1.5], [10.0, 4.0, 8.0], 5, 1, 0.5, 0.01)
    assert t == pytest.approx([2.65, 1.67, 1.21])
    # nothing admitted: no loading, no prompt; n_A = 1, n_B = 2
    t0 = expected_latency(2.0, [0.0, 1.0], [10.0, 4.0], 0, 0, 0.5, 0.01)
    assert t0 == pytest.approx([2.1, 1.08])


def _sched() -> EMoEScheduler:
    s = build_scheduler({"name": "emoe"})
    assert isinstance(s, EMoEScheduler)
    s.fit(PROFILE)
    return s


def _waiting(unit: int, task: str = "n", *, arrival: float = 1.5, tokens: int = 5,
             kv: int = 10, ttft: float = 1.0, e2e: float = 100.0) -> WaitingRequest:
    return WaitingRequest(unit=unit, task=task, arrival_s=arrival, first_tokens=tokens,
                          kv_bytes=kv, slo_ttft_s=ttft, slo_e2e_s=e2e)


def _with_running(s: EMoEScheduler, slo_b: float) -> list[RunningRequest]:
    """A (unit 0, task a) and B (unit 1, task b) admitted earlier, G = 10 and 4."""
    s.admit(SchedulerView(now_s=1.0, waiting=[_waiting(0, "a", arrival=0.0),
                                              _waiting(1, "b", arrival=1.0, e2e=slo_b)],
                          running=[], remaining=2, tokens_left=100, running_left=10,
                          kv_left_bytes=100))
    assert s.g == {0: 10.0, 1: 4.0}
    return [RunningRequest(unit=u, task=k, arrival_s=a, slo_ttft_s=1.0, slo_e2e_s=e,
                           start_s=1.0, passes_done=1, next_tokens=1)
            for u, k, a, e in ((0, "a", 0.0, 100.0), (1, "b", 1.0, slo_b))]


def _view(running: list[RunningRequest], waiting: list[WaitingRequest], *, tokens: int = 100,
          kv: int = 100) -> SchedulerView:
    return SchedulerView(now_s=2.0, waiting=waiting, running=running, remaining=len(waiting),
                         tokens_left=tokens, running_left=10, kv_left_bytes=kv)


def test_refused_for_slo() -> None:
    """B's SLO 1.6 s: on track before (1.08 s), over it with N admitted (1.67 s): refused."""
    s = _sched()
    run = _with_running(s, slo_b=1.6)
    assert s.admit(_view(run, [_waiting(2)])) == []
    assert s.stats()["refused_slo"] == 1.0


def test_admitted_when_every_slo_holds() -> None:
    """B's SLO 1.7 s >= 1.67 s: N is admitted, with G = its task's mean output length."""
    s = _sched()
    run = _with_running(s, slo_b=1.7)
    assert s.admit(_view(run, [_waiting(2)])) == [2]
    assert s.g[2] == 8.0


def test_a_late_member_does_not_block() -> None:
    """B's SLO 1.0 s is already missed without N (1.08 s): it is not protected."""
    s = _sched()
    run = _with_running(s, slo_b=1.0)
    assert s.admit(_view(run, [_waiting(2)])) == [2]


def test_refused_for_memory_and_tokens() -> None:
    s = _sched()
    run = _with_running(s, slo_b=100.0)
    assert s.admit(_view(run, [_waiting(2, kv=11)], kv=10)) == []
    assert s.admit(_view(run, [_waiting(3, tokens=6)], tokens=5)) == []
    assert s.stats() == {"refused_memory": 1.0, "refused_tokens": 1.0}


def test_queue_sorted_by_slo_stringency() -> None:
    """Room for one prompt: the request with the tighter TTFT target goes first, even
    though it arrived later; the other waits (refused for tokens, not skipped over)."""
    s = _sched()
    loose = _waiting(0, arrival=0.0, ttft=3.0)
    tight = _waiting(1, arrival=1.0, ttft=0.5)
    view = SchedulerView(now_s=2.0, waiting=[loose, tight], running=[], remaining=2,
                         tokens_left=5, running_left=10, kv_left_bytes=100)
    assert s.admit(view) == [1]
    assert s.stats()["refused_tokens"] == 1.0


def test_greedy_scan_admits_later_requests_that_fit() -> None:
    """A refused request does not stop the scan: a smaller one behind it is admitted."""
    s = _sched()
    big = _waiting(0, tokens=8, ttft=0.5)
    small = _waiting(1, tokens=3, ttft=1.0)
    view = SchedulerView(now_s=2.0, waiting=[big, small], running=[], remaining=2,
                         tokens_left=5, running_left=10, kv_left_bytes=100)
    assert s.admit(view) == [1]


def test_two_admissions_in_one_call_add_their_prompts_and_loads() -> None:
    """The second candidate is judged with the first one's W and ΔE already counted:
    A alone (G=10, r=2): before 2 + 0.5 + (5 + 10)·0.01 = 2.65 with one admission, after
    a second 2 + 1.0 + (10 + 10)·0.01 = 3.2 > SLO 3.0: refused."""
    s = _sched()
    s.admit(SchedulerView(now_s=0.0, waiting=[_waiting(0, "a", arrival=0.0, e2e=3.0)],
                          running=[], remaining=1, tokens_left=100, running_left=10,
                          kv_left_bytes=100))
    a = RunningRequest(unit=0, task="a", arrival_s=0.0, slo_ttft_s=1.0, slo_e2e_s=3.0,
                       start_s=0.0, passes_done=1, next_tokens=1)
    got = s.admit(_view([a], [_waiting(1, "b", ttft=0.1), _waiting(2, "b", ttft=0.2)]))
    assert got == [1]
    assert expected_latency(2.0, [0.0, 1.5, 1.5], [10.0, 4.0, 4.0], 10, 2, 0.5, 0.01)[0] == \
        pytest.approx(3.2)


def test_g_decrements_and_restarts_at_five_percent() -> None:
    """G = 10 at admission, minus one per pass; at 0 before the end it restarts at
    max(1, 5 % of 10) = 1; a finished request is forgotten."""
    s = _sched()
    s.admit(SchedulerView(now_s=0.0, waiting=[_waiting(0, "a")], running=[], remaining=1,
                          tokens_left=100, running_left=10, kv_left_bytes=100))
    for _ in range(9):
        s.on_pass([0], [])
    assert s.g[0] == 1.0
    s.on_pass([0], [])
    assert s.g[0] == 1.0 and s.stats()["g_resets"] == 1.0
    s.on_pass([0], [0])
    assert 0 not in s.g


def test_restart_fraction_scales_the_reset() -> None:
    s = build_scheduler({"name": "emoe", "restart_fraction": 0.5})
    s.fit(PROFILE)
    s.admit(SchedulerView(now_s=0.0, waiting=[_waiting(0, "a")], running=[], remaining=1,
                          tokens_left=100, running_left=10, kv_left_bytes=100))
    for _ in range(10):
        s.on_pass([0], [])
    assert s.g[0] == 5.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_bad_restart_fraction(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"restart_fraction must be in \(0, 1\]"):
        build_scheduler({"name": "emoe", "restart_fraction": bad})


def test_token_cost_picks_the_fitted_c() -> None:
    """``batched`` (default) uses token_s_batched = 0.01, ``alone`` token_s = 0.02; with
    c = 0.02, B's SLO 1.7 s no longer holds N (t_B = 0.5 + 17·0.02 + 1 = 1.84 s)."""
    assert _sched().token_s == 0.01
    s = build_scheduler({"name": "emoe", "token_cost": "alone"})
    s.fit(PROFILE)
    assert s.token_s == 0.02  # type: ignore[attr-defined]
    run = _with_running(s, slo_b=1.7)  # type: ignore[arg-type]
    assert s.admit(_view(run, [_waiting(2)])) == []
    with pytest.raises(ConfigError, match="token_cost='bogus'; valid: batched, alone"):
        build_scheduler({"name": "emoe", "token_cost": "bogus"})


def test_unfitted_scheduler_says_so() -> None:
    s = build_scheduler({"name": "emoe"})
    with pytest.raises(RuntimeError, match="fit"):
        s.admit(_view([], [_waiting(0)]))


def test_stringency_falls_back_to_e2e_without_ttft() -> None:
    """Decode-only requests (no TTFT target) are ordered by their end-to-end target."""
    s = _sched()
    a = _waiting(0, ttft=math.nan, e2e=5.0, tokens=5)
    b = _waiting(1, ttft=math.nan, e2e=2.0, tokens=5)
    view = SchedulerView(now_s=2.0, waiting=[a, b], running=[], remaining=2, tokens_left=5,
                         running_left=10, kv_left_bytes=100)
    assert s.admit(view) == [1]
    assert np.isnan(a.slo_ttft_s)


def test_task_agnostic_starts_every_g_at_the_overall_mean() -> None:
    """task_aware=false: G starts at output_len_mean (6) whatever the task (a: 10, b: 4)."""
    s = build_scheduler({"name": "emoe", "task_aware": False})
    assert isinstance(s, EMoEScheduler)
    s.fit(PROFILE)
    s.admit(SchedulerView(now_s=1.0, waiting=[_waiting(0, "a", arrival=0.0),
                                              _waiting(1, "b", arrival=1.0)],
                          running=[], remaining=2, tokens_left=100, running_left=10,
                          kv_left_bytes=100))
    assert s.g == {0: 6.0, 1: 6.0}
    with pytest.raises(ConfigError, match="task_aware"):
        build_scheduler({"name": "emoe", "task_aware": 1})
