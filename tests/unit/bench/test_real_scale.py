"""The real-scale GPU script's CPU dry run (the same code path at a reduced size)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from moeexp.bench import real_scale
from moeexp.errors import ConfigError


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_scale")
    assert real_scale.main(["--dry-run", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_dry_run_writes_one_folder_labelled_not_exact(dry) -> None:
    """results.json, systems.csv and summary.md; the run says it replayed routing (not
    exact), ran on the CPU at reduced size, and started each decode-only request with its
    prompt's length in the KV cache."""
    out, res = dry
    assert {p.name for p in out.iterdir()} == {"results.json", "systems.csv", "summary.md",
                                               "calibration.json"}
    assert res["routing_source"] == "replay" and res["exact"] is False
    assert res["replay_prompt_in_kv"] is True
    assert res["settings"]["dry_run"] is True and res["settings"]["device"] == "cpu"
    assert res["model"]["num_moe_layers"] == 24 and res["model"]["num_experts"] == 32
    assert (out / "summary.md").read_text().startswith("# real_scale: CPU dry run")
    assert len(pd.read_csv(out / "systems.csv")) == len(res["systems"])


def test_dry_run_rows(dry) -> None:
    """Every system at every capacity (no_offload once); mixtral_offloading is not
    applicable (no speculative gates), finemoe runs without its semantic search; the
    timing-free deepspeed has the simulator's hit rate and bytes; no_offload moves no
    byte and always hits."""
    _, res = dry
    rows = {(r["system"], r["capacity"]): r for r in res["systems"]}
    assert len(rows) == 1 + 6 * 3
    for cap in real_scale.CAPACITIES:
        na = rows[("mixtral_offloading", cap)]
        assert na["status"] == "not_applicable" and "speculative" in na["reason"]
        assert rows[("finemoe_no_semantic", cap)]["status"] == "ok"
        ds = rows[("deepspeed", cap)]
        assert ds["engine_hit_rate"] == ds["sim_hit_rate"]
        assert ds["engine_h2d_bytes_total"] == ds["sim_h2d_bytes_total"] > 0
        for system in ("deepspeed", "moe_infinity", "finemoe_no_semantic", "prefetch_if_pays",
                       "oracle"):
            r = rows[(system, cap)]
            assert np.isfinite(r["engine_tpot_ms_mean"]) and np.isfinite(r["tpot_error_pct"])
            parts = (r["engine_stall_demand_ms_total"] + r["engine_stall_late_prefetch_ms_total"]
                     + r["engine_stall_link_ms_total"])
            assert parts == pytest.approx(r["engine_stall_ms_total"], rel=1e-6, abs=1e-9)
        # issue 27's policy is handed the calibrated cost model and its decisions are timed
        assert rows[("prefetch_if_pays", cap)]["engine_predictor_query_us_mean"] > 0
        assert rows[("prefetch_if_pays", cap)]["engine_prefetches_issued"] > 0
    ref = rows[("no_offload", 1.0)]
    assert ref["engine_hit_rate"] == 1.0 and ref["engine_h2d_bytes_total"] == 0.0
    assert res["h2d"]["h2d_engine_gbps"] > 0 and res["h2d"]["h2d_plain_gbps"] > 0
    assert res["overhead"]["engine_over_plain"] > 0
    assert np.isfinite(res["tpot_error_pct_mean"])


def test_truncate_keeps_the_first_passes() -> None:
    """truncate: the first n requests, each cut to its first passes, output_len updated."""
    from moeexp.paths import load_group_yaml
    from moeexp.traces.importers import load_imported

    arch = load_group_yaml("model", "gpt_oss_20b")["arch"]
    trace = load_imported("gpt_oss_20b", arch, model="gpt_oss_20b").split("test")
    cut = real_scale.truncate(trace, 3, 5)
    cut.validate()
    assert [r.request_id for r in cut.requests] == [r.request_id for r in trace.requests[:3]]
    assert cut.num_iterations == 15 and all(r.output_len == 5 for r in cut.requests)
    first = trace.request_iterations(trace.requests[0].request_id)[:5]
    rows = np.concatenate([np.arange(trace.iter_offsets[i], trace.iter_offsets[i + 1])
                           for i in first])
    assert np.array_equal(cut.topk_idx[:5], trace.topk_idx[rows])


def test_failed_calibration_keeps_the_engine_numbers(tmp_path, monkeypatch) -> None:
    """A calibration that cannot be fitted skips the simulator (NaN columns, the reason in
    results.json) instead of losing the engine's measurements."""
    import dataclasses

    from moeexp.errors import ConfigError

    def fail(*args, **kwargs):
        raise ConfigError("fit_profile: copy time does not grow with bytes")

    monkeypatch.setattr(real_scale, "_calibrate", fail)
    s = dataclasses.replace(real_scale.Settings.dry(tmp_path), systems=("deepspeed",),
                            capacities=(0.5,))
    res = real_scale.run_real_scale(s)
    assert "copy time" in res["calibration"]["error"]
    (row,) = res["systems"]
    assert row["status"] == "ok" and row["engine_h2d_bytes_total"] > 0
    assert np.isnan(row["sim_tpot_ms_mean"]) and np.isnan(row["tpot_error_pct"])
    assert np.isnan(res["tpot_error_pct_mean"])
    assert (tmp_path / "summary.md").is_file()


def test_flags_pick_systems_and_capacities(tmp_path) -> None:
    """--systems and --capacities narrow the run; a misspelled system or a capacity out of
    (0, 1] is refused, naming what is valid."""
    out = tmp_path / "one"
    assert real_scale.main(["--dry-run", "--out", str(out), "--systems", "deepspeed",
                            "--capacities", "0.5", "--max-wall-s", "300",
                            "--profile", "oracle:0.25", "--predictor-inline"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["system"], r["capacity"]) for r in res["systems"]] == [("deepspeed", 0.5)]
    assert res["settings"]["max_wall_s"] == 300
    assert res["settings"]["predictor_async"] is False  # --predictor-inline
    # --profile: the oracle's engine run again under torch.profiler, a table and a trace
    pr = res["profile"]
    assert (pr["system"], pr["capacity"], pr["passes"]) == ("oracle", 0.25, 4)
    assert pr["tpot_ms"] > 0
    assert "Self CPU" in (out / "profile_oracle_0.25.txt").read_text()
    assert json.loads((out / "profile_oracle_0.25.json").read_text())["traceEvents"]
    assert "profile: oracle at 0.25" in (out / "summary.md").read_text()
    with pytest.raises(ConfigError, match="SYSTEM:CAPACITY"):
        real_scale.main(["--dry-run", "--out", str(tmp_path / "x"), "--profile", "oracle"])
    with pytest.raises(ConfigError, match="valid: .*prefetch_if_pays"):
        real_scale.main(["--dry-run", "--out", str(tmp_path / "x"), "--systems", "lru_typo"])
    for bad in ("0", "1.5", "a,b", ""):
        with pytest.raises(ConfigError, match="fractions of expert memory"):
            real_scale.main(["--dry-run", "--out", str(tmp_path / "x"), "--capacities", bad])
    assert not (tmp_path / "x").exists()


def test_a_saved_calibration_is_reused_and_checked(dry, tmp_path) -> None:
    """--calibration reuses an earlier run's calibration.json (no profiling in this
    process: the same fitted coefficients); one of another model is refused, naming the
    mismatch, before anything runs."""
    out, res = dry
    again = tmp_path / "again"
    assert real_scale.main(["--dry-run", "--out", str(again), "--systems", "deepspeed",
                            "--capacities", "0.5", "--calibration",
                            str(out / "calibration.json")]) == 0
    res2 = json.loads((again / "results.json").read_text())
    assert res2["calibration"]["calib_file"] == str(out / "calibration.json")
    for k, v in res["calibration"].items():
        assert res2["calibration"][k] == v
    assert not (again / "calibration.json").exists()
    assert np.isfinite(res2["systems"][0]["sim_tpot_ms_mean"])
    other = json.loads((out / "calibration.json").read_text())
    other["hidden_size"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="hidden_size 65 there, 64 here"):
        real_scale.main(["--dry-run", "--out", str(tmp_path / "x"), "--calibration",
                         str(tmp_path / "other.json")])
    assert not (tmp_path / "x").exists()


def test_feed_measures_the_predictor_hand_off_and_simulates_with_it(tmp_path) -> None:
    """--feed: the predictor's feeding cost measured on the engine with every expert
    resident (>= 0 µs per layer), the simulator run again with it charged per layer (its
    TPOT no lower than without), reported in systems.csv and summary.md; a system without a
    predictor has none."""
    out = tmp_path / "feed"
    assert real_scale.main(["--dry-run", "--out", str(out), "--systems",
                            "deepspeed,oracle,prefetch_if_pays", "--capacities", "0.5",
                            "--passes", "2", "--feed"]) == 0
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())["systems"]}
    assert np.isnan(rows["deepspeed"]["feed_us_per_layer"])
    o = rows["oracle"]
    assert np.isfinite(o["feed_us_per_layer"]) and o["feed_us_per_layer"] >= 0
    assert o["sim_feed_tpot_ms_mean"] >= o["sim_tpot_ms_mean"] - 1e-9
    assert np.isfinite(o["tpot_error_feed_pct"])
    assert "engine_gated_tpot_ms_mean" not in o  # the oracle does not weigh its feed
    table = (out / "summary.md").read_text().split("--feed:")[1]
    assert "| oracle | 0.500 |" in table
    # prefetch_if_pays weighs its feed: served again told it (where a feed was measured)
    p = rows["prefetch_if_pays"]
    gated = "engine_gated_tpot_ms_mean" in p
    assert gated == (p["feed_us_per_layer"] > 0)
    if gated:
        assert np.isfinite(p["engine_gated_tpot_ms_mean"])
        assert 0.0 <= p["engine_gated_rested_share"] <= 1.0
        assert "| prefetch_if_pays | 0.500 |" in table
