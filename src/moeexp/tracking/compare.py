"""Each system against FineMoE's four baselines, beside the paper's numbers (algorithms.md §9).

FineMoE reports its change relative to DeepSpeed-Inference, Mixtral-Offloading, ProMoE and
MoE-Infinity. :func:`baseline_changes` computes the same relative changes for every row of
a summary table (``gather`` of :mod:`moeexp.tracking.results`), against each baseline row
present with the same values of the other swept keys (e.g. the same ``dataset``)::

    ttft_vs_<b>_pct   = 100 * (ttft_ms_mean / ttft_ms_mean[b] - 1)       (negative = faster)
    tpot_vs_<b>_pct   = 100 * (tpot_ms_mean / tpot_ms_mean[b] - 1)
    recall_vs_<b>_pct = 100 * (prediction_recall / prediction_recall[b] - 1)
    hit_vs_<b>_pct    = 100 * (hit_rate / hit_rate[b] - 1)

and the absolute differences ``ttft_vs_<b>_ms``, ``tpot_vs_<b>_ms`` (ms) and
``recall_vs_<b>_pp``, ``hit_vs_<b>_pp`` (percentage points). A row is a configuration, named
by its ``label`` (:mod:`moeexp.labels`: ``deepspeed+cache=lfu`` ran DeepSpeed's bundle with
LFU); baseline ``b`` is the row labelled ``b`` (its bundle as shipped), matched on every
swept key that varies within one configuration's rows, the seed (``dataset.seed``)
included, so each change is *paired*: the two configurations served the same prompts. A
baseline's own row has no change against itself (NaN, printed ``-``).

FineMoE's "hit rate" is the prediction recall ("overlapped expert ratio", §8), so the
paper's hit-rate numbers sit beside ``recall_vs_<b>_pct``; our real cache ``hit_rate`` has
no paper counterpart. The paper does not say whether "+14%" is relative or in percentage
points; we compare relative changes (the csv also holds ``recall_vs_<b>_pp``).

:func:`paired_changes` folds FineMoE's per-seed changes into their mean and 95 % Student-t
interval over the seeds (``n`` pairs; :mod:`moeexp.tracking.intervals`), one row per
baseline (and per value of the other swept keys), beside the paper's number.
:func:`comparison_markdown` renders two tables for ``summary.md``: every system against
each baseline (means over the seeds), and FineMoE's paired changes with their intervals
next to the paper's. It returns ``""`` when the sweep has no ``system`` column or none of
the four baselines, so other sweeps are unchanged. A row reported ``not_applicable`` (on
either side of a pair) prints as such, never as a number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from moeexp.labels import ALIASES, labelled_columns, table_labels
from moeexp.tracking.intervals import SEED_KEY, aggregate, mean_ci, not_applicable

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

#: quantity -> (absolute-difference suffix, scale): ms for latencies, points for rates.
ABSOLUTE: dict[str, tuple[str, float]] = {"ttft": ("ms", 1.0), "tpot": ("ms", 1.0),
                                          "recall": ("pp", 100.0), "hit": ("pp", 100.0)}

#: Keys that identify a row but never select the matching baseline row.
_NOT_MATCHED = frozenset({"run", "label", "system", "predictor", "cache", "trace_hash",
                          "experiment"})


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
    whose value varies *within* one configuration's rows (one ``label``): a key that only
    follows the configuration (``predictor``, a bundle such as ``experiment/online``) or
    that the label names (``cache``, ``cache.name``) never selects the baseline.
    """
    if "system" not in df.columns:
        return []
    skip = _NOT_MATCHED | labelled_columns(df["system"])
    names = table_labels(df)
    out = []
    for c in df.columns:
        if c in skip or c.endswith(("_pct", "_pp")) or ALIASES.get(c) in df.columns:
            continue
        if pd.api.types.is_numeric_dtype(df[c]) and "." not in c and "/" not in c:
            continue  # a metric, not a swept key
        if (df.groupby(names)[c].agg(lambda s: s.astype(str).nunique()) > 1).any():
            out.append(c)
    return out


def baselines_present(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> list[str]:
    """The ``baselines`` whose own bundle has at least one row in ``df`` (paper order)."""
    if "system" not in df.columns:
        return []
    names = set(table_labels(df))
    return [b for b in baselines if b in names]


def _diff(x: Any, b: Any, scale: float) -> float:
    """``scale * (x - b)``; NaN when either is missing."""
    try:
        x, b = float(x), float(b)
    except (TypeError, ValueError):
        return math.nan
    return scale * (x - b) if math.isfinite(x) and math.isfinite(b) else math.nan


def _refs(df: pd.DataFrame, b: str, keys: Sequence[str]) -> list[Any]:
    """For every row of ``df``, the row labelled ``b`` with the same ``keys``; None for
    ``b``'s own rows (never compared with themselves) and where there is none."""
    names = table_labels(df)
    base = df[names == b]
    refs = []
    for i, row in df.iterrows():
        m = base
        for k in keys:
            m = m[m[k].astype(str) == str(row[k])]
        refs.append(m.iloc[-1] if len(m) and names[i] != b else None)  # -1: a rerun
    return refs


def baseline_changes(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> pd.DataFrame:
    """``df`` plus ``<q>_vs_<b>_pct`` and the absolute ``<q>_vs_<b>_ms|_pp`` for every
    present baseline (module docstring).

    A row's baseline is the row labelled ``b`` with the same :func:`match_keys` values;
    without one, and for ``b``'s own rows, the cells are NaN. ``_na_<b>`` (bool) says the baseline row was reported
    not applicable (read by :func:`paired_changes`).
    """
    present = baselines_present(df, baselines)
    if not present:
        return df
    keys = match_keys(df)
    new: dict[str, list[float]] = {}
    for b in present:
        refs = _refs(df, b, keys)
        for q, metric in QUANTITIES.items():
            if metric not in df.columns:
                continue
            pairs = [(row[metric], ref[metric] if ref is not None else None)
                     for (_, row), ref in zip(df.iterrows(), refs, strict=True)]
            unit, scale = ABSOLUTE[q]
            new[f"{q}_vs_{b}_pct"] = [_pct(x, r) for x, r in pairs]
            new[f"{q}_vs_{b}_{unit}"] = [_diff(x, r, scale) for x, r in pairs]
        new[f"_na_{b}"] = [ref is not None and not_applicable(ref) for ref in refs]
    out = df.copy()
    for c, v in new.items():
        out[c] = v
    return out


def paired_changes(df: pd.DataFrame, system: str = PAPER_SYSTEM,
                   baselines: Sequence[str] = PAPER_BASELINES) -> pd.DataFrame:
    """``system`` against each baseline, paired over the seeds: one row per baseline (and per
    value of the swept keys other than the seed); empty when either is absent.

    Columns: the keys, ``baseline``, ``n`` (seeds with both rows), ``status`` (``ok`` or
    ``not_applicable: <system>``), and for each quantity ``q`` (ttft, tpot, recall, hit):
    ``q_pct`` with ``q_pct_ci95``, the absolute ``q_ms``/``q_pp`` with its ``_ci95``
    (mean and 95 % Student-t half-width over the seeds), and ``q_paper`` (the paper's %).
    """
    present = baselines_present(df, baselines)
    if not present or system not in set(table_labels(df)):
        return pd.DataFrame()
    ch = baseline_changes(df, present)
    keys = [k for k in match_keys(df) if k != SEED_KEY]
    mine = ch[table_labels(ch) == system]
    ident = mine[keys].map(str).agg("\x1f".join, axis=1) if keys else \
        pd.Series("", index=mine.index)
    rows = []
    for _, part in mine.groupby(ident, sort=False):
        for b in present:
            row: dict[str, Any] = {k: part[k].iloc[0] for k in keys}
            row["baseline"] = b
            na = [system] if all(not_applicable(r) for _, r in part.iterrows()) else []
            if part[f"_na_{b}"].astype(bool).all():
                na.append(b)
            row["status"] = f"not_applicable: {', '.join(na)}" if na else "ok"
            row["n"] = 0
            for q in QUANTITIES:
                unit = ABSOLUTE[q][0]
                for col in (f"{q}_vs_{b}_pct", f"{q}_vs_{b}_{unit}"):
                    mean, half, n = mean_ci(part[col]) if col in part else (math.nan,) * 2 + (0,)
                    short = col.replace(f"_vs_{b}", "")
                    row[short], row[f"{short}_ci95"] = mean, half
                    row["n"] = max(row["n"], n)
                row[f"{q}_paper"] = PAPER_CHANGES.get(q, {}).get(b) if system == PAPER_SYSTEM \
                    else None
            rows.append(row)
    return pd.DataFrame(rows)


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, (int, float)):
        return f"{v:+.1f}%"
    return str(v)


def interval_cell(mean: Any, half: Any, unit: str = "%") -> str:
    """``-17.6% [-18.5, -16.8]`` (the 95 % interval); the mean alone when there is none.
    Milliseconds (``unit=" ms"``) get 3 decimals: the tiny model's TPOT is ~0.4 ms."""
    if mean is None or not isinstance(mean, (int, float)) or not math.isfinite(mean):
        return "-"
    d = 3 if unit.strip() == "ms" else 1
    if half is None or not isinstance(half, (int, float)) or not math.isfinite(half):
        return f"{mean:+.{d}f}{unit}"
    return f"{mean:+.{d}f}{unit} [{mean - half:+.{d}f}, {mean + half:+.{d}f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


_SHORT = {"deepspeed": "DS", "mixtral_offloading": "MO", "promoe": "ProMoE",
          "moe_infinity": "MoE-Inf"}


def _systems_table(df: pd.DataFrame, present: Sequence[str], keys: Sequence[str]) -> str:
    """Every system against each baseline: the mean over the seeds of the paired changes."""
    ch = baseline_changes(df, present)
    ch = ch.drop(columns=[c for c in ch.columns if c.startswith("_na_")])
    group = [k for k in ("label" if "label" in ch.columns else "system", *keys)
             if k in ch.columns]
    rows_df = aggregate(ch, group)
    cols = [(f"{q}_vs_{b}_pct", f"{q.upper() if q != 'recall' else 'recall'} vs "
             f"{_SHORT.get(b, b)}") for q in ("ttft", "tpot", "recall") for b in present
            if not (q == "recall" and b == "deepspeed")]
    cols = [(c, h) for c, h in cols if c in rows_df.columns]
    rows = [[*(row[k] for k in group), row["n"],
             *(row[c] if not not_applicable(row) else "n/a" for c, _ in cols)]
            for _, row in rows_df.iterrows()]
    note = "; mean over the n seeds of the change on the same prompts" \
        if (rows_df["n"] > 1).any() else ""
    same = " and ".join([*keys, "prompt sample (dataset.seed)"])
    pairs = (f"\nEach row against each baseline's own bundle ({', '.join(present)} as shipped) "
             f"with the same {same}; a baseline's own row: -.\n")
    return (f"\n### Change against FineMoE's baselines (negative TTFT/TPOT = faster{note})"
            "\n\n" + _count_table([*group, "n", *(h for _, h in cols)], rows) + pairs)


def _count_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """:func:`_table`, with the ``n`` column printed as a count, not a change."""
    at = list(header).index("n")
    rows = [[*r[:at], str(int(r[at])), *r[at + 1:]] for r in rows]
    return _table(header, rows)


def paired_markdown(paired: pd.DataFrame) -> str:
    """FineMoE's paired changes with their 95 % intervals beside the paper's ("" if none)."""
    if paired.empty:
        return ""
    keys = list(paired.columns[:list(paired.columns).index("baseline")])
    header = [*keys, "baseline", "n", "TTFT", "TTFT paper", "TPOT", "TPOT paper", "TTFT ms",
              "TPOT ms", "recall", "recall paper (\"hit rate\")", "hit_rate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for _, r in paired.iterrows():
        ok = r["status"] == "ok"
        na = str(r["status"]).replace("not_applicable", "not applicable")

        def iv(q: str, unit: str = "%", r: Any = r, ok: bool = ok, na: str = na) -> str:
            return interval_cell(r[q], r[f"{q}_ci95"], unit) if ok else \
                na if q == "ttft_pct" else "n/a"

        cells = [iv("ttft_pct"), _cell(r["ttft_paper"]), iv("tpot_pct"), _cell(r["tpot_paper"]),
                 iv("ttft_ms", " ms"), iv("tpot_ms", " ms"), iv("recall_pct"),
                 _cell(r["recall_paper"]), iv("hit_pct")]
        lines.append("| " + " | ".join([*(str(r[k]) for k in keys), str(r["baseline"]),
                                        str(int(r["n"])) if ok else "-", *cells]) + " |")
    return "\n".join(lines) + "\n"


def comparison_markdown(df: pd.DataFrame, baselines: Sequence[str] = PAPER_BASELINES) -> str:
    """Markdown from the per-run rows ``df``: every system vs each baseline, and FineMoE's
    paired changes with intervals vs the paper's ("" without a baseline)."""
    present = baselines_present(df, baselines)
    if not present:
        return ""
    keys = [k for k in match_keys(df) if k != SEED_KEY]
    parts = [_systems_table(df, present, keys)]
    paired = paired_changes(df, PAPER_SYSTEM, present)
    if len(paired):
        parts.append("\n### FineMoE: paired change beside the paper's (algorithms.md §9)\n\n")
        parts.append(paired_markdown(paired))
        parts.append("\n(mean over the n prompt samples (`dataset.seed`) of FineMoE's change "
                     "against the baseline on the same prompts, [95 % interval: Student t "
                     "over the seeds]; relative changes, absolute ones in ms; the paper's "
                     "\"hit rate\" is the prediction recall; deepspeed predicts nothing, so "
                     "no recall change against it)\n")
    return "".join(parts)
