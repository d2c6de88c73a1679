"""The calibrated CPU block: fitted from CPU expert-call samples, stored with the calibrated
profile, handed to the simulator's cost model, refused on too few samples."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.costmodel.cpu_fit import MIN_ROW_S, fit_cpu_block
from moeexp.costmodel.fitted import CalibratedCostModel, CalibratedProfile, load_cost_model
from moeexp.costmodel.hardware import load_profile
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

L, H, INTER, EB = 8, 64, 128, 3 * 64 * 128 * 4
DIMS = TraceDims(num_layers=L, num_experts=16, top_k=2, hidden_size=H, spec_depth=0,
                 expert_bytes=EB, dense_bytes=10_000, intermediate_size=INTER)
#: The synthetic machine: 10 GB/s read, 150 us per call beyond the read, 2 us per row.
BW, CALL_S, ROW_S, TRIP_C, TRIP_D = 10e9, 150e-6, 2e-6, 40e-6, 1 / 1e8


def _samples(noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    rows = np.r_[np.ones(200), rng.integers(2, 40, 100)].astype(float)
    a = EB / BW + CALL_S
    t = (a + ROW_S * rows) * (1 + noise * rng.standard_normal(len(rows)))
    tb = rng.integers(512, 40_000, 80).astype(float)
    return {"rows": rows, "seconds": t, "trip_bytes": tb, "trip_seconds": TRIP_C + TRIP_D * tb}


def _fit(**kw):
    s = _samples(**kw)
    return fit_cpu_block(s["rows"], s["seconds"], s["trip_bytes"], s["trip_seconds"],
                         read_bytes_per_s=BW, hidden_size=H, intermediate_size=INTER,
                         expert_bytes=EB)


def test_fit_recovers_the_machine_and_names_sources() -> None:
    """Exact samples: F = 6 H I / 2 us, t_call = 150 us, hidden latency 20 us each way,
    the measured bandwidth, efficiency 1 for the format; every number has a source."""
    cpu, q = _fit()
    assert cpu.tflops == pytest.approx(6 * H * INTER / ROW_S / 1e12)
    assert cpu.call_overhead_us == pytest.approx(CALL_S * 1e6)
    assert cpu.hidden_latency_us == pytest.approx(TRIP_C / 2 * 1e6)
    assert cpu.dram_gbps == pytest.approx(BW / 1e9) and cpu.efficiency_of("dense") == 1.0
    assert q["intercept_us"] == pytest.approx((EB / BW + CALL_S) * 1e6)
    assert q["per_row_us"] == pytest.approx(ROW_S * 1e6)
    srcs = dict(cpu.source)
    assert all(k in srcs for k in ("dram_gbps", "tflops", "call_overhead_us",
                                   "hidden_latency_us", "efficiency.dense"))


def test_noisy_fit_is_close() -> None:
    cpu, q = _fit(noise=0.05, seed=3)
    assert cpu.call_overhead_us == pytest.approx(CALL_S * 1e6, rel=0.05)
    assert q["r2"] > 0.8


def test_block_travels_with_the_calibrated_profile(tmp_path) -> None:
    """Stored, reloaded, written as a hardware YAML with its cpu: block, and priced by the
    calibrated cost model: cpu_expert_s(1) = max(B/BW, 6HI/F) + t_call = the fit at 1 row
    (bandwidth-bound here); a profile stored without a block still loads (no CPU)."""
    cpu, q = _fit()
    base = dict(num_layers=L, hidden_size=H, intermediate_size=INTER, expert_bytes=EB,
                layer_s=300e-6, dense_token_s=0.0, dense_ctx_s=0.0, expert_s=40e-6,
                expert_token_s=1e-6, prefill_pass_s=1e-3, prefill_token_s=0.0,
                decode_pass_s=1e-3, copy_latency_s=80e-6, copy_bytes_per_s=50e6,
                member_s=0.0, member_kv_s=0.0)
    p = CalibratedProfile(**base, cpu=cpu.to_mapping(), fit={"cpu": q})
    p.save(tmp_path / "c.json")
    assert CalibratedProfile.load(tmp_path / "c.json") == p
    cm = load_cost_model(tmp_path / "c.json", DIMS)
    assert isinstance(cm, CalibratedCostModel)
    assert cm.cpu_expert_s(1) == pytest.approx(max(EB / BW, ROW_S) + CALL_S)
    assert cm.hidden_transfer_s(1) == pytest.approx(2 * (TRIP_C / 2 + H * 4 / 50e6))  # fp32
    path = p.write_hardware_yaml(tmp_path / "conf")
    hp = load_profile("calibrated", conf_dir=path.parent)
    assert hp == p.hardware_profile() and hp.cpu == cpu
    old = CalibratedProfile(**base)
    old.save(tmp_path / "old.json")
    assert load_cost_model(tmp_path / "old.json", DIMS).profile.cpu is None


def test_too_few_or_flat_samples_are_refused() -> None:
    s = _samples()
    kw = dict(read_bytes_per_s=BW, hidden_size=H, intermediate_size=INTER, expert_bytes=EB)
    with pytest.raises(ConfigError, match="row count"):
        fit_cpu_block([1, 1, 1, 1], [1e-4] * 4, s["trip_bytes"], s["trip_seconds"], **kw)
    cpu, q = fit_cpu_block([1, 2, 3, 4], [1e-4] * 4, s["trip_bytes"], s["trip_seconds"], **kw)
    assert cpu.tflops == pytest.approx(6 * H * INTER / MIN_ROW_S / 1e12)  # compute never binds
    assert q["per_row_us"] == 0 and cpu.call_overhead_us == pytest.approx(1e-4 * 1e6 - EB / BW * 1e6)
    with pytest.raises(ConfigError, match="bandwidth"):
        fit_cpu_block(s["rows"], s["seconds"], s["trip_bytes"], s["trip_seconds"],
                      **{**kw, "read_bytes_per_s": 0.0})
