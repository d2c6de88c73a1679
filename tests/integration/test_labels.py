"""Results say what ran (issue 29): a sweep that changes a system bundle's cache or
predictor names every job folder, log line, W&B run, summary row and figure legend by its
configuration, and compares each row with the bundle's own row, never with itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from moeexp.figures.__main__ import sweep_figures
from moeexp.figures.sweep import sweep_figures_of
from moeexp.tracking.results import summarize

CAPACITIES = ("0.125", "0.25")


def _sweep(tmp_path: Path, small: list[str], run_app, name: str, group: str) -> Path:
    """``--multirun system=deepspeed <group> cache.capacity=0.125,0.25 dataset.seed=0``, W&B
    disabled (its record, wandb_logged.json, is still written)."""
    sweep = tmp_path / name
    out = run_app("--multirun", "system=deepspeed", group, f"cache.capacity={','.join(CAPACITIES)}",
                  "dataset.seed=0", *small, f"hydra.sweep.dir={sweep}", "logger=wandb",
                  "logger.mode=disabled")
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    assert "repeat a configuration" not in out.stdout + out.stderr
    return sweep


def _check(sweep: Path, other: str) -> pd.DataFrame:
    """Four distinctly named rows (two configurations x two budgets), folders, log lines
    and W&B names by label; ``other``'s rows against deepspeed's at the same budget, and
    deepspeed's own rows against nothing."""
    rows = pd.read_csv(sweep / "summary.csv")
    assert list(zip(rows["label"], rows["cache.capacity"].astype(str), strict=True)) == [
        ("deepspeed", "0.125"), ("deepspeed", "0.25"), (other, "0.125"), (other, "0.25")]
    jobs = ["0_deepspeed", "1_deepspeed", f"2_{other}", f"3_{other}"]
    assert list(rows["run"]) == jobs
    for job, label in zip(jobs, rows["label"], strict=True):
        assert json.loads((sweep / job / "metrics.json").read_text())["label"] == label
        log = (sweep / job / "moeexp.log").read_text()
        assert f"- {label}: hit_rate" in log
        logged = json.loads((sweep / job / "wandb_logged.json").read_text())
        assert logged["name"] == f"{label}-tiny-sharegpt-{job[0]}"
        assert f"label:{label}" in logged["tags"]
    base = rows.set_index(["label", rows["cache.capacity"].astype(str)])
    for cap in CAPACITIES:
        mine, ds = base.loc[(other, cap)], base.loc[("deepspeed", cap)]
        expected = 100 * (mine["tpot_ms_mean"] / ds["tpot_ms_mean"] - 1)
        assert math.isclose(mine["tpot_vs_deepspeed_pct"], expected, rel_tol=1e-9)
        assert math.isnan(ds["tpot_vs_deepspeed_pct"])  # never compared with itself
    md = (sweep / "summary.md").read_text()
    assert md.startswith("| label | cache.capacity | n |") and "cache_capacity" not in md
    assert "against the `deepspeed` row (the system bundle as shipped) with the same " \
        "cache.capacity and prompt sample" in md
    table = md.split("### Change against FineMoE's baselines")[1]
    assert f"| {other} | 0.125 | 1 |" in table and "| deepspeed | 0.125 | 1 | - |" in table
    return rows


def test_a_cache_sweep_is_labelled_and_compared_with_the_bundle(tmp_path, small, run_app):
    """The issue's sweep: cache=lru,lfu (lfu standing in for the user's LRU-2) x two budgets.
    `make figures SWEEP=` draws it with a legend naming both configurations."""
    sweep = _sweep(tmp_path, small, run_app, "cache", "cache=lru,lfu")
    rows = _check(sweep, "deepspeed+cache=lfu")
    assert (rows["hit_rate"] != rows["hit_rate"].iloc[0]).any()  # four different runs
    written = sweep_figures(sweep, tmp_path / "figs")
    assert {p.name for p in written} == {"sweep_cache.capacity.png", "sweep_cache.capacity.pdf"}
    summary = summarize(sweep, baseline=None)
    fig = sweep_figures_of(summary.rows, summary.keys)["sweep_cache.capacity"]
    assert [t.get_text() for t in fig.axes[-1].get_legend().get_texts()] == \
        ["deepspeed", "deepspeed+cache=lfu"]


def test_a_predictor_sweep_is_labelled_and_compared_with_the_bundle(tmp_path, small, run_app):
    """The same with a predictor override: deepspeed + hit-count prefetching."""
    sweep = _sweep(tmp_path, small, run_app, "predictor", "predictor=none,hit_count")
    _check(sweep, "deepspeed+predictor=hit_count")
