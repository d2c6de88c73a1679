"""Each system against FineMoE's four baselines, beside the paper's numbers (algorithms.md §9).

FineMoE reports its change relative to DeepSpeed-Inference, Mixtral-Offloading, ProMoE and
MoE-Infinity. :func:`baseline_changes` computes the same relative changes for every row of
a summary table (``gather`` of :mod:`moeexp.tracking.results`), against each baseline row
present with the same values of the other swept keys (e.g. the same ``dataset``)::

    ttft_vs_<b>_pct   = 100 * (ttft_ms_mean / ttft_ms_mean[b] - 1)       (negative = faster)
    tpot_vs_<b>_pct   = 100 * (tpot_ms_mean / tpot_ms_mean[b] - 1)
    recall_vs_<b>_pct = 100 * (prediction_recall / prediction_recall[b] - 1)
    hit_vs_<b>_pct    = 100 * (hit_rate / hit_rate[b] - 1)

FineMoE's "hit rate" is the prediction recall ("overlapped expert ratio", §8), so the
paper's hit-rate numbers sit beside ``recall_vs_<b>_pct``; our real cache ``hit_rate`` has
no paper counterpart. The paper does not say whether "+14%" is relative or in percentage
points; we compare relative changes (the csv also holds ``recall_vs_<b>_pp``).

:func:`comparison_markdown` renders two tables for ``summary.md``: every system against
each baseline, and FineMoE's measured change next to the paper's. It returns ``""`` when the
sweep has no ``system`` column or none of the four baselines, so other sweeps are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

#: FineMoE's four baselines, in the paper's order (config names).
PAPER_BASELINES: tuple[str, ...] = ("deepspeed", "mixtral_offloading", "promoe", "moe_infinity")

#: The system whose changes the paper reports.
PAPER_SYSTEM = "finemoe"

#: FineMoE's reported change (%) against each baseline (algorithms.md §9); None = not reported.
PAPER_CHANGES: dict[str, dict[str, float | None]] = {
    "ttft": {"deepspeed": -74.0, "mixtral_offloading": -67.0, "promoe": -56.0,
             "moe_infinity": -53.0},
    "tpot": {"deepspeed": -46.0, "mixtral_offloading": -38.0, "promoe": -27.0,
             "moe_infinity": -22.0},
    "recall": {"deepspeed": None, "mixtral_offloading": 14.0, "promoe": 37.0,
               "moe_infinity": 68.0},
}

#: quantity -> metric column compared (relative change).
QUANTITIES: dict[str, str] = {"ttft": "ttft_ms_mean", "tpot": "tpot_ms_mean",
                              "recall": "prediction_recall", "hit": "hit_rate"}

#: Keys that identify a row but never select the matching baseline row.
_NOT_MATCHED = frozenset({"run", "system", "predictor", "cache", "trace_hash", "experiment"})


def _pct(x: Any, b: Any) -> float:
    """``100 * (x / b - 1)``; NaN when either is missing or ``b`` is 0."""
    try:
        x, b = float(x), float(b)
    except (TypeError, ValueError):
        return math.nan
    if not (math.isfinite(x) and math.isfinite(b)) or b == 0:
        return math.nan
    return 100.0 * (x / b - 1.0)


def match_keys(df: pd.DataFrame) -> list[str]:
    """Swept keys a baseline row must share (e.g. ``dataset``, ``cache.capacity``).

    A candidate is a label column (non-numeric, or an override key with a ``.`` or ``/``)
    whose value varies *within* one system's rows: a key that only follows the system
    (``predictor``, a bundle such as ``experiment/online``) never selects the baseline.
    """
    if "system" not in df.columns:
        return []
    out = []
    for c in df.columns:
        if c in _NOT_MATCHED or c.endswith(("_pct", "_pp")):
            continue
        if pd.api.types.is_numeric_dtype(df[c]) and "." not in c and "/" not in c:
            continue  # a metric, not a swept key
        if (df.groupby(df["system"].astype(str))[c].agg(lambda s: s.astype(str).nunique())
                > 1).any():
            out.append(c)
    return out


def baselines_present(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> list[str]:
    """The ``baselines`` that have at least one row in ``df`` (paper order)."""
    if "system" not in df.columns:
        return []
    names = set(df["system"].astype(str))
    return [b for b in baselines if b in names]


def baseline_changes(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> pd.DataFrame:
    """``df`` plus ``<q>_vs_<b>_pct`` (and ``recall_vs_<b>_pp``) for every present baseline.

    A row's baseline is the row of system ``b`` with the same :func:`match_keys` values;
    without one the cells are NaN.
    """
    present = baselines_present(df, baselines)
    if not present:
        return df
    keys = match_keys(df)
    out = df.copy()
    for b in present:
        base = df[df["system"].astype(str) == b]
        refs = []
        for _, row in df.iterrows():
            m = base
            for k in keys:
                m = m[m[k].astype(str) == str(row[k])]
            refs.append(m.iloc[0] if len(m) else None)
        for q, metric in QUANTITIES.items():
            if metric not in df.columns:
                continue
            out[f"{q}_vs_{b}_pct"] = [_pct(row[metric], ref[metric] if ref is not None else None)
                                     for (_, row), ref in zip(df.iterrows(), refs, strict=True)]
        if "prediction_recall" in df.columns:
            out[f"recall_vs_{b}_pp"] = [
                100.0 * (float(row["prediction_recall"]) - float(ref["prediction_recall"]))
                if ref is not None else math.nan
                for (_, row), ref in zip(df.iterrows(), refs, strict=True)]
    return out


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, (int, float)):
        return f"{v:+.1f}%"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def comparison_markdown(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> str:
    """Markdown: every system vs each baseline, and FineMoE measured vs paper ("" if n/a)."""
    present = baselines_present(df, baselines)
    if not present:
        return ""
    ch = baseline_changes(df, present)
    keys = match_keys(df)
    labels = ["system", *keys]
    short = {"deepspeed": "DS", "mixtral_offloading": "MO", "promoe": "ProMoE",
             "moe_infinity": "MoE-Inf"}
    cols = [(f"{q}_vs_{b}_pct", f"{q.upper() if q != 'recall' else 'recall'} vs "
             f"{short.get(b, b)}") for q in ("ttft", "tpot", "recall") for b in present
            if not (q == "recall" and b == "deepspeed")]
    cols = [(c, h) for c, h in cols if c in ch.columns]
    parts = ["\n### Change against FineMoE's baselines (negative TTFT/TPOT = faster)\n\n",
             _table(labels + [h for _, h in cols],
                    [[*(row[k] for k in labels), *(row[c] for c, _ in cols)]
                     for _, row in ch.iterrows()])]
    fm = ch[ch["system"].astype(str) == PAPER_SYSTEM]
    if len(fm):
        parts.append("\n### FineMoE: measured change beside the paper's (algorithms.md §9)\n\n")
        header = [*keys, "baseline", "TTFT", "TTFT paper", "TPOT", "TPOT paper",
                  "recall", "recall paper (\"hit rate\")", "hit_rate"]
        rows = []
        for _, row in fm.iterrows():
            for b in present:
                rows.append([*(row[k] for k in keys), b,
                             row.get(f"ttft_vs_{b}_pct"), PAPER_CHANGES["ttft"].get(b),
                             row.get(f"tpot_vs_{b}_pct"), PAPER_CHANGES["tpot"].get(b),
                             row.get(f"recall_vs_{b}_pct"), PAPER_CHANGES["recall"].get(b),
                             row.get(f"hit_vs_{b}_pct")])
        parts.append(_table(header, rows))
        parts.append("\n(relative changes; the paper's \"hit rate\" is the prediction recall; "
                     "deepspeed predicts nothing, so no recall change against it)\n")
    return "".join(parts)
