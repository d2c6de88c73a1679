"""moeexp.serving.report on a hand-built record: latencies, queueing, span, SLO
attainment (a missing TTFT target is met), goodput, per-task attainment, series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeexp.serving.report import (
    ServedRun,
    request_series,
    serving_quantities,
    slo_met,
    slo_quantities,
)

NAN = float("nan")


def _run() -> ServedRun:
    """Three requests arriving at 0, 1, 2 s; the second queues 0.5 s and has no decode step."""
    run = ServedRun(n=3, arrival=np.asarray([0.0, 1.0, 2.0]))
    run.start.update({0: 0.0, 1: 1.5, 2: 2.0})
    run.first.update({0: 1.0, 1: 2.5, 2: 3.0})
    run.finish.update({0: 3.0, 1: 4.5, 2: 5.0})
    run.n_decode.update({0: 2, 1: 0, 2: 4})
    for requests, tokens, kv in ((1, 5, 30), (2, 6, 70), (3, 3, 50), (2, 2, 40)):
        run.note_pass(requests, tokens, kv)
    run.note_reserved(90)
    run.note_reserved(60)
    return run


def test_latencies_queueing_and_span() -> None:
    run = _run()
    ttft, tpot, e2e = run.latencies()
    assert ttft == [1.0, 1.5, 1.0] and e2e == [3.0, 3.5, 3.0]
    assert tpot[0] == 1.0 and math.isnan(tpot[1]) and tpot[2] == 0.5
    assert run.queueing() == [0.0, 0.5, 0.0]
    assert run.span_s() == 5.0 and run.per_s() == 0.2
    assert (run.kv_used_peak, run.kv_reserved_peak) == (70, 90)


def test_serving_quantities() -> None:
    m = serving_quantities(_run(), output_tokens=10)
    assert m["span_s"] == 5.0
    assert m["throughput_rps"] == pytest.approx(0.6)
    assert m["throughput_tokens_per_s"] == pytest.approx(2.0)
    assert m["queue_ms_mean"] == pytest.approx(500.0 / 3) and m["queue_ms_p50"] == 0.0
    assert (m["batch_requests_mean"], m["batch_requests_peak"], m["batch_tokens_mean"]) == \
        (2.0, 3.0, 4.0)
    assert (m["kv_reserved_peak_bytes"], m["kv_used_peak_bytes"]) == (90.0, 70.0)


def test_slo_attainment_and_goodput() -> None:
    """Targets: TTFT none / 1.0 / 1.0 s, e2e 3.0 / 4.0 / 2.9 s: request 0 meets both (no
    TTFT target), 1 misses TTFT (1.5 s), 2 misses e2e (3.0 s)."""
    run = _run()
    st, se = [NAN, 1.0, 1.0], [3.0, 4.0, 2.9]
    t_ok, e_ok, ok = slo_met(*run.latencies()[::2], st, se)
    assert t_ok.tolist() == [True, False, True] and e_ok.tolist() == [True, True, False]
    assert ok.tolist() == [True, False, False]
    m = slo_quantities(run, st, se, tasks=["qa", "qa", "a b"])
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["slo_ttft_attainment"] == m["slo_e2e_attainment"] == pytest.approx(2 / 3)
    assert m["goodput_rps"] == pytest.approx(0.2)
    assert m["slo_attainment_task_qa"] == 0.5 and m["slo_attainment_task_a_b"] == 0.0
    assert not any(k.startswith("slo_attainment_task") for k in slo_quantities(run, st, se))


def test_request_series_in_ms() -> None:
    run = _run()
    s = request_series(run, [7, 8, 9])
    assert s["request_id"] == [7, 8, 9]
    assert s["queue_ms"] == [0.0, 500.0, 0.0] and s["service_ms"] == [3000.0, 3000.0, 3000.0]
    assert s["ttft_ms"] == [1000.0, 1500.0, 1000.0] and "slo_met" not in s
    with_slo = request_series(run, [7, 8, 9], [NAN, 1.0, 1.0], [3.0, 4.0, 2.9])
    assert with_slo["slo_met"] == [1.0, 0.0, 0.0] and with_slo["slo_e2e_ms"][1] == 4000.0
