"""The calibrated profile's CPU block: this machine's CPU expert kernel, fitted on the engine's
own timings (numpy only; the samples come from :mod:`moeexp.engine.profile_cpu`).

Inputs: per CPU expert call of the engine (every expert computed on the host from the store,
one call per expert: :mod:`moeexp.engine.host_experts`), its routing rows n and seconds; per
layer, the hidden states' trips (bytes both ways, seconds); and the host's achieved DRAM
read bandwidth BW (a streaming read of a buffer far larger than the caches, on the engine's
threads). The fit (non-negative least squares of the mean, as every calibrated part)::

    expert call   t(n) = a + b * n
    trips         s(bytes) = c + d * bytes

gives the CPU block (:class:`~moeexp.costmodel.cpu.CpuProfile`) whose
:meth:`~moeexp.costmodel.roofline.CostModel.cpu_expert_s` ``max(B / (eta BW), 6 H I n / F)
+ t_call`` reproduces it::

    dram_gbps           BW as measured; efficiency[format profiled] = 1.0
    tflops              F = 6 H I / b                    (the per-row slope)
    call_overhead_us    t_call = a - B / BW, >= 0        (the intercept less the weights' read)
    hidden_latency_us   c / 2                            (one latency each way)

The roofline equals the linear fit while the read binds (n <= B F / (6 H I BW)) and falls
below it by B / BW beyond; ``fit["cpu"]`` reports both fits' errors on the samples
(``roofline_mape_pct``: the block's own error, what the simulator inherits). An expert
small enough to stay in the caches (the tiny model's tens of KiB) is not read from DRAM
at BW, so for it the split between B / BW and t_call is nominal; their sum, what the
simulator charges at one token, is the measured intercept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from moeexp.costmodel.cpu import CpuProfile
from moeexp.costmodel.fitted import fit_linear
from moeexp.errors import ConfigError

log = logging.getLogger(__name__)

#: Seconds per routing row taken when the fitted slope is 0 (compute never binds).
MIN_ROW_S = 1e-12


def fit_cpu_block(rows: Sequence[float], seconds: Sequence[float], trip_bytes: Sequence[float],
                  trip_seconds: Sequence[float], *, read_bytes_per_s: float, hidden_size: int,
                  intermediate_size: int, expert_bytes: int, expert_format: str = "dense",
                  where: str = "this machine", outlier_mads: float | None = None
                  ) -> tuple[CpuProfile, dict[str, Any]]:
    """The CPU block fitted from the engine's CPU samples (module docstring) and the fit's
    quality (``rms_ms``, ``r2``, ``n`` of the expert-call fit, ``roofline_mape_pct``,
    ``trip_rms_ms``, the coefficients in us). ``outlier_mads``: as
    :func:`~moeexp.costmodel.fitted.fit_linear`'s (None: every sample, the mean).

    Raises:
        ConfigError: fewer than 4 expert calls or 2 distinct row counts, no trips, or a
            non-positive bandwidth. A time that does not grow with the rows (a slope the
            non-negative fit clamps to 0 in noise) is logged and floored at
            :data:`MIN_ROW_S`: compute never binds.
    """
    n = np.asarray(rows, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if len(n) < 4 or len(np.unique(n)) < 2 or len(trip_bytes) < 1:
        raise ConfigError(f"CPU calibration: {len(n)} expert calls of {len(np.unique(n))} row "
                          f"count(s) and {len(trip_bytes)} trips (need >= 4 calls, >= 2 row "
                          "counts, >= 1 trip: profile prefills and decodes)")
    if not read_bytes_per_s > 0:
        raise ConfigError(f"CPU calibration: read bandwidth {read_bytes_per_s} must be > 0")
    ex = fit_linear(np.c_[np.ones(len(n)), n], t, outlier_mads=outlier_mads)
    a, b = float(ex.coef[0]), float(ex.coef[1])
    slope_note = f"slope {b * 1e6:.3f} us per routing row = 6 H I FLOPs"
    if b <= 0:  # the non-negative fit clamped it: no measurable growth in the noise
        log.warning("CPU calibration: the CPU expert time does not grow with its rows; "
                    "compute is taken never to bind (slope %.0e s per row)", MIN_ROW_S)
        b = MIN_ROW_S
        slope_note = f"no measurable growth with the rows: slope floored at {MIN_ROW_S:.0e} s"
    tb = np.asarray(trip_bytes, dtype=np.float64)
    ts = np.asarray(trip_seconds, dtype=np.float64)
    X = np.c_[np.ones(len(tb)), tb] if len(np.unique(tb)) >= 2 else np.ones((len(tb), 1))
    trip = fit_linear(X, ts, outlier_mads=outlier_mads)
    flops_tok = 6.0 * hidden_size * intermediate_size
    read_s = expert_bytes / read_bytes_per_s
    call_s = max(0.0, a - read_s)
    gbps = read_bytes_per_s / 1e9
    cpu = CpuProfile(
        name="calibrated", dram_gbps=gbps, tflops=flops_tok / b / 1e12,
        call_overhead_us=call_s * 1e6, hidden_latency_us=float(trip.coef[0]) / 2 * 1e6,
        host_memory_gbps=gbps, efficiency=((expert_format, 1.0),),
        source=(
            ("dram_gbps", f"measured on {where}: streaming read of a buffer far larger than "
                          f"the caches, {gbps:.2f} GB/s"),
            ("tflops", f"fitted on {where}: the engine's CPU expert calls, {slope_note}"),
            ("call_overhead_us", f"fitted on {where}: intercept {a * 1e6:.1f} us per expert "
                                 f"call less the weights' read B/BW = {read_s * 1e6:.1f} us"),
            ("hidden_latency_us", f"fitted on {where}: half the intercept of the hidden "
                                  "states' trips (engine, both ways per layer)"),
            (f"efficiency.{expert_format}", "1.0 by construction: dram_gbps is the measured "
                                            "read bandwidth of this machine"),
        ))
    roof = np.maximum(read_s, flops_tok * n / cpu.flops_per_s) + call_s
    quality: dict[str, Any] = {
        "rms_ms": ex.rms * 1e3, "r2": ex.r2, "n": ex.n, "kept": ex.kept,
        "intercept_us": a * 1e6, "per_row_us": float(ex.coef[1]) * 1e6,
        "roofline_mape_pct": float(np.mean(np.abs(roof - t) / np.maximum(t, 1e-12)) * 100),
        "trip_rms_ms": trip.rms * 1e3, "trips": float(len(tb)),
    }
    return cpu, quality
