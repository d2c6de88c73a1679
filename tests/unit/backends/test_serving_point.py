"""backend=sim_vs_engine in serving mode (moeexp.backends.serving_point): the engine is
profiled once, the fit stored and reused only when it matches, and each system serves the
same requests with continuous batching on both backends at the rescaled arrival rate."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pandas as pd
import pytest
from tests.unit.engine.test_continuous import serving_case

from moeexp.backends import BACKENDS, BackendContext
from moeexp.backends.serving_point import served_rate, unloaded_e2e_s
from moeexp.costmodel import CostModel
from moeexp.errors import ConfigError
from moeexp.registry import GroupChoice

#: a small profile (4 store requests, 8 tokens generated, 1 and 64 experts copied 3 times each
#: through a 100 MB/s link: 0.2 ms against 12 ms, far above the shared CPU's noise; passes of
#: 1, 2 and 4 members once, 3 decode steps each, for the members term)
PROFILE = {"profile_requests": 4, "decode_tokens": 8, "copy_repeats": 3,
           "copy_factors": [1.0, 64.0], "warmup": 0, "progress": False, "num_threads": 1,
           "bandwidth_bps": 1e8,
           "pass_profile": {"batch_sizes": [1, 2, 4], "steps": 3, "repeats": 1}}


@pytest.fixture(scope="module")
def setup(store_of):  # type: ignore[no-untyped-def]
    return serving_case(store_of("mixtral"))


def _ctx(setup, run_dir) -> BackendContext:  # type: ignore[no-untyped-def]
    loaded, prompts, trace, store, cost = setup
    return BackendContext(loaded=loaded, prompts=prompts, trace=trace, predictor=None,
                          cache=None, cost=cost, seed=0, store=store, run_dir=run_dir,
                          scheduler=GroupChoice("static", {}))


def test_offline_deepspeed_matches_and_the_fit_is_reused(setup, tmp_path, caplog) -> None:
    """deepspeed and no_offload under fcfs, offline, 4 of the 5 test requests: same
    admission, passes and per-pass hits on both backends (the operating point runs the
    very passes of the unit check), finite errors, the rows in summary.csv and metrics.
    The second job finds the stored fit and reuses it; a stored file whose recorded
    inputs differ (another thread count) is detected and the engine profiled again."""
    store_dir = tmp_path / "calibrations"
    kw = {**PROFILE, "calibration_dir": str(store_dir), "test_requests": 4,
          "systems": [{"name": "deepspeed", "system": "deepspeed", "scheduler": "fcfs"},
                      {"name": "no_offload", "system": "no_offload", "scheduler": "fcfs"}],
          "serving": {"max_batch_tokens": 64, "max_running": 3}}
    backend = BACKENDS.build("sim_vs_engine", **kw)
    res = backend.run(_ctx(setup, tmp_path / "a"))
    m = res.metrics
    assert m["calibration_reused"] == 0.0 and m["mode"] == "serving"
    for system in ("deepspeed", "no_offload"):
        for key in ("admission_match", "passes_match", "pass_hits_match"):
            assert m[f"{system}_{key}"] == 1.0, (system, key)
        assert m[f"{system}_test_requests"] == 4.0
        for key in ("ttft_mean_err_pct", "tpot_mean_err_pct", "e2e_mean_err_pct", "e2e_mape_pct"):
            assert math.isfinite(m[f"{system}_{key}"]), key
        assert 0.0 <= m[f"{system}_engine_slo_attainment"] <= 1.0
    assert m["deepspeed_sim_hit_rate"] == m["deepspeed_engine_hit_rate"] < 1.0
    df = pd.read_csv(tmp_path / "a" / "summary.csv")
    assert list(df["system"]) == ["deepspeed", "no_offload"]
    assert list(df["scheduler"]) == ["fcfs", "fcfs"]
    assert len(pd.read_csv(tmp_path / "a" / "requests.csv")) == 8
    stored = list(store_dir.glob("*.json"))
    assert len(stored) == 1 and stored[0].stem == m["calibration_key"]

    again = BACKENDS.build("sim_vs_engine", **kw).run(_ctx(setup, tmp_path / "b")).metrics
    assert again["calibration_reused"] == 1.0
    assert again["calib_layer_us"] == m["calib_layer_us"]

    data = json.loads(stored[0].read_text())
    data["meta"]["calibration_inputs"]["torch_threads"] = 99  # fitted on another setup
    stored[0].write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="moeexp.backends.sim_vs_engine"):
        third = BACKENDS.build("sim_vs_engine", **kw).run(_ctx(setup, tmp_path / "c")).metrics
    assert third["calibration_reused"] == 0.0
    assert "differ: torch_threads" in caplog.text
    fresh = json.loads(stored[0].read_text())["meta"]["calibration_inputs"]
    assert fresh["torch_threads"] == 1  # replaced by the new fit


def test_rate_is_rescaled_by_the_unloaded_latencies(setup) -> None:
    """served rate = the hardware profile's rate x U_hw / U_cal (same load: a slower cost
    model lowers the rate by its latency ratio); rescale_rate=false keeps it."""
    _, _, trace, _, cost = setup
    prof = cost.profile
    slow = CostModel.from_profile(dataclasses.replace(
        prof, name="slow", dense_overhead_us=prof.dense_overhead_us * 3,
        expert_overhead_us=prof.expert_overhead_us * 3), trace.dims)
    u_hw, u_slow = unloaded_e2e_s(trace, cost), unloaded_e2e_s(trace, slow)
    assert u_slow > u_hw > 0

    class S:
        arrival_rate, rescale_rate = 100.0, True

    rate, info = served_rate(S, trace, cost, slow)
    assert rate == pytest.approx(100.0 * u_hw / u_slow)
    assert info["unloaded_e2e_ms_calibrated"] == pytest.approx(u_slow * 1e3)
    S.rescale_rate = False
    assert served_rate(S, trace, cost, slow)[0] == 100.0


def test_serving_mode_refuses_bad_settings() -> None:
    """A scheduler in a systems entry needs serving mode and a known scheduler; the rate
    and the request count must be positive (before any work)."""
    ok = {"systems": [{"name": "d", "system": "deepspeed", "scheduler": "fcfs"}]}
    with pytest.raises(ConfigError, match="needs backend.serving"):
        BACKENDS.build("sim_vs_engine", **ok)
    with pytest.raises(ConfigError, match="scheduler is one of"):
        BACKENDS.build("sim_vs_engine", serving={},
                       systems=[{"name": "d", "system": "deepspeed", "scheduler": "lifo"}])
    with pytest.raises(ConfigError, match="arrival_rate must be > 0"):
        BACKENDS.build("sim_vs_engine", **ok, serving={}, arrival_rate=0)
    with pytest.raises(ConfigError, match="test_requests must be >= 1"):
        BACKENDS.build("sim_vs_engine", **ok, serving={}, test_requests=0)
    with pytest.raises(ConfigError, match="backend.serving"):
        BACKENDS.build("sim_vs_engine", **ok, serving={"max_running": 0})


def test_a_stored_fit_without_the_member_term_is_profiled_again(tmp_path, caplog) -> None:
    """A calibration_dir file of format 1 (written before member_s) under the very key and
    inputs of the job is not used: the job is told why (its format, the missing term) and
    profiles again; the same file in format 2 is reused."""
    from moeexp.backends.sim_vs_engine import _stored_calibration
    from moeexp.costmodel.fitted import CalibratedProfile

    inputs = {"version": 2, "model": "t"}
    prof = CalibratedProfile(
        num_layers=2, hidden_size=8, intermediate_size=16, expert_bytes=1536, layer_s=1e-4,
        dense_token_s=0.0, dense_ctx_s=0.0, expert_s=1e-5, expert_token_s=0.0,
        prefill_pass_s=1e-3, prefill_token_s=0.0, decode_pass_s=1e-3, copy_latency_s=0.0,
        copy_bytes_per_s=1e8, member_s=5e-4, member_kv_s=1e-6,
        meta={"calibration_key": "k", "calibration_inputs": inputs})
    path = prof.save(tmp_path / "k.json")
    assert _stored_calibration(path, "k", inputs) == prof
    data = json.loads(path.read_text())
    del data["member_s"], data["member_kv_s"], data["format_version"]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="moeexp.backends.sim_vs_engine"):
        assert _stored_calibration(path, "k", inputs) is None
    assert "profiling again" in caplog.text and "format 1" in caplog.text
    assert "member_s" in caplog.text
