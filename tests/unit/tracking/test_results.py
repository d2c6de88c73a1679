"""Gathering runs, baseline deltas, the summary callback and ``moeexp.tracking.collect``."""

from __future__ import annotations

import math
from math import nan
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.tracking import collect
from moeexp.tracking.results import gather
from moeexp.tracking.run_dir import write_done, write_metrics
from moeexp.tracking.summary import SummaryCallback


def _job(root: Path, name: str, overrides: list[str], **metrics) -> Path:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    write_metrics(d, metrics)
    write_done(d, {"overrides": overrides}, outputs=["metrics.json"])
    return d


@pytest.fixture
def sweep(tmp_path) -> Path:
    """Two datasets x {deepspeed, oracle}: oracle halves TTFT on a, quarters it on b."""
    common = ["+experiment=x", "dataset.num_prompts=6"]
    for i, (ds, system, ttft) in enumerate([("a", "deepspeed", 10.0), ("a", "oracle", 5.0),
                                            ("b", "deepspeed", 8.0), ("b", "oracle", 2.0)]):
        _job(tmp_path, str(i), [*common, f"dataset={ds}", f"system={system}"], system=system,
             dataset=ds, ttft_ms_mean=ttft, tpot_ms_mean=1.0, hit_rate=0.5, h2d_bytes_total=1e6)
    (tmp_path / "wandb").mkdir()  # W&B's own files are never mistaken for runs
    return tmp_path


def test_gather_rows_columns_and_deltas(sweep):
    """One row per job, its label and the override keys first (prefix '+' dropped), deltas
    against the deepspeed row of the same dataset: oracle -50% on a, -75% on b, deepspeed
    none (a row is never compared with itself)."""
    df = gather(sweep)
    assert list(df["run"]) == ["0", "1", "2", "3"]
    assert list(df.columns[:6]) == ["run", "label", "experiment", "dataset.num_prompts",
                                    "dataset", "system"]
    assert list(df["label"]) == ["deepspeed", "oracle", "deepspeed", "oracle"]
    assert list(df["ttft_vs_deepspeed_pct"]) == pytest.approx([nan, -50.0, nan, -75.0],
                                                              nan_ok=True)
    assert list(df["tpot_vs_deepspeed_pct"]) == pytest.approx([nan, 0.0, nan, 0.0], nan_ok=True)


def test_no_baseline_row_no_delta_columns(sweep):
    df = gather(sweep, baseline="finemoe")
    assert not [c for c in df.columns if c.endswith("_pct")]


def test_summary_callback_writes_csv_md_and_prints(sweep, capsys):
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "experiment_name": "x"})
    SummaryCallback(baseline="deepspeed").on_multirun_end(cfg)
    df = pd.read_csv(sweep / "summary.csv")
    assert len(df) == 4 and set(df["system"]) == {"deepspeed", "oracle"}
    md = (sweep / "summary.md").read_text()
    assert md.startswith("| label | dataset |") and "-75.0%" in md
    out = capsys.readouterr().out
    assert "ttft_vs_deepspeed_pct" in out and "oracle" in out and "1.00 MB" in out and "ttft_vs_deepsp…" not in out


def test_collect_cli(sweep, tmp_path_factory, capsys):
    assert collect.main([str(sweep), "--baseline", "none"]) == 0
    df = pd.read_csv(sweep / "collected.csv")
    assert len(df) == 4 and "ttft_vs_deepspeed_pct" not in df.columns
    assert math.isclose(df["ttft_ms_mean"].sum(), 25.0)
    empty = tmp_path_factory.mktemp("empty")
    assert collect.main([str(empty)]) == 1


def test_incomplete_jobs_are_left_out_with_a_warning(sweep, caplog):
    """A job with metrics.json but no done.json (killed between metrics.json and its
    series, or rerunning) is not a row of summary.csv / collected.csv (before: its stale
    metrics were summarised); a warning names it. Only incomplete jobs: collect says so."""
    import logging

    (sweep / "3" / "done.json").unlink()
    with caplog.at_level(logging.WARNING, logger="moeexp.tracking.results"):
        df = gather(sweep)
    assert list(df["run"]) == ["0", "1", "2"]
    assert "1 run(s) under" in caplog.text and "incomplete" in caplog.text and ": 3" in caplog.text
    only = sweep / "3"
    with caplog.at_level(logging.ERROR, logger="moeexp.tracking.collect"):
        assert collect.main([str(only)]) == 1
    assert "no complete run under" in caplog.text and "1 incomplete" in caplog.text
