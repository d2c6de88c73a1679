"""The Hydra app end to end on a small setting: single runs, multiruns, errors before work."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from tests.integration.conftest import check_two_cache_summary

from moeexp.tracking.run_dir import read_series


def _ok(out) -> None:
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def test_single_run_writes_results_and_wandb(tmp_path, small, run_app):
    """One run: .hydra/, metrics.json (strings for the run's identity), series, env.json,
    the log, and W&B offline files + wandb_logged.json with group 'adhoc' and our tags."""
    run = tmp_path / "run"
    out = run_app(*small, f"hydra.run.dir={run}", "logger=wandb")
    _ok(out)
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "moeexp.log").is_file()
    m = json.loads((run / "metrics.json").read_text())
    assert (m["system"], m["predictor"], m["cache"], m["dataset"]) == \
        ("deepspeed", "none", "lru", "sharegpt")
    assert 0.0 <= m["hit_rate"] <= 1.0 and m["requests_test"] == 2 and m["requests_store"] == 4
    assert m["ttft_norm_mean"] >= 1.0 and m["h2d_bytes_total"] > 0
    series = read_series(run)
    assert len(series["ttft_ms"]) == 2
    env = json.loads((run / "env.json").read_text())
    assert len(env["git"]["sha"]) == 40 and env["hardware_profile"]["name"] == "rtx3090_pcie4"
    logged = json.loads((run / "wandb_logged.json").read_text())
    assert logged["group"] == "adhoc" and "system:deepspeed" in logged["tags"]
    assert logged["config"]["cache"]["capacity"] == 0.25
    assert logged["metrics"]["hit_rate"] == m["hit_rate"] and logged["finished"]
    assert list((run / "wandb").glob("offline-run-*"))


def test_multirun_summary(tmp_path, small, run_app):
    """--multirun over two caches (the basic launcher; the joblib one:
    ``test_launchers.test_shared_trace_cache_and_resume``): one job dir each and summary.csv
    with one row per job, the swept key as a column; the comparison table is printed;
    logger=none: no W&B files."""
    sweep = tmp_path / "sweep"
    out = run_app("--multirun", "cache=lru,lfu", *small, f"hydra.sweep.dir={sweep}", "logger=none")
    _ok(out)
    check_two_cache_summary(sweep, out.stdout)


def test_config_error_before_any_work(tmp_path, model_overrides, run_app):
    """A misspelled key exits with status 2 and one clear line, before the model is loaded
    or a trace recorded: no trace directory, no metrics."""
    run, traces = tmp_path / "run", tmp_path / "traces"
    out = run_app(*model_overrides, "+cache.capacty=0.5", f"trace.cache_dir={traces}",
                  f"hydra.run.dir={run}", "logger=none")
    assert out.returncode == 2
    assert "ConfigError: cache=lru: unknown key(s) 'capacty' (did you mean 'capacity'?)" \
        in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert not traces.exists() and not (run / "metrics.json").exists()
    assert "loading model" not in (run / "moeexp.log").read_text()


def test_capacity_error_before_the_weights_load(tmp_path, model_overrides, run_app):
    """A capacity below K experts depends on the model's dims: the pre-load probe (config
    on the meta device) catches it before any weight is read or trace recorded."""
    run, traces = tmp_path / "run", tmp_path / "traces"
    out = run_app(*model_overrides, "cache.capacity=0.01", f"trace.cache_dir={traces}",
                  f"hydra.run.dir={run}", "logger=none")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ConfigError" in out.stdout + out.stderr and "capacity" in out.stdout + out.stderr
    assert not traces.exists() and not (run / "metrics.json").exists()
    assert "loading model" not in (run / "moeexp.log").read_text()


def test_collect_command(tmp_path, small, run_app):
    """`moeexp collect DIR` (via python -m moeexp.tracking.collect) gathers the runs of a sweep."""
    import subprocess
    import sys

    from moeexp.paths import REPO_DIR

    sweep = tmp_path / "sweep"
    _ok(run_app("--multirun", "hardware=rtx3090_pcie4,a100_80g_pcie4", *small,
                f"hydra.sweep.dir={sweep}",
                "logger=none"))
    out = subprocess.run([sys.executable, "-m", "moeexp.tracking.collect", str(sweep)], cwd=REPO_DIR,
                         capture_output=True, text=True, timeout=120)
    _ok(out)
    df = pd.read_csv(Path(sweep) / "collected.csv")
    assert sorted(df["hardware"]) == ["a100_80g_pcie4", "rtx3090_pcie4"]
