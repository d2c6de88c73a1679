"""metrics.json (flat, strict JSON, atomic), series.parquet round trip, env.json contents."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.tracking import run_dir as rd
from moeexp.tracking.env import collect_env, git_info


def test_metrics_round_trip_nan_becomes_null_and_back(tmp_path):
    """NaN/inf are written as null (strict JSON), strings and ints kept; reading gives NaN."""
    m = {"hit_rate": 0.5, "prediction_f1": float("nan"), "x_ms_mean": float("inf"),
         "system": "deepspeed", "requests_test": 3, "np_value": np.float32(0.25)}
    path = rd.write_metrics(tmp_path, m)
    raw = json.loads(path.read_text())  # strict parser: no NaN tokens in the file
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert raw["prediction_f1"] is None and raw["x_ms_mean"] is None
    assert raw["system"] == "deepspeed" and raw["requests_test"] == 3 and raw["np_value"] == 0.25
    back = rd.read_metrics(tmp_path)
    assert back["hit_rate"] == 0.5 and math.isnan(back["prediction_f1"])


def test_metrics_reject_non_scalars(tmp_path):
    """A list is not a flat metric: ConfigError, and nothing is written."""
    with pytest.raises(ConfigError, match="ttft_ms.*not a scalar"):
        rd.write_metrics(tmp_path, {"ttft_ms": [1.0, 2.0]})
    assert not (tmp_path / rd.METRICS_FILE).exists()


def test_metrics_write_is_atomic(tmp_path, monkeypatch):
    """If the final rename fails, the previous metrics.json is intact and no temp file remains."""
    rd.write_metrics(tmp_path, {"hit_rate": 0.1})
    before = (tmp_path / rd.METRICS_FILE).read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        rd.write_metrics(tmp_path, {"hit_rate": 0.9})
    monkeypatch.undo()
    assert (tmp_path / rd.METRICS_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [rd.METRICS_FILE]


def test_series_round_trip_different_lengths(tmp_path):
    """Series of different lengths share one long table and come back unchanged."""
    series = {"ttft_ms": [1.0, 2.5], "iter_hits": [3, 4, 5, 6], "empty": []}
    rd.write_series(tmp_path, series)
    back = rd.read_series(tmp_path)
    np.testing.assert_array_equal(back["ttft_ms"], [1.0, 2.5])
    np.testing.assert_array_equal(back["iter_hits"], [3, 4, 5, 6])
    assert "empty" not in back  # zero rows


def test_series_reject_non_numeric(tmp_path):
    with pytest.raises(ConfigError, match="not numeric"):
        rd.write_series(tmp_path, {"names": ["a", "b"]})


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_git_info_sha_and_dirty_flag(tmp_path):
    """A clean checkout reports its HEAD sha and dirty=False; editing a tracked file -> True;
    an untracked file alone does not count as dirty."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-qm", "c")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "untracked.txt").write_text("x")
    info = git_info(tmp_path)
    assert info["sha"] == sha and len(sha) == 40 and info["dirty"] is False
    (tmp_path / "a.txt").write_text("2")
    assert git_info(tmp_path)["dirty"] is True


def test_git_info_outside_a_checkout(tmp_path):
    assert git_info(tmp_path) == {"sha": None, "dirty": None, "branch": None}


def test_env_json_has_git_versions_hardware(tmp_path):
    """env.json of this repository: 40-hex sha, a boolean dirty flag, versions, the machine."""
    env = collect_env(hardware_profile={"name": "rtx3090_pcie4", "h2d_gbps": 32.0})
    path = rd.write_env(tmp_path, env)
    data = json.loads(path.read_text())
    assert len(data["git"]["sha"]) == 40 and isinstance(data["git"]["dirty"], bool)
    assert data["packages"]["numpy"] == np.__version__ and data["packages"]["hydra-core"]
    assert data["hardware"]["cpu_count"] >= 1 and data["hardware"]["memory_bytes"] > 0
    assert data["hardware_profile"]["name"] == "rtx3090_pcie4"


# ---------------------------------------------------------------------- completion marker
CFG = {"cache": {"name": "lru", "capacity": 0.25}, "trace": {"seed": 0, "progress": True},
       "resume": True}


def _complete(d: Path, config=CFG) -> None:
    rd.write_metrics(d, {"hit_rate": 0.5})
    rd.write_series(d, {})
    rd.write_done(d, config, outputs=[rd.METRICS_FILE, rd.SERIES_FILE])


def test_resume_state_new_complete_changed_incomplete(tmp_path):
    """Empty dir: new. Marker + outputs + same config: complete (progress/resume flags do
    not count). Another capacity: changed, naming 'cache.capacity: 0.25 -> 0.5'. A listed
    output missing, or metrics.json without a marker: incomplete."""
    assert rd.resume_state(tmp_path, CFG).status == "new"
    _complete(tmp_path)
    assert rd.resume_state(tmp_path, CFG).status == "complete"
    quiet = {**CFG, "resume": False, "trace": {"seed": 0, "progress": False}}
    assert rd.resume_state(tmp_path, quiet).status == "complete"
    other = {**CFG, "cache": {"name": "lru", "capacity": 0.5}}
    st = rd.resume_state(tmp_path, other)
    assert st.status == "changed" and st.changes == ["cache.capacity: 0.25 -> 0.5"]
    added = {**CFG, "trace": {"seed": 0, "top_k": 5}}
    assert rd.resume_state(tmp_path, added).changes == ["trace.top_k: '<absent>' -> 5"]
    (tmp_path / rd.SERIES_FILE).unlink()
    st = rd.resume_state(tmp_path, CFG)
    assert st.status == "incomplete" and "series.parquet missing" in st.reason
    rd.clear_done(tmp_path)
    st = rd.resume_state(tmp_path, CFG)
    assert st.status == "incomplete" and "metrics.json without done.json" in st.reason
    assert not rd.is_complete(tmp_path)


def test_done_marker_is_strict_json_with_the_config_and_outputs(tmp_path):
    _complete(tmp_path)
    done = json.loads((tmp_path / rd.DONE_FILE).read_text())
    assert done["outputs"] == ["metrics.json", "series.parquet"]
    assert done["config"] == {"cache": {"name": "lru", "capacity": 0.25}, "trace": {"seed": 0}}
    assert done["wandb_run_id"] is None and done["finished_utc"].endswith("Z")
    (tmp_path / rd.DONE_FILE).write_text("{trunc")  # unreadable: incomplete, not a crash
    assert rd.resume_state(tmp_path, CFG).status == "incomplete"


# ---------------------------------------------------------------------- storage errors
def test_full_disk_names_the_file_and_keeps_the_old_one(tmp_path):
    """Over a file-size limit (RLIMIT_FSIZE, what `ulimit -f` sets; errno EFBIG, the
    issue's 'OSError: File too large'): a StorageError naming metrics.json and saying why;
    the old metrics.json is intact and no temporary file is left. The same for a trace."""
    import resource

    from moeexp.errors import StorageError
    from moeexp.traces import io as trace_io
    from moeexp.traces.synthetic import random_trace

    rd.write_metrics(tmp_path, {"hit_rate": 0.5})
    before = (tmp_path / rd.METRICS_FILE).read_text()
    big = {f"x{i}_ms_mean": float(i) for i in range(400)}
    trace = random_trace()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        with pytest.raises(StorageError, match=r"cannot write .*metrics\.json: File too large "
                                               r"\(the file exceeds a file-size limit"):
            rd.write_metrics(tmp_path, big)
        with pytest.raises(StorageError, match=r"cannot write .*trace.*File too large"):
            trace_io.save(trace, tmp_path / "trace")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (tmp_path / rd.METRICS_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [rd.METRICS_FILE]


def test_writing_under_a_file_is_a_storage_error(tmp_path):
    from moeexp.errors import StorageError

    (tmp_path / "f").write_text("")
    with pytest.raises(StorageError, match=r"cannot write .*f/run/metrics\.json.*is a file"):
        rd.write_metrics(tmp_path / "f" / "run", {"hit_rate": 0.5})
