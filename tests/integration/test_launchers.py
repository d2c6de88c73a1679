"""Sweeps beyond the basic launcher: submitit_local, joblib with a shared trace cache, resume.

``hydra/launcher=slurm`` cannot run here (no cluster); its config is composed and checked,
and the same submitit code path runs through ``submitit_local``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moeexp.paths import CONF_DIR


def _ok(out) -> None:
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def _log(job: Path) -> str:
    return (job / "moeexp.log").read_text()


def test_slurm_and_local_launcher_configs():
    """hydra/launcher=slurm is submitit's SlurmLauncher with the documented keys;
    hydra/launcher=local is joblib with 2 processes."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        slurm = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True)
        local = compose("config", ["hydra/launcher=local"], return_hydra_config=True)
    sl = slurm.hydra.launcher
    assert sl._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (sl.partition, sl.gpus_per_node, sl.timeout_min, sl.mem_gb, sl.cpus_per_task) == \
        (None, 1, 240, 64, 8)
    assert local.hydra.launcher._target_.endswith("joblib_launcher.JoblibLauncher")
    assert local.hydra.launcher.n_jobs == 2


@pytest.mark.slow
def test_submitit_local_sweep(tmp_path, small, run_app):
    """Two jobs through submitit (the SLURM code path, run locally): both write
    metrics.json, and summary.csv has one row per job."""
    sweep = tmp_path / "sweep"
    out = run_app("--multirun", "cache=lru,lfu", *small, f"hydra.sweep.dir={sweep}",
                  "logger=none", "hydra/launcher=submitit_local",
                  "hydra.launcher.timeout_min=10")
    _ok(out)
    df = pd.read_csv(sweep / "summary.csv")
    assert sorted(df["cache"]) == ["lfu", "lru"]
    assert all((sweep / r / "metrics.json").is_file() for r in df["run"])
    assert list((sweep / ".submitit").iterdir())  # submitit's own job folders


@pytest.mark.slow
def test_shared_trace_cache_and_resume(tmp_path, model_overrides, run_app):
    """Two concurrent joblib jobs want the same trace in an empty cache: exactly one logs
    'recording trace', the other 'reusing trace' (it waited on the lock), and the cache
    holds one trace. Rerunning the sweep in the same (fixed) directory after deleting job
    1's metrics.json: job 0 is skipped ('skipping: complete with the same config', its
    metrics.json untouched), job 1 (a listed output missing) runs again with the same
    result, summary.csv still has both rows."""
    from tests.integration.conftest import SMALL, check_two_cache_summary

    sweep, traces = tmp_path / "sweep", tmp_path / "traces"
    args = ["--multirun", "cache=lru,lfu", *model_overrides, *SMALL,
            f"trace.cache_dir={traces}", f"hydra.sweep.dir={sweep}", "logger=none"]
    out = run_app(*args, "hydra/launcher=local")
    _ok(out)
    jobs = [sweep / "0_deepspeed", sweep / "1_deepspeed+cache=lfu"]
    check_two_cache_summary(sweep, out.stdout)  # the joblib launcher's summary
    logs = [_log(j) for j in jobs]
    assert sum("recording trace" in t for t in logs) == 1
    assert sum("reusing trace" in t for t in logs) == 1
    assert len(list(traces.glob("*.npz"))) == 1
    first = json.loads((jobs[1] / "metrics.json").read_text())
    stamp = (jobs[0] / "metrics.json").stat().st_mtime_ns
    assert "skipping" not in logs[0]

    (jobs[1] / "metrics.json").unlink()
    _ok(run_app(*args))  # basic launcher, resume=true (the default)
    assert "skipping: complete with the same config" in _log(jobs[0])
    assert (jobs[0] / "metrics.json").stat().st_mtime_ns == stamp
    assert "skipping" not in _log(jobs[1])
    again = json.loads((jobs[1] / "metrics.json").read_text())
    assert again["hit_rate"] == first["hit_rate"] and again["cache"] == "lfu"
    assert len(pd.read_csv(sweep / "summary.csv")) == 2


def test_resume_false_reruns(tmp_path, monkeypatch, caplog):
    """In process: with a complete job (metrics.json, env.json, series and done.json with
    the same config) present, run() returns its metrics without loading the model (resume
    defaults to true); with resume=false it goes on to load the model (here a sentinel
    error proves it)."""
    import logging

    from hydra import compose, initialize_config_dir

    from moeexp import pipeline
    from moeexp.tracking.run_dir import write_done, write_env, write_metrics, write_series

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", ["logger=none"])
        cfg_force = compose("config", ["logger=none", "resume=false"])
    write_metrics(tmp_path, {"hit_rate": 0.125, "system": "deepspeed"})
    write_series(tmp_path, {})
    write_env(tmp_path, {})
    write_done(tmp_path, pipeline._resolved(cfg),
               outputs=["metrics.json", "series.parquet", "env.json"])

    def boom(_cfg):
        raise RuntimeError("model loaded")

    monkeypatch.setattr("moeexp.models.loading.load_model", boom)
    with caplog.at_level(logging.INFO, logger="moeexp.pipeline"):
        assert pipeline.run(cfg, run_dir=tmp_path) == {"hit_rate": 0.125, "system": "deepspeed"}
    assert "skipping: complete with the same config" in caplog.text
    with pytest.raises(RuntimeError, match="model loaded"):
        pipeline.run(cfg_force, run_dir=tmp_path)
