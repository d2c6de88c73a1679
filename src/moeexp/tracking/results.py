"""Gather the runs under a directory into one table; compare systems against a baseline.

Used by the end-of-multirun summary (:mod:`moeexp.tracking.summary`) and by
``python -m moeexp.tracking.collect DIR``; :func:`summarize` adds the table of means and
95 % intervals over the seeds (:mod:`moeexp.tracking.intervals`). A run is a directory holding ``metrics.json``
and its completion marker ``done.json`` (:mod:`moeexp.tracking.run_dir`); a directory
with ``metrics.json`` but no marker (a job killed before its last output, or rerunning) is
left out with a warning. Its Hydra overrides (``.hydra/overrides.yaml``) give the swept
keys. One row per run::

    run | label | <override keys, e.g. dataset.seed, system, cache.capacity> | <metrics.json keys>

``label`` names the configuration that ran (``deepspeed+cache=lfu``:
:func:`moeexp.labels.config_label`; for a run written before labels, computed from its
``.hydra/config.yaml`` or its identity keys). A run whose seed is not an override gets its
``dataset.seed`` from ``.hydra/config.yaml``.

Override keys lose their ``+``/``++``/``~`` prefix. When an override key is also a metric
key (``system=deepspeed`` and the metric ``system``), the metric's value is kept: it is
the resolved name; a table shows the identity string ``cache_capacity`` only when
``cache.capacity`` is no column of it (one column per setting; the csv files keep both).
Derived columns ``<q>_vs_<baseline>_pct`` give each row's change relative to the baseline's
own bundle (the row labelled ``<baseline>``, e.g. ``deepspeed`` = predictor none + LRU)
with the same values of every other swept key (negative = reduction), e.g.
``ttft_vs_deepspeed_pct = 100 * (ttft_ms_mean / ttft_ms_mean[deepspeed] - 1)``; the
baseline's own rows have none (a row is never compared with itself), and
:func:`pairing_note` says what was paired.
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

from moeexp.labels import ALIASES, config_label, labelled_columns, run_label, table_labels
from moeexp.tracking.intervals import SEED_KEY, aggregate, group_keys, not_applicable
from moeexp.tracking.run_dir import DONE_FILE, METRICS_FILE, is_complete, read_metrics
from moeexp.units import format_bytes, format_bytes_interval

log = logging.getLogger(__name__)

#: The string metrics identifying a run (written by the pipeline), in table order.
IDENTITY_KEYS: tuple[str, ...] = ("label", "system", "predictor", "cache", "model",
                                  "dataset", "hardware", "backend")

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


def read_config(run_dir: Path) -> Any:
    """The job's composed config (``run_dir/.hydra/config.yaml``, a DictConfig), or None."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.load(path)


def read_seed(run_dir: Path) -> str | None:
    """``dataset.seed`` from ``run_dir/.hydra/config.yaml`` (None when absent)."""
    from omegaconf import OmegaConf

    config = read_config(run_dir)
    value = None if config is None else OmegaConf.select(config, SEED_KEY, default=None)
    return None if value is None else str(value)


def _label(run_dir: Path, metrics: dict[str, Any]) -> str:
    """The run's label: its ``metrics.json``'s, else from its config or identity keys (a run
    written before labels)."""
    if isinstance(metrics.get("label"), str):
        return str(metrics["label"])
    config = read_config(run_dir)
    if config is not None and config.get("system") is not None:
        return config_label(config)
    return run_label(str(metrics.get("system", "?")),
                     {k: metrics.get(k) for k in ("predictor", "cache")})


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
        metrics = read_metrics(run)
        rows.append({"run": str(run.relative_to(root)) or ".", **over, **metrics,
                     "label": _label(run, metrics)})
    if not rows:
        return pd.DataFrame(), []
    df = pd.DataFrame(rows)
    first = ["run", "label", *override_keys, *[k for k in IDENTITY_KEYS if k not in override_keys]]
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
    keys = group_keys(runs, ["label", *override_keys])
    return Summary(runs, aggregate(runs, keys), tuple(keys))


def swept_keys(df: pd.DataFrame, candidates: Sequence[str]) -> list[str]:
    """The ``candidates`` columns whose value differs between rows."""
    return [k for k in candidates if k in df.columns and df[k].astype(str).nunique() > 1]


def pair_keys(df: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    """The swept ``keys`` a row and its baseline row share: all but those the label
    accounts for (system, and the groups a bundle chooses: :func:`labelled_columns`)."""
    names = df["system"] if "system" in df.columns else []
    labelled = labelled_columns(names)
    return [k for k in keys if k in df.columns and k not in labelled]


def add_baseline_deltas(df: pd.DataFrame, baseline: str, keys: Sequence[str]) -> pd.DataFrame:
    """Add ``<q>_vs_<baseline>_pct`` columns (see module docstring): each row against the
    row labelled ``baseline`` with the same :func:`pair_keys`; NaN for the baseline's own
    rows and where there is no such row."""
    if "system" not in df.columns or not (table_labels(df) == baseline).any():
        return df
    others = pair_keys(df, keys)
    df = df.copy()
    names = table_labels(df)
    refs: list[Any] = []
    for i, row in df.iterrows():
        match = df[names == baseline]
        for k in others:
            match = match[match[k].astype(str) == str(row[k])]
        # several: the same run collected twice; the later one, as the summary keeps it
        refs.append(match.iloc[-1] if len(match) and names[i] != baseline else None)
    for q, metric in COMPARED.items():
        if metric in df.columns:
            df[f"{q}_vs_{baseline}_pct"] = [
                _change(row[metric], ref[metric] if ref is not None else None)
                for (_, row), ref in zip(df.iterrows(), refs, strict=True)]
    return df


def _change(x: Any, b: Any) -> float:
    """``100 * (x / b - 1)``; NaN when either is missing or ``b`` is 0."""
    try:
        x, b = float(x), float(b)
    except (TypeError, ValueError):
        return math.nan
    return 100.0 * (x / b - 1.0) if b and math.isfinite(b) and math.isfinite(x) else math.nan


def pairing_note(df: pd.DataFrame, baseline: str | None, keys: Sequence[str]) -> str:
    """One sentence saying what the ``*_vs_<baseline>_pct`` columns of ``df`` pair ("" when
    there are none)."""
    if not baseline or not any(c.endswith(f"_vs_{baseline}_pct") for c in df.columns):
        return ""
    others = [k for k in pair_keys(df, keys) if k != SEED_KEY]
    same = f"{', '.join(others)} and prompt sample" if others else "prompt sample"
    return (f"`*_vs_{baseline}_pct`: each row's change against the `{baseline}` row (the "
            f"system bundle as shipped) with the same {same} (dataset.seed); `{baseline}`'s own "
            "rows: -.")


def label_columns(df: pd.DataFrame) -> list[str]:
    """Columns that name a row in a comparison: ``label`` (the configuration) first, then
    the other swept keys (not the columns the label accounts for: ``system``, ``cache``,
    ...); ``system`` first in a table without labels."""
    cands = [c for c in df.columns if c not in _NOT_LABELS and not _is_numeric_metric(df, c)
             and ALIASES.get(c) not in df.columns]
    varying = swept_keys(df, cands)
    if "label" in df.columns:
        labelled = labelled_columns(df["system"] if "system" in df.columns else [])
        return ["label"] + [c for c in varying if c not in labelled]
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
    """Human formatting of one cell (bytes in B/kB/MB/GB/TB by :func:`moeexp.units.format_bytes`,
    percentages signed, ratios 3 decimals)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str) or not isinstance(value, (int, float)):
        return str(value)
    if col.endswith("_pct"):
        return f"{value:+.1f}%"
    if "bytes" in col:
        return format_bytes(value)
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
        return format_bytes_interval(mean, half)
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
