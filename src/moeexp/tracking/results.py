"""Gather the runs under a directory into one table; compare systems against a baseline.

Used by the end-of-multirun summary (:mod:`moeexp.tracking.summary`) and by
``python -m moeexp.tracking.collect DIR``; :func:`summarize` adds the table of means and
95 % intervals over the seeds (:mod:`moeexp.tracking.intervals`). A run is a directory holding ``metrics.json``
and its completion marker ``done.json`` (:mod:`moeexp.tracking.run_dir`); a directory
with ``metrics.json`` but no marker (a job killed before its last output, or rerunning) is
left out with a warning. Its Hydra overrides (``.hydra/overrides.yaml``) give the swept
keys. One row per run::

    run | <override keys, e.g. dataset.seed, system, cache.capacity> | <metrics.json keys>

A run whose seed is not an override gets its ``dataset.seed`` from ``.hydra/config.yaml``.

Override keys lose their ``+``/``++``/``~`` prefix. When an override key is also a metric
key (``system=deepspeed`` and the metric ``system``), the metric's value is kept: it is
the resolved name. Derived columns ``<q>_vs_<baseline>_pct`` give each row's change
relative to the baseline system's row with the same other swept values (negative =
reduction), e.g. ``ttft_vs_deepspeed_pct = 100 * (ttft_ms_mean / ttft_ms_mean[deepspeed] - 1)``.
"""

from __future__ import annotations

import io
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from moeexp.tracking.intervals import SEED_KEY, aggregate, group_keys, not_applicable
from moeexp.tracking.run_dir import DONE_FILE, METRICS_FILE, is_complete, read_metrics

log = logging.getLogger(__name__)

#: The string metrics identifying a run (written by the pipeline), in table order.
IDENTITY_KEYS: tuple[str, ...] = ("system", "predictor", "cache", "model", "dataset",
                                  "hardware", "backend")

#: Columns of the printed comparison table (those present are shown).
TABLE_METRICS: tuple[str, ...] = (
    "hit_rate", "prediction_recall", "ttft_ms_mean", "tpot_ms_mean", "ttft_norm_mean",
    "tpot_norm_mean", "h2d_bytes_total",
)

#: quantity -> metric compared against the baseline system.
COMPARED: dict[str, str] = {"ttft": "ttft_ms_mean", "tpot": "tpot_ms_mean",
                            "e2e": "e2e_ms_mean", "h2d": "h2d_bytes_total"}


def read_overrides(run_dir: Path) -> dict[str, str]:
    """``{key: value}`` from ``run_dir/.hydra/overrides.yaml`` (empty when absent)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    items = OmegaConf.to_container(OmegaConf.load(path))
    out: dict[str, str] = {}
    for item in items if isinstance(items, list) else []:
        key, sep, value = str(item).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def find_runs(root: str | Path, complete: bool = True) -> list[Path]:
    """Run directories (holding ``metrics.json``) under ``root``, sorted, wandb dirs skipped.

    ``complete``: only those with their completion marker (the others are named in a
    warning); False: every directory with a ``metrics.json``.
    """
    root = Path(root)
    runs = [p.parent for p in root.rglob(METRICS_FILE) if "wandb" not in p.relative_to(root).parts]
    runs = sorted(runs, key=_natural_key)
    if not complete:
        return runs
    done = [r for r in runs if is_complete(r)]
    if len(done) < len(runs):
        left = [str(r.relative_to(root)) or "." for r in runs if r not in done]
        log.warning("%d run(s) under %s left out: incomplete (%s without a complete %s: killed "
                    "or still running; rerun the sweep with resume=true to finish them): %s",
                    len(left), root, METRICS_FILE, DONE_FILE, ", ".join(left))
    return done


def _natural_key(p: Path) -> list[Any]:
    """Sort job directories 0_x, 1_x, ..., 10_x numerically (digit runs compare as ints)."""
    key: list[Any] = []
    for part in p.parts:
        key.extend((0, int(tok)) if tok.isdigit() else (1, tok)
                   for tok in re.split(r"(\d+)", part) if tok)
    return key


def read_seed(run_dir: Path) -> str | None:
    """``dataset.seed`` from ``run_dir/.hydra/config.yaml`` (None when absent)."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    value = OmegaConf.select(OmegaConf.load(path), SEED_KEY, default=None)
    return None if value is None else str(value)


def _gather(root: Path, baseline: str | None) -> tuple[pd.DataFrame, list[str]]:
    """(one row per run, the override keys in order); see module docstring."""
    rows: list[dict[str, Any]] = []
    override_keys: list[str] = []
    for run in find_runs(root):
        over = read_overrides(run)
        if SEED_KEY not in over and (seed := read_seed(run)) is not None:
            over[SEED_KEY] = seed
        for k in over:
            if k not in override_keys:
                override_keys.append(k)
        rows.append({"run": str(run.relative_to(root)) or ".", **over, **read_metrics(run)})
    if not rows:
        return pd.DataFrame(), []
    df = pd.DataFrame(rows)
    first = ["run", *override_keys, *[k for k in IDENTITY_KEYS if k not in override_keys]]
    first = [c for c in dict.fromkeys(first) if c in df.columns]
    df = df[first + [c for c in df.columns if c not in first]]
    if baseline:
        df = add_baseline_deltas(df, baseline, swept_keys(df, override_keys))
    return df, override_keys


def gather(root: str | Path, baseline: str | None = "deepspeed") -> pd.DataFrame:
    """One row per run under ``root`` (see module docstring); empty frame when none."""
    return _gather(Path(root), baseline)[0]


@dataclass(frozen=True)
class Summary:
    """The runs under a directory, per run and folded over the seeds.

    ``runs``: one row per run (:func:`gather`); ``rows``: one row per group of ``keys``
    with each metric's mean, ``<metric>_ci95`` and ``n`` (:func:`moeexp.tracking.intervals.aggregate`);
    ``keys``: the override keys a row shares (every override but the seed).
    """

    runs: pd.DataFrame
    rows: pd.DataFrame
    keys: tuple[str, ...]


def summarize(root: str | Path, baseline: str | None = "deepspeed") -> Summary:
    """:class:`Summary` of the complete runs under ``root`` (empty frames when none)."""
    runs, override_keys = _gather(Path(root), baseline)
    keys = group_keys(runs, override_keys)
    return Summary(runs, aggregate(runs, keys), tuple(keys))


def swept_keys(df: pd.DataFrame, candidates: Sequence[str]) -> list[str]:
    """The ``candidates`` columns whose value differs between rows."""
    return [k for k in candidates if k in df.columns and df[k].astype(str).nunique() > 1]


def add_baseline_deltas(df: pd.DataFrame, baseline: str, keys: Sequence[str]) -> pd.DataFrame:
    """Add ``<q>_vs_<baseline>_pct`` columns (see module docstring); NaN without a baseline."""
    if "system" not in df.columns or not (df["system"] == baseline).any():
        return df
    others = [k for k in keys if k != "system" and k in df.columns]
    df = df.copy()
    base = df[df["system"] == baseline]
    for q, metric in COMPARED.items():
        if metric not in df.columns:
            continue
        col = f"{q}_vs_{baseline}_pct"
        values = []
        for _, row in df.iterrows():
            match = base
            for k in others:
                match = match[match[k].astype(str) == str(row[k])]
            b = float(match[metric].iloc[0]) if len(match) else math.nan
            x = float(row[metric]) if pd.notna(row[metric]) else math.nan
            values.append(100.0 * (x / b - 1.0) if b and math.isfinite(b) else math.nan)
        df[col] = values
    return df


def label_columns(df: pd.DataFrame) -> list[str]:
    """Columns that name a row in a comparison: ``system`` first, then the other swept keys."""
    cands = [c for c in df.columns if c not in _NOT_LABELS and not _is_numeric_metric(df, c)]
    varying = swept_keys(df, cands)
    if "system" in df.columns:
        varying = ["system"] + [c for c in varying if c != "system"]
    return varying or ["run"]


#: Columns never used to name a row (``status`` is shown on its own when a row is not ok).
_NOT_LABELS = frozenset({"run", "seeds", SEED_KEY, "n", "status", "not_applicable_reason",
                         "ttft_available"})


def _is_numeric_metric(df: pd.DataFrame, col: str) -> bool:
    return col not in IDENTITY_KEYS and "." not in col and pd.api.types.is_numeric_dtype(df[col])



def table_columns(df: pd.DataFrame, baseline: str | None = "deepspeed") -> list[str]:
    """Labels, ``n``, then :data:`TABLE_METRICS`, then the baseline deltas, as present in
    ``df`` (a metric's ``_ci95`` column is shown in its cell, not as a column)."""
    cols = label_columns(df) + [c for c in ("n",) if c in df.columns]
    if "status" in df.columns and (df["status"].astype(str) != "ok").any():
        cols.append("status")
    cols += [m for m in TABLE_METRICS if m in df.columns]
    if baseline:
        cols += [c for c in df.columns if c.endswith(f"_vs_{baseline}_pct")]
    return list(dict.fromkeys(cols))


def fmt(col: str, value: Any) -> str:
    """Human formatting of one cell (bytes in MB, percentages signed, ratios 3 decimals)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str) or not isinstance(value, (int, float)):
        return str(value)
    if col.endswith("_pct"):
        return f"{value:+.1f}%"
    if "bytes" in col:
        return f"{value / 1e6:,.2f} MB"
    if col.endswith(("_ms_mean", "_ms_p50", "_ms_p99", "_ms_total")):
        return f"{value:,.3f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def fmt_interval(col: str, mean: Any, half: Any) -> str:
    """``mean +- half`` in :func:`fmt`'s units (``half`` missing: the mean alone)."""
    if not isinstance(half, (int, float)) or not math.isfinite(half) \
            or not isinstance(mean, (int, float)) or not math.isfinite(mean):
        return fmt(col, mean)
    if col.endswith("_pct"):
        return f"{mean:+.1f} ± {half:.1f}%"
    if "bytes" in col:
        return f"{mean / 1e6:,.2f} ± {half / 1e6:,.2f} MB"
    return f"{fmt(col, mean)} ± {fmt(col, half)}"


def cell(row: Any, col: str) -> str:
    """One table cell of ``row``: its interval when the row has ``<col>_ci95``, ``n/a``
    for a missing value of a run or group reported not applicable."""
    value = row[col]
    if not_applicable(row) and col not in ("status",) and \
            (value is None or (isinstance(value, float) and math.isnan(value))):
        return "n/a"
    half = row.get(f"{col}_ci95") if hasattr(row, "get") else None
    return fmt_interval(col, value, half) if half is not None else fmt(col, value)


def to_markdown(df: pd.DataFrame, columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``columns`` of ``df`` (cells by :func:`cell`)."""
    cols = [c for c in columns if c in df.columns]
    lines = ["| " + " | ".join(c for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(cell(row, c) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def print_table(df: pd.DataFrame, columns: Sequence[str], title: str) -> str:
    """Print ``columns`` of ``df`` as a rich table on stdout; returns its plain-text form."""
    from rich.console import Console
    from rich.table import Table

    cols = [c for c in columns if c in df.columns]
    table = Table(title=title, show_lines=False)
    cells = [[cell(row, c) for c in cols] for _, row in df.iterrows()]
    for c in cols:
        numeric = pd.api.types.is_numeric_dtype(df[c])
        table.add_column(c, justify="right" if numeric else "left", no_wrap=True)
    for row_cells in cells:
        table.add_row(*row_cells)
    # Wide enough that no header is truncated (the table is the point of the run).
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    width = max(80, sum(w + 3 for w in widths) + 1, len(title) + 2)
    Console(width=width).print(table)
    plain = Console(width=width, record=True, file=io.StringIO())
    plain.print(table)
    return plain.export_text()
