"""Means and 95 % intervals over prompt samples: one summary row per configuration.

Every experiment sweeps ``dataset.seed`` (:data:`SEED_KEY`): each seed samples other
prompts (a recorded trace) or another store/test split (an imported trace). The per-run
rows of :func:`moeexp.tracking.results.gather` are folded by :func:`aggregate` into one
row per group of the run's ``label`` (the configuration that ran, :mod:`moeexp.labels`)
and the other swept keys::

    <metric>        mean over the group's runs (finite values only)
    <metric>_ci95   half-width of the two-sided 95 % Student-t interval over the runs,
                    t(0.975, n-1) * s / sqrt(n), s the sample standard deviation
                    (ddof 1); the interval is <metric> +- <metric>_ci95. NaN for n < 2.
    n               runs in the group (prompt samples)
    seeds           their seeds, ";"-joined ("0;1;2")
    run             their run directories, ";"-joined
    <text column>   its value, or the distinct values ";"-joined (e.g. ``trace_hash``)

A run reported ``status: not_applicable`` (its predictor needs what the trace lacks) has no
latency or hit-rate keys, so a group of such runs keeps NaN there and ``status``
``not_applicable``: tables print ``n/a``, never a mean. Per-run differences against a
baseline (``*_vs_<b>_pct``, matched on the seed too) are aggregated like any metric: their
mean and interval are the *paired* difference over the same prompts.

Two runs of one group with the same seed (two sweeps collected together) count once: the
later one (natural order of the run directories) is kept, with a warning. The group
includes the label, so runs of two configurations (``deepspeed`` and
``deepspeed+cache=lfu``) are never taken for repeats.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

#: The swept key that draws the prompt sample (and an imported trace's split).
SEED_KEY = "dataset.seed"

#: Confidence of every interval (two-sided).
LEVEL = 0.95

#: t(0.975, dof) for dof = 1..30 (scipy.stats.t.ppf; the unit test checks them).
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.13145, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.04523, 2.042272)

#: Columns folded by :func:`aggregate` rather than averaged.
JOINED = ("run", "seeds")


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (>= 1).

    Tabulated to dof 30; beyond, the Cornish-Fisher expansion in 1/dof (error < 1e-7).
    """
    if dof < 1:
        raise ValueError(f"t quantile needs dof >= 1, got {dof}")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959963984540054
    g = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
         (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
         (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(gk / dof ** (k + 1) for k, gk in enumerate(g))


def mean_ci(values: Iterable[Any]) -> tuple[float, float, int]:
    """(mean, 95 % half-width, n) of the finite ``values``; half-width NaN for n < 2,
    mean NaN for n = 0."""
    x = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(float)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return math.nan, math.nan, 0
    if n == 1:
        return float(x[0]), math.nan, 1
    return float(x.mean()), t975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n), n


def group_keys(df: pd.DataFrame, candidates: Sequence[str]) -> list[str]:
    """The ``candidates`` present in ``df`` except the seed: what one summary row shares."""
    return [k for k in dict.fromkeys(candidates) if k in df.columns and k != SEED_KEY
            and k not in JOINED]


def _joined(values: Iterable[Any]) -> Any:
    """One value when the group agrees, else the distinct non-missing values ';'-joined."""
    distinct = list(dict.fromkeys(str(v) for v in values if not _missing(v)))
    if not distinct:
        return math.nan
    return distinct[0] if len(distinct) == 1 else ";".join(distinct)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _is_metric(df: pd.DataFrame, col: str, keys: Sequence[str]) -> bool:
    return (col not in keys and col not in (SEED_KEY, *JOINED, "n")
            and pd.api.types.is_numeric_dtype(df[col]) and not pd.api.types.is_bool_dtype(df[col]))


def _dedupe(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Keep the last run of each (group, seed) (see module docstring)."""
    if SEED_KEY not in df.columns:
        return df
    ident = df[[*keys, SEED_KEY]].map(str).agg("\x1f".join, axis=1)  # map: NaN -> "nan" (pandas 3)
    dup = ident.duplicated(keep="last")
    if dup.any():
        log.warning("%d run(s) repeat a configuration and seed already summarised by a later "
                    "run; the later one is kept: %s", int(dup.sum()),
                    ", ".join(str(r) for r in df.loc[dup, "run"]))
    return df[~dup]


def aggregate(runs: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per distinct value of ``keys`` (first-appearance order), see module docstring.

    ``runs``: one row per run (``gather``); ``keys``: the columns a row shares (the swept
    keys other than :data:`SEED_KEY`, e.g. from :func:`group_keys`).
    """
    if runs.empty:
        return runs.copy()
    keys = [k for k in keys if k in runs.columns]
    runs = _dedupe(runs, keys)
    ident = (runs[keys].map(str).agg("\x1f".join, axis=1) if keys
             else pd.Series("", index=runs.index))
    metrics = [c for c in runs.columns if _is_metric(runs, c, keys)]
    rows = []
    for _, part in runs.groupby(ident, sort=False):
        row: dict[str, Any] = {"run": ";".join(str(r) for r in part["run"])} \
            if "run" in part.columns else {}
        row.update({k: part[k].iloc[0] for k in keys})
        row["n"] = len(part)
        if SEED_KEY in part.columns:
            row["seeds"] = _joined(part[SEED_KEY])
        for c in part.columns:
            if c in row or c in (SEED_KEY, *JOINED):
                continue
            if c in metrics:
                row[c], row[f"{c}_ci95"], _ = mean_ci(part[c])
            else:
                row[c] = _joined(part[c])
        rows.append(row)
    return pd.DataFrame(rows)


def not_applicable(row: Any) -> bool:
    """Whether a summary row (or run row) is reported not applicable."""
    status = row.get("status") if hasattr(row, "get") else None
    return isinstance(status, str) and status == "not_applicable"
