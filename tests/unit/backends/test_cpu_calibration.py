"""sim_vs_engine's CPU half: execution entries, their summary columns, the calibrated CPU
block's metrics."""

from __future__ import annotations

import math

import pytest

from moeexp.backends.cpu_calibration import (
    calibration_cpu_metrics,
    check_execution_names,
    cpu_columns,
    entry_executions,
    execution_policies,
)
from moeexp.costmodel.hardware import load_profile
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.traces.synthetic import random_trace


def test_entries_build_one_fresh_policy_per_backend() -> None:
    tr = random_trace(num_requests=3, num_layers=4, num_experts=8, top_k=2, output_len=4)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4_xeon_e5v4"), tr.dims)
    assert entry_executions(None, cost, tr) == (None, None)
    sim, eng = entry_executions("cpu_on_miss", cost, tr)
    assert sim is not eng and sim.name == eng.name == "cpu_on_miss"
    a, b = execution_policies("hot_pinned", cost, tr)  # fitted on the store: pins known
    assert a is not b and a.gpu_resident() == b.gpu_resident() and a.gpu_resident()
    with pytest.raises(ConfigError, match="no cpu: block"):
        execution_policies("cpu_on_miss", CostModel.from_profile(load_profile("rtx3090_pcie4"),
                                                                 tr.dims), tr)
    with pytest.raises(ConfigError, match="cpu_on_miss"):
        check_execution_names(["cpu_on_mis"])


def test_cpu_columns_compare_the_block_with_the_engine() -> None:
    eng = {"cpu_expert_calls": 10.0, "cpu_ms_total": 4.0, "stream_h2d_bytes_total": 0.0,
           "cpu_model_ms_total": 5.0}
    row = cpu_columns("cpu_on_miss", eng, {"cpu_ms_total": 4.5})
    assert row["execution"] == "cpu_on_miss" and row["cpu_ms_err_pct"] == pytest.approx(25.0)
    assert row["sim_cpu_ms_total"] == 4.5 and math.isnan(row["sim_cpu_expert_calls"])
    assert math.isnan(cpu_columns(None, {"cpu_ms_total": 0.0}, {})["cpu_ms_err_pct"])


def test_calibration_cpu_metrics_only_with_a_block() -> None:
    class _C:
        cpu = None
        fit: dict = {}

    assert calibration_cpu_metrics(_C()) == {}
    _C.cpu = {"dram_gbps": 8.0, "tflops": 0.1, "call_overhead_us": 100.0,
              "hidden_latency_us": 5.0}
    _C.fit = {"cpu": {"roofline_mape_pct": 12.0}}
    m = calibration_cpu_metrics(_C())
    assert m["calib_cpu_dram_gbps"] == 8.0 and m["calib_cpu_roofline_mape_pct"] == 12.0


def test_an_entry_execution_may_override_keys_of_its_option() -> None:
    """``{name: balanced, late_to_cpu: true}``: the option's YAML with the entry's keys over
    it, for both backends; the summary's label names them; a key the option lacks, or a
    mapping without a name, is refused."""
    tr = random_trace(num_requests=3, num_layers=4, num_experts=8, top_k=2, output_len=4)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4_xeon_e5v4"), tr.dims)
    spec = {"name": "balanced", "late_to_cpu": True}
    check_execution_names(["balanced", spec])
    sim, eng = entry_executions(spec, cost, tr)
    assert sim is not eng and sim.late_to_cpu and eng.late_to_cpu
    plain, _ = entry_executions("balanced", cost, tr)
    assert not plain.late_to_cpu
    assert cpu_columns(spec, {}, {})["execution"] == "balanced(late_to_cpu=True)"
    assert cpu_columns("balanced", {}, {})["execution"] == "balanced"
    late = cpu_columns(spec, {"cpu_late_experts_total": 3.0}, {"cpu_late_experts_total": 4.0})
    assert late["engine_cpu_late_experts_total"] == 3.0 and late["sim_cpu_late_experts_total"] == 4.0
    with pytest.raises(ConfigError, match="late_to_cpu"):
        check_execution_names([{"name": "balanced", "late_to_cpus": True}])
    with pytest.raises(ConfigError, match="name"):
        check_execution_names([{"late_to_cpu": True}])
