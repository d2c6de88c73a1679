"""Loggers: W&B offline writes its local run and our own record; ``none`` writes nothing."""

from __future__ import annotations

import json

import pytest

from moeexp.errors import ConfigError
from moeexp.tracking.loggers import LOGGED_FILE, LOGGERS, Logger, WandbLogger


def test_none_logger_writes_nothing(tmp_path):
    lg = LOGGERS.build("none")
    assert type(lg) is Logger
    lg.start(tmp_path, config={"a": 1}, group="g", name="n", tags=["t"])
    lg.log_metrics({"hit_rate": 0.5})
    lg.finish()
    assert list(tmp_path.iterdir()) == []


def test_wandb_misspelled_key_and_bad_mode():
    with pytest.raises(ConfigError, match="projct.*did you mean 'project'"):
        LOGGERS.build("wandb", projct="x")
    with pytest.raises(ConfigError, match="mode='onlin'.*online, offline, disabled"):
        WandbLogger(mode="onlin")


def test_wandb_mode_defaults_to_env_then_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbLogger().mode == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert WandbLogger().mode == "offline"


def test_wandb_offline_run_writes_local_files(tmp_path, monkeypatch):
    """An offline run creates wandb/offline-run-*/ under the run dir, and wandb_logged.json
    holds exactly the config, metrics, group and tags we logged."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    lg = LOGGERS.build("wandb", project="moeexp", tags=["extra"])
    config = {"model": {"name": "tiny"}, "cache": {"name": "lru", "capacity": 0.25}}
    lg.start(tmp_path, config=config, group="finemoe_vs_moeinfinity", name="deepspeed-0",
             tags=["model:tiny", "system:deepspeed"])
    lg.log_metrics({"hit_rate": 0.25, "prediction_f1": float("nan"), "system": "deepspeed"})
    lg.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    rec = json.loads((tmp_path / LOGGED_FILE).read_text())
    assert rec["mode"] == "offline" and rec["project"] == "moeexp" and rec["finished"] is True
    assert rec["group"] == "finemoe_vs_moeinfinity"
    assert rec["tags"] == ["model:tiny", "system:deepspeed", "extra"]
    assert rec["config"] == config
    assert rec["metrics"] == {"hit_rate": 0.25, "prediction_f1": None, "system": "deepspeed"}
    assert rec["run_id"] and runs[0].name.endswith(rec["run_id"])


def test_wandb_config_carries_the_runs_env_not_the_whole_pip_list(tmp_path, monkeypatch):
    """The run's env.json (python, git, the packages that shape results) goes into the W&B
    config's ``env``; W&B's own list of every installed distribution is not collected
    (~0.2 s per run); our own record's config stays exactly what was logged."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    env = {"python": "3.11.7", "git": {"commit": "abc"}, "packages": {"torch": "2.13.0"},
           "hardware": {"cpu_count": 2}}
    (tmp_path / "env.json").write_text(json.dumps(env))
    lg = LOGGERS.build("wandb", project="moeexp")
    lg.start(tmp_path, config={"a": 1}, group="g", name="n", tags=[])
    assert dict(lg._run.config)["env"] == {k: env[k] for k in ("python", "git", "packages")}
    assert lg._run.settings.x_save_requirements is False
    lg.finish()
    assert json.loads((tmp_path / LOGGED_FILE).read_text())["config"] == {"a": 1}


def test_a_rerun_after_a_kill_leaves_one_offline_run_under_the_same_id(tmp_path, monkeypatch):
    """A process starts the job's W&B run and is SIGKILLed (no finish); the rerun in the same
    directory removes the dead offline run and logs under its id: one offline-run-* remains
    (before: two under the same name, the dead one without metrics, both synced)."""
    import os
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("WANDB_MODE", "offline")
    code = ("import os, signal, sys\n"
            "from moeexp.tracking.loggers import WandbLogger\n"
            "lg = WandbLogger()\n"
            "lg.start(sys.argv[1], config={'a': 1}, group='g', name='n', tags=[])\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    # its own W&B service, as a separate job process has (not this process's, if started)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    dead = json.loads((tmp_path / LOGGED_FILE).read_text())["run_id"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    lg = WandbLogger()
    lg.start(tmp_path, config={"a": 1}, group="g", name="n", tags=[])
    lg.log_metrics({"hit_rate": 0.5})
    lg.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(dead) and lg.run_id == dead
    rec = json.loads((tmp_path / LOGGED_FILE).read_text())
    assert rec["run_id"] == dead and rec["finished"] and rec["metrics"] == {"hit_rate": 0.5}
