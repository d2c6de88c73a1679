"""``sim_vs_engine``'s CPU half: the calibrated profile's CPU block and the systems that run
missed experts on the CPU (issue 26).

:func:`calibrate_cpu` profiles the engine's CPU path (:func:`moeexp.engine.profile_cpu.
profile_cpu`: every expert on the host, timed by the engine) on the store prompts and adds
the fitted block (:func:`moeexp.costmodel.cpu_fit.fit_cpu_block`) to the calibrated
profile, so the calibrated cost model prices CPU experts with this machine's kernel.
:func:`execution_policies` builds a systems entry's ``execution`` (a conf/execution
option, or a mapping of its name and keys over it) for both backends, priced by that cost
model and fitted on the store split.

Both halves serve with the entry's policy: the engine computes its CPU experts for real,
the simulator (:func:`moeexp.simulator.simulate`, ``execution=``) prices them with the
calibrated ``cpu:`` block, so the TTFT/TPOT errors cover the CPU systems.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from moeexp.costmodel.cpu_fit import fit_cpu_block
from moeexp.errors import ConfigError
from moeexp.execution import ExecutionPolicy, build_execution
from moeexp.paths import group_options, load_group_yaml

log = logging.getLogger(__name__)


#: a systems entry's execution: a conf/execution option, or a mapping of its ``name`` and
#: keys over that option's YAML (e.g. ``{name: balanced, late_to_cpu: true}``)
ExecutionSpec = str | Mapping[str, Any]


def _choice(spec: ExecutionSpec) -> tuple[str, dict[str, Any]]:
    """(option name, keys over its YAML) of an entry's execution."""
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ConfigError(f"backend=sim_vs_engine: a systems entry's execution is a "
                          f"conf/execution option or a mapping with its name and keys over "
                          f"it (e.g. {{name: balanced, late_to_cpu: true}}), got {spec!r}")
    keys = {k: v for k, v in spec.items() if k != "name"}
    return str(spec["name"]), keys


def execution_label(spec: ExecutionSpec | None) -> str:
    """The summary's ``execution`` column: the option's name, then its overridden keys
    (``balanced(late_to_cpu=True)``); ``copy`` for none."""
    if not spec:
        return "copy"
    name, keys = _choice(spec)
    return name + (f"({', '.join(f'{k}={v}' for k, v in sorted(keys.items()))})" if keys else "")


def check_execution_names(specs: Sequence[ExecutionSpec]) -> None:
    """ConfigError for a systems entry's execution that is not a conf/execution option, or
    that overrides a key its option does not have."""
    valid = group_options("execution")
    choices = [_choice(s) for s in specs]
    bad = sorted({name for name, _ in choices} - set(valid))
    if bad:
        raise ConfigError(f"backend=sim_vs_engine: unknown execution(s) {bad}; valid: "
                          f"{', '.join(valid)}")
    for name, keys in choices:
        unknown = sorted(set(keys) - set(load_group_yaml("execution", name)))
        if unknown:
            raise ConfigError(f"backend=sim_vs_engine: execution {name} has no key(s) "
                              f"{unknown}; its keys: "
                              f"{', '.join(sorted(load_group_yaml('execution', name)))}")


def calibrate_cpu(loaded: Any, reqs: Sequence[tuple[list[int], int]], calib: Any, *,
                  settings: Any, warmup: int, progress: bool, outlier_mads: float | None,
                  expert_format: str = "dense") -> tuple[Any, dict[str, list[float]]]:
    """``calib`` with its CPU block fitted on the engine's CPU path (and the fit's quality
    in ``fit["cpu"]``), and the raw samples (for profile_samples.json)."""
    from moeexp.engine.profile_cpu import profile_cpu  # torch

    s = profile_cpu(loaded, reqs, settings=settings, warmup=warmup, progress=progress)
    cpu, quality = fit_cpu_block(
        s.rows, s.seconds, s.trip_bytes, s.trip_seconds, read_bytes_per_s=s.read_bytes_per_s,
        hidden_size=calib.hidden_size, intermediate_size=calib.intermediate_size,
        expert_bytes=calib.expert_bytes, expert_format=expert_format,
        where=f"{calib.meta.get('device', 'this machine')} (sim_vs_engine)",
        outlier_mads=outlier_mads)
    log.info("calibrated CPU: %.1f us per expert call + %.3f us per row (read %.2f GB/s, "
             "%.4f TFLOPS, call overhead %.1f us; roofline MAPE %.1f%%)",
             quality["intercept_us"], quality["per_row_us"], cpu.dram_gbps, cpu.tflops,
             cpu.call_overhead_us, quality["roofline_mape_pct"])
    out = dataclasses.replace(calib, cpu=cpu.to_mapping(), fit={**calib.fit, "cpu": quality})
    raw = {"cpu_rows": s.rows, "cpu_s": s.seconds, "cpu_trip_bytes": s.trip_bytes,
           "cpu_trip_s": s.trip_seconds, "cpu_read_bytes_per_s": [s.read_bytes_per_s]}
    return out, raw


def execution_policies(spec: ExecutionSpec, cost: Any, store: Any
                       ) -> tuple[ExecutionPolicy, ExecutionPolicy]:
    """Two fresh policies of conf/execution option ``spec`` (its YAML's keys, with a
    mapping's keys over them), checked against ``cost`` (a CPU policy needs its CPU block:
    ``cpu_profile: true``) and fitted on ``store`` when they learn from it: one per
    backend."""
    name, keys = _choice(spec)
    choice: dict[str, Any] = {**load_group_yaml("execution", name), **keys}
    out = []
    for _ in range(2):
        policy = build_execution(dict(choice), cost)
        if policy.needs_store:
            policy.fit(store)
        out.append(policy)
    return out[0], out[1]


def entry_executions(spec: ExecutionSpec | None, cost: Any, store: Any) -> tuple[Any, Any]:
    """A systems entry's execution policies, one per backend (simulator, engine); None, None
    for ``copy``."""
    if not spec:
        return None, None
    return execution_policies(spec, cost, store)


def cpu_columns(execution: ExecutionSpec | None, engine: Mapping[str, Any],
                sim: Mapping[str, Any]) -> dict[str, Any]:
    """summary.csv's CPU columns: the execution, both backends'
    CPU calls, CPU ms, streamed bytes and late copies' experts computed on the CPU (NaN
    without ``late_to_cpu``), and the calibrated CPU block's prediction for the
    engine's own CPU calls (``engine_cpu_model_ms_total``) with its error against the
    measured CPU ms (``cpu_ms_err_pct``: the test split, the block being fitted on the
    store split)."""
    nan = float("nan")
    out: dict[str, Any] = {"execution": execution_label(execution)}
    for side, m in (("engine", engine), ("sim", sim)):
        for k in ("cpu_expert_calls", "cpu_ms_total", "stream_h2d_bytes_total",
                  "cpu_late_experts_total"):
            out[f"{side}_{k}"] = m.get(k, nan)
    model, measured = engine.get("cpu_model_ms_total", nan), engine.get("cpu_ms_total", nan)
    out["engine_cpu_model_ms_total"] = model
    out["cpu_ms_err_pct"] = (float((model - measured) / measured * 100)
                             if measured > 0 and math.isfinite(model) else nan)
    return out


def calibration_cpu_metrics(calib: Any) -> dict[str, float]:
    """The CPU block's fitted numbers (``calib_cpu_*``), none when it was not profiled."""
    if calib.cpu is None:
        return {}
    c = calib.cpu
    q = calib.fit.get("cpu", {})
    return {"calib_cpu_dram_gbps": float(c["dram_gbps"]), "calib_cpu_tflops": float(c["tflops"]),
            "calib_cpu_call_overhead_us": float(c["call_overhead_us"]),
            "calib_cpu_hidden_latency_us": float(c["hidden_latency_us"]),
            "calib_cpu_roofline_mape_pct": float(q.get("roofline_mape_pct", float("nan")))}
