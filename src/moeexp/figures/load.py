"""Find and read the experiment summaries under ``results/`` (the figures' only input)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def latest_summary(results: Path, experiment: str) -> Path | None:
    """The newest ``summary.csv`` of ``experiment`` under ``results/`` (any depth), or None."""
    base = results / "experiments" / experiment
    found = sorted(base.glob("**/summary.csv"), key=lambda p: p.stat().st_mtime) if base.exists() else []
    return found[-1] if found else None


def all_runs(results: Path, experiment: str) -> list[Path]:
    """Every ``summary_runs.csv`` of ``experiment`` under ``results/``, oldest first."""
    base = results / "experiments" / experiment
    found = base.glob("**/summary_runs.csv") if base.exists() else []
    return sorted(found, key=lambda p: p.stat().st_mtime)


def read_summary(path: Path) -> pd.DataFrame:
    """The summary table with swept-key columns normalised (``+system`` -> ``system``).

    One row per configuration: each metric's mean over the seeds and its ``_ci95``
    (:mod:`moeexp.tracking.intervals`). FineMoE's paired changes against its baselines
    (``summary_paired.csv`` beside it, when the sweep wrote one) ride along in
    ``df.attrs["paired"]``.
    """
    df = _read(path)
    paired = path.with_name(f"{path.stem}_paired.csv")
    if paired.is_file():
        df.attrs["paired"] = _read(paired)
    return df


def _read(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path)
    df.columns = [c.lstrip("+") for c in df.columns]
    return df


def column(df: pd.DataFrame, *names: str) -> str | None:
    """The first column of ``df`` named one of ``names`` (exact, then by dotted suffix)."""
    for n in names:
        if n in df.columns:
            return n
    for n in names:
        for c in df.columns:
            if c.endswith("." + n) or c.split(".")[-1] == n:
                return c
    return None
