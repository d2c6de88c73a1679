"""The simulator benchmark reports CPU and wall time, the figures before the speed-up
beside the new ones, and judges the 2 s target on CPU seconds."""

from __future__ import annotations

import math

from moeexp.bench import simulator


def test_small_protocol_reports_cpu_wall_and_before() -> None:
    """A tiny protocol (foundation systems only): each system has CPU and wall seconds,
    accesses per CPU second, its figures before the speed-up, and ``within_target`` from
    the CPU seconds against :data:`~moeexp.bench.simulator.TARGET_S` (2 s)."""
    out = simulator.run(num_prompts=6, prompt_len=5, output_len=4, repeats=1, presets=False)
    assert out["protocol"]["target_s"] == simulator.TARGET_S == 2.0
    assert set(out["systems"]) == set(simulator.SYSTEMS)
    for name, s in out["systems"].items():
        assert s["cpu_s"] > 0 and s["wall_s"] > 0
        assert math.isclose(s["accesses_per_cpu_s"], s["accesses_total"] / s["cpu_s"])
        assert s["cpu_s_before"] == simulator.BEFORE[name][0]
        assert s["accesses_per_s_before"] == simulator.BEFORE[name][1]
        assert s["within_target"] == (s["cpu_s"] <= 2.0)
    assert out["all_within_target"] == (out["max_cpu_s"] <= 2.0)
