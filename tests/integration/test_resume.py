"""Resume: a job is skipped only when complete (its done.json written last) with the same
resolved config; one job, one W&B run; only complete runs are summarised and synced."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from moeexp import pipeline
from moeexp.paths import CONF_DIR
from moeexp.tracking.run_dir import DONE_FILE, METRICS_FILE, SERIES_FILE


@pytest.fixture
def cfg_of(small):
    """``cfg_of(*overrides)``: the composed config of a small run (logger=none unless set)."""
    def make(*overrides: str):
        over = [*small, *overrides]
        if not any(o.startswith("logger=") for o in over):
            over.append("logger=none")
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", over)
    return make


def _no_work(monkeypatch) -> None:
    def boom(*_a, **_k):
        raise AssertionError("the job ran although it is complete")

    monkeypatch.setattr("moeexp.models.loading.load_model", boom)


def _killed_before_series(monkeypatch) -> None:
    """The job dies between metrics.json and series.parquet (as a kill there would)."""
    def killed(*_a, **_k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(pipeline, "write_series", killed)


def test_resume_reruns_a_job_whose_config_changed(tmp_path, cfg_of, monkeypatch, caplog):
    """Issue 14 case 3. A complete job at cache.capacity=0.25 rerun with 0.5 in the same
    directory: rerun with a warning naming 'cache.capacity: 0.25 -> 0.5' (before: skipped,
    its stale 0.25 metrics returned); then the same 0.5 config again: skipped without any
    work; a change of display flags only (trace.progress) is still the same job."""
    run = tmp_path / "job"
    first = pipeline.run(cfg_of("cache.capacity=0.25"), run_dir=run)
    assert first["cache_capacity"] == "0.25" and (run / DONE_FILE).is_file()
    with caplog.at_level(logging.WARNING, logger="moeexp.pipeline"):
        second = pipeline.run(cfg_of("cache.capacity=0.5"), run_dir=run)
    assert second["cache_capacity"] == "0.5"
    assert "cache.capacity: 0.25 -> 0.5" in caplog.text and "rerunning" in caplog.text
    assert json.loads((run / METRICS_FILE).read_text())["cache_capacity"] == "0.5"
    assert json.loads((run / DONE_FILE).read_text())["config"]["cache"]["capacity"] == 0.5
    _no_work(monkeypatch)
    assert pipeline.run(cfg_of("cache.capacity=0.5", "trace.progress=true"),
                        run_dir=run)["cache_capacity"] == "0.5"


def test_a_job_killed_between_metrics_and_series_is_rerun(tmp_path, cfg_of, monkeypatch,
                                                          caplog):
    """Issue 14 case 4. Killed after metrics.json, before series.parquet: no done.json, so
    the resume reruns it (before: it counted as complete and its series never came); the
    rerun writes the series and the marker last."""
    run = tmp_path / "job"
    with monkeypatch.context() as m:
        _killed_before_series(m)
        with pytest.raises(KeyboardInterrupt):
            pipeline.run(cfg_of(), run_dir=run)
    assert (run / METRICS_FILE).is_file() and not (run / SERIES_FILE).exists()
    assert not (run / DONE_FILE).exists()
    with caplog.at_level(logging.WARNING, logger="moeexp.pipeline"):
        pipeline.run(cfg_of(), run_dir=run)
    assert "incomplete, metrics.json without done.json" in caplog.text
    assert (run / SERIES_FILE).is_file()
    done = json.loads((run / DONE_FILE).read_text())
    assert done["outputs"] == ["env.json", "metrics.json", "series.parquet"]
    assert (run / DONE_FILE).stat().st_mtime_ns >= (run / SERIES_FILE).stat().st_mtime_ns


def test_one_job_one_wandb_run_and_sync_lists_complete_runs(tmp_path, cfg_of, monkeypatch):
    """Issue 14 case 5. Job a is killed between metrics.json and its series, then resumed:
    its directory holds one offline W&B run (before: two under the same name, one without
    metrics), under the killed attempt's run id, with the metrics. Job b is killed and not
    resumed: `moeexp wandb-sync --list` names a's run only."""
    from moeexp.tracking import wandb_sync

    sweep = tmp_path / "sweep"
    with monkeypatch.context() as m:
        _killed_before_series(m)
        for job in ("a", "b"):
            with pytest.raises(KeyboardInterrupt):
                pipeline.run(cfg_of("logger=wandb"), run_dir=sweep / job)
    killed_id = json.loads((sweep / "a" / "wandb_logged.json").read_text())["run_id"]
    pipeline.run(cfg_of("logger=wandb"), run_dir=sweep / "a")
    runs = list((sweep / "a" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(killed_id)
    logged = json.loads((sweep / "a" / "wandb_logged.json").read_text())
    assert logged["run_id"] == killed_id and logged["finished"] and "hit_rate" in logged["metrics"]
    assert json.loads((sweep / "a" / DONE_FILE).read_text())["wandb_run_id"] == killed_id
    assert wandb_sync.complete_offline_runs([sweep]) == runs
    assert len(list((sweep / "b" / "wandb").glob("offline-run-*"))) == 1  # left as it was
    assert wandb_sync.main([str(sweep), "--list"]) == 0


def test_trace_cache_dir_that_is_a_file_fails_before_any_work(tmp_path, cfg_of, monkeypatch):
    """trace.cache_dir names a file: a StorageError naming it before the model loads
    (before: NotADirectoryError after loading, sampling and recording)."""
    from moeexp.errors import StorageError

    f = tmp_path / "traces"
    f.write_text("")
    _no_work(monkeypatch)
    with pytest.raises(StorageError, match=r"trace\.cache_dir='.*traces' is a file"):
        pipeline.run(cfg_of(f"trace.cache_dir={f}"), run_dir=tmp_path / "job")
    with pytest.raises(StorageError, match=r"the run directory='.*' lies under"):
        pipeline.run(cfg_of(), run_dir=f / "job")


@pytest.mark.slow
def test_sweep_rerun_with_another_capacity_summarises_the_new_one(tmp_path, small, run_app):
    """The issue's case 3 end to end: a 2-job sweep at capacity 0.25, rerun into the same
    sweep directory with 0.5: both jobs rerun (warning in their log) and summary.csv shows
    0.5 (before: all skipped, stale 0.25 rows under overrides saying 0.5)."""
    import pandas as pd

    sweep = tmp_path / "sweep"
    args = ["--multirun", "cache=lru,lfu", *small, f"hydra.sweep.dir={sweep}", "logger=none"]
    for cap in ("0.25", "0.5"):
        out = run_app(*args, f"cache.capacity={cap}")
        assert out.returncode == 0, out.stderr[-3000:]
    df = pd.read_csv(sweep / "summary.csv")
    assert len(df) == 2 and (df["cache_capacity"].astype(str) == "0.5").all()
    for job in df["run"]:
        log = (sweep / job / "moeexp.log").read_text()
        assert "cache.capacity: 0.25 -> 0.5" in log and "skipping" not in log
    assert Path(sweep / "0_deepspeed" / DONE_FILE).is_file()


def test_natural_lengths_are_cut_to_the_models_context(tmp_path, cfg_of, monkeypatch, caplog):
    """Issue 14 case 6, through the pipeline: dataset.lengths=natural with up to 600 + 600
    tokens into model=tiny (max_position_embeddings 512): every sampled request feeds at
    most 512 positions (before: up to 1023, silently), and the warning says so."""
    class Sampled(Exception):
        pass

    def capture(spec, loaded, prompts, times, run_dir, label):
        raise Sampled(prompts, loaded.model.config.max_position_embeddings)

    monkeypatch.setattr(pipeline, "_execute", capture)
    cfg = cfg_of("dataset.lengths=natural", "dataset.max_input_len=600",
                 "dataset.max_output_len=600", "dataset.num_prompts=32")
    with caplog.at_level(logging.WARNING, logger="moeexp.data.prompts"), \
            pytest.raises(Sampled) as got:
        pipeline.run(cfg, run_dir=tmp_path / "job")
    prompts, ctx = got.value.args
    assert max(p.prompt_len + p.output_len - 1 for p in prompts) <= ctx
    assert f"context of {ctx} positions" in caplog.text
