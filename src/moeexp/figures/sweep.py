"""The figures of any sweep directory: ``make figures SWEEP=DIR`` or
``python -m moeexp.figures --sweep DIR [--out DIR]``.

The sweep's complete runs are summarised as the end of a multirun does
(:func:`moeexp.tracking.results.summarize`: one row per configuration and value of the swept
keys, each metric's mean and 95 % Student-t interval over the seeds) and drawn:

- ``sweep_<key>``: for each numeric swept key (``cache.capacity``, ``backend.arrival_rate``,
  ...), TPOT and TTFT (over no_offload's when measured, else ms), the cache hit rate and,
  when any configuration predicts, the prediction recall against that key: one line per
  configuration, 95 % error bars, lossy configurations dashed;
- ``sweep_configurations``: without a numeric swept key, one bar per configuration;
- the named experiment's own figures (:data:`moeexp.figures.__main__.FIGURES`) when the
  sweep is one (its ``experiment`` column), from its ``summary.csv``.

A configuration is named by its label (:mod:`moeexp.labels`: ``deepspeed+cache=lfu``),
followed by the values of the other swept keys (``deepspeed+cache=lfu, dataset=lmsys``):
the legend (or the bars' axis) names each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moeexp.figures import plots
from moeexp.labels import labelled_columns, table_labels
from moeexp.tracking.results import swept_keys

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The column holding each row's configuration name in the drawn frame.
CONFIG = "configuration"


def numeric_keys(rows: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    """The swept ``keys`` (varying in ``rows``) whose values are all numbers, except those
    a label accounts for."""
    labelled = labelled_columns(rows["system"] if "system" in rows.columns else [])
    out = []
    for k in swept_keys(rows, [k for k in keys if k not in labelled]):
        values = pd.to_numeric(rows[k].astype(str), errors="coerce")
        if values.notna().all():
            out.append(k)
    return out


def configuration_names(rows: pd.DataFrame, keys: Sequence[str],
                        x: str | None = None) -> pd.Series:
    """Each row's configuration: its label, then ``key=value`` for every other swept key
    (not ``x``, the one on the axis, nor those the label accounts for)."""
    labelled = labelled_columns(rows["system"] if "system" in rows.columns else [])
    others = [k for k in swept_keys(rows, keys) if k != x and k not in labelled]
    names = table_labels(rows) if ("label" in rows.columns or "system" in rows.columns) \
        else pd.Series(["run"] * len(rows), index=rows.index)
    for k in others:
        names = names + f", {k}=" + rows[k].astype(str)
    return names


def _panels(rows: pd.DataFrame) -> list[tuple[str, str]]:
    panels = [plots.latency(rows, "tpot"), plots.latency(rows, "ttft"),
              ("hit_rate", "cache hit rate")]
    recall = plots._num(rows, "prediction_recall")
    if np.isfinite(recall).any() and np.nanmax(recall) > 0:
        panels.append(("prediction_recall", "prediction recall"))
    return [(m, label) for m, label in panels if np.isfinite(plots._num(rows, m)).any()]


#: Columns naming where the numbers come from, written above each figure when constant.
CONTEXT = ("model", "dataset", "hardware", "backend", "cost_as_model")


def context_note(rows: pd.DataFrame) -> str:
    """``model tiny, dataset sharegpt, hardware rtx3090_pcie4, backend sim`` (the
    :data:`CONTEXT` columns with one value), then the seeds' note."""
    parts = [f"{c} {rows[c].iloc[0]}" for c in CONTEXT if c in rows.columns
             and rows[c].astype(str).nunique() == 1 and str(rows[c].iloc[0]) not in ("", "nan")]
    return "; ".join(p for p in (", ".join(parts), plots._seed_note(rows)) if p)


def sweep_lines(rows: pd.DataFrame, keys: Sequence[str], x: str) -> Figure:
    """Each configuration's metrics against the numeric swept key ``x`` (module docstring)."""
    df = rows.assign(**{CONFIG: configuration_names(rows, keys, x)})
    return plots._lines(df, x, x, _panels(df), group=(CONFIG,), note=context_note(df))


def sweep_bars(rows: pd.DataFrame, keys: Sequence[str]) -> Figure:
    """One bar per configuration (no numeric swept key): recall, hit rate, TPOT."""
    df = rows.assign(**{CONFIG: configuration_names(rows, keys)})
    return plots.ablation(df, (CONFIG,), f"configurations of the sweep\n{context_note(df)}")


def sweep_figures_of(rows: pd.DataFrame, keys: Sequence[str]) -> dict[str, Figure]:
    """``{file stem: figure}`` of the generic sweep figures for summary ``rows``."""
    xs = numeric_keys(rows, keys)
    if xs:
        return {f"sweep_{x}": sweep_lines(rows, keys, x) for x in xs}
    return {"sweep_configurations": sweep_bars(rows, keys)}
