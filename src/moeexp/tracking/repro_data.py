"""The sweeps behind the reproduction table: reading, settings and paired statistics.

:func:`load` reads each sweep directory's ``summary_runs.csv`` (one row per run, written at
the end of every multirun by :mod:`moeexp.tracking.summary`), names its claim (the
``experiment`` column, :data:`CLAIMS`) and its setting (:func:`row_regime`; a sweep over two settings splits, :func:`by_regime`), pools the sweeps
of one claim and setting, and lets an ablation adopt its FineMoE point from the Fig. 10 sweep
(:func:`adopt`). :func:`level` and :func:`paired` give means and 95 % Student-t intervals over
the seeds (:mod:`moeexp.tracking.intervals`), a comparison paired per seed. Torch-free. The
table itself: :mod:`moeexp.tracking.reproduction`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pandas as pd
import yaml

from moeexp.tracking.intervals import SEED_KEY, mean_ci

log = logging.getLogger(__name__)

Regime = Literal["embedded", "projected", "real", "testbed"]

#: The settings, in column order, with their column titles.
REGIMES: dict[Regime, str] = {
    "embedded": "embedded default (tiny-model routing, its cost, rtx3090_pcie4)",
    "projected": "projected paper regime (tiny-model routing, Mixtral-8x7B cost)",
    "real": "real trace (gpt-oss-20b routing, its cost, rtx3090_pcie4)",
    "testbed": "rung (a), the artifact's testbed (tiny-model routing, Mixtral-8x7B cost, "
               "6 GPUs, 0.18 of expert bytes per GPU, all experts, per-token flush, leak; "
               "`paper_testbed/README.md`)",
}

#: The paper-testbed ladder's column of ``summary_runs.csv`` and the rung and projection
#: whose runs make the ``testbed`` setting (its other rungs are the ladder's own business).
RUNG_KEY = "experiment/paper_testbed"
TESTBED_RUNG, TESTBED_PROJECTION = "a_artifact", "mixtral_8x7b"

#: experiment name -> the claims its sweep measures.
CLAIMS: dict[str, tuple[str, ...]] = {
    "finemoe_vs_moeinfinity": ("fig10",), "real_routing": ("fig10", "fig12"),
    "cache_size_sweep": ("fig12",), "cache_ablation": ("cache",),
    "predictor_ablation": ("predictor",), "store_capacity_sweep": ("store",),
    "paper_testbed": ("fig10",),
    # beyond the paper: issue 27's system on the regime maps (moeexp.tracking.repro_beyond)
    "regime_map": ("beyond",), "regime_map_real": ("beyond",),
    # ... and its CPU-execution variant on the CPU maps (repro_beyond.beyond_cpu_rows)
    "regime_map_cpu": ("beyond_cpu",), "regime_map_cpu_real": ("beyond_cpu",),
}

#: The budget (fraction of expert memory) of the Fig. 10 comparison.
FIG10_BUDGET = 0.25

#: The per-run summary of a sweep directory (moeexp.tracking.summary).
SUMMARY_RUNS = "summary_runs.csv"


@dataclass(frozen=True)
class Stat:
    """A mean with its 95 % half-width over ``n`` samples (half NaN when n < 2)."""

    mean: float
    half: float
    n: int

    def ok(self) -> bool:
        return self.n > 0 and math.isfinite(self.mean)

    def text(self, digits: int = 3, unit: str = "") -> str:
        """``0.326±0.012`` (or the mean alone without an interval; ``–`` when empty)."""
        if not self.ok():
            return "–"
        digits = 1 if abs(self.mean) >= 10 else digits  # milliseconds of a projected TPOT
        pm = f"±{self.half:.{digits}f}" if math.isfinite(self.half) else ""
        return f"{self.mean:.{digits}f}{pm}{unit}"

    def change(self) -> str:
        """``-12.2 % [-12.9, -11.5]`` (a relative change with its interval)."""
        if not self.ok():
            return "–"
        if not math.isfinite(self.half):
            return f"{self.mean:+.1f} % (n={self.n})"
        return f"{self.mean:+.1f} % [{self.mean - self.half:+.1f}, {self.mean + self.half:+.1f}]"

    def sign(self) -> int:
        """+1 / -1 when the interval excludes 0 above / below, else 0 (n < 2: 0)."""
        if not self.ok() or not math.isfinite(self.half):
            return 0
        return 1 if self.mean - self.half > 0 else -1 if self.mean + self.half < 0 else 0


@dataclass
class Setting:
    """The pooled runs of one claim in one setting, and where they came from."""

    runs: pd.DataFrame
    dirs: list[str] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)



# ---------------------------------------------------------------------------------- reading


def _text(v: object) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def row_regime(r: pd.Series) -> Regime | None:
    """``testbed`` for the paper-testbed ladder's rung (a) on the Mixtral projection (None
    for its other rungs), ``real`` for gpt-oss-20b's routing, ``projected`` when a cost
    projection is set, else ``embedded``."""
    proj, rung = _text(r.get("cost_as_model")), _text(r.get(RUNG_KEY))
    if rung:
        return "testbed" if (rung, proj) == (TESTBED_RUNG, TESTBED_PROJECTION) else None
    return "real" if str(r.get("model")) == "gpt_oss_20b" else "projected" if proj else "embedded"


def by_regime(runs: pd.DataFrame) -> list[tuple[Regime, pd.DataFrame]]:
    """``runs`` split by setting (:func:`row_regime`; rows of no setting left out): the
    default experiment sweeps the embedded costs and the Mixtral projection over the same
    traces."""
    regimes = [row_regime(r) for _, r in runs.iterrows()]
    return [(g, runs[[x == g for x in regimes]].reset_index(drop=True))
            for g in dict.fromkeys(regimes) if g is not None]


def commits_of(sweep_dir: Path, runs: pd.DataFrame) -> list[str]:
    """The distinct ``sha[:7]`` (``+dirty`` when the tree was) of the runs' ``env.json``."""
    out: list[str] = []
    for run in runs.get("run", pd.Series(dtype=str)):
        path = sweep_dir / str(run) / "env.json"
        if not path.is_file():
            continue
        git = json.loads(path.read_text()).get("git", {})
        sha = str(git.get("sha") or "unknown")[:7] + ("+dirty" if git.get("dirty") else "")
        if sha not in out:
            out.append(sha)
    return out or ["unknown"]


def load(dirs: Sequence[str | Path]) -> dict[tuple[str, Regime], Setting]:
    """``(claim, setting) -> pooled runs`` of the sweep directories ``dirs``."""
    out: dict[tuple[str, Regime], Setting] = {}
    for d in map(Path, dirs):
        path = d / SUMMARY_RUNS
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (summarise the sweep first: "
                                    f"python -m moeexp.tracking.collect {d})")
        runs = pd.read_csv(path)
        exps = set(runs["experiment"].astype(str)) if "experiment" in runs else set()
        claims = [c for e in sorted(exps) for c in CLAIMS.get(e, ())]
        if not claims:
            log.warning("%s: experiment %s is not one of the table's claims; skipped", d, exps)
            continue
        runs["_dir"] = str(d)
        for regime, part in by_regime(runs):
            for claim in claims:
                s = out.setdefault((claim, regime), Setting(part.iloc[0:0]))
                s.runs = pd.concat([s.runs, part], ignore_index=True)
                s.dirs.append(str(d))
                s.commits += [c for c in commits_of(d, part) if c not in s.commits]
    for regime in REGIMES:
        adopt(out, regime)
    return out


def _store_capacity(run: pd.Series) -> float:
    """``predictor.store_capacity`` from the run's ``.hydra/config.yaml`` (NaN if absent)."""
    path = Path(str(run["_dir"])) / str(run["run"]) / ".hydra" / "config.yaml"
    if not path.is_file():
        return math.nan
    cfg = yaml.safe_load(path.read_text()) or {}
    return num((cfg.get("predictor") or {}).get("store_capacity"))


def adopt(data: dict[tuple[str, Regime], Setting], regime: Regime) -> None:
    """Give each ablation of ``regime`` its FineMoE point from the Fig. 10 sweep when the
    ablation's own sweep lacks it: the same configuration (FineMoE's predictor and cache at
    25 %, the default store capacity), so the run need not be repeated. The point is
    ``cache=finemoe`` (cache ablation), ``map_tsd`` (``map_td`` for finemoe_no_semantic:
    Map(T+δ)) in the prediction ablation, and its own store capacity in the store sweep.
    The setting's sources then list the Fig. 10 directory, marked as adopted."""
    fig10 = data.get(("fig10", regime))
    if fig10 is None:
        return
    base = at_budget(fig10.runs, FIG10_BUDGET)
    fm = finemoe_of(base)
    mine = ok_rows(base, "system", fm).copy()
    if mine.empty:
        return
    label = "map_tsd" if fm == "finemoe" else "map_td"
    wanted = {"cache": ("cache", "finemoe"), "predictor": ("system", label),
              "store": ("predictor.store_capacity", None)}
    for claim, (col, value) in wanted.items():
        s = data.get((claim, regime))
        if s is None:
            continue
        rows = mine.assign(**{col: [_store_capacity(r) for _, r in mine.iterrows()]
                              if value is None else value})
        point = rows[col].iloc[0]
        if (value is None and not math.isfinite(num(point))) or (
                col in s.runs and not ok_rows(s.runs, col, point).empty):
            continue  # unknown capacity, or the ablation measured the point itself
        s.runs = pd.concat([s.runs, rows], ignore_index=True)
        point = int(point) if value is None else point
        s.notes += [f"`{d}`: {fm} at {FIG10_BUDGET:.0%} adopted as {col}={point} (same "
                    "configuration)" for d in dict.fromkeys(mine["_dir"])]
        s.commits += [c for c in fig10.commits if c not in s.commits]


# ------------------------------------------------------------------------------ statistics


def num(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _is(col: pd.Series, value: object) -> pd.Series:
    """Rows whose ``col`` equals ``value`` (numerically when both are numbers)."""
    x = num(value)
    if math.isfinite(x):
        return pd.to_numeric(col, errors="coerce").sub(x).abs() < 1e-9
    return col.astype(str) == str(value)


def ok_rows(runs: pd.DataFrame, col: str, label: object) -> pd.DataFrame:
    """The runs with ``col == label`` that completed with ``status`` ok."""
    part = runs[_is(runs[col], label)] if col in runs else runs.iloc[0:0]
    return part[part["status"].astype(str) == "ok"] if "status" in part else part


def na_reason(runs: pd.DataFrame, col: str, label: object) -> str | None:
    """Why ``label`` was reported not applicable (None when it ran or is absent)."""
    part = runs[_is(runs[col], label)] if col in runs else runs.iloc[0:0]
    if part.empty or "status" not in part or (part["status"] == "ok").any():
        return None
    reasons = part.get("not_applicable_reason", pd.Series(["not applicable"]))
    return str(reasons.dropna().iloc[0]) if reasons.notna().any() else "not applicable"


def level(runs: pd.DataFrame, col: str, label: object, metric: str) -> Stat:
    """Mean and interval over the seeds of ``metric`` for ``col == label``."""
    part = ok_rows(runs, col, label)
    return Stat(*mean_ci(part[metric])) if metric in part else Stat(math.nan, math.nan, 0)


def paired(runs: pd.DataFrame, col: str, a: object, b: object, metric: str,
           relative: bool = True) -> Stat:
    """``a`` against ``b`` on the same seeds: ``100 (a / b - 1)`` (or ``a - b``) per seed."""
    pa, pb = ok_rows(runs, col, a), ok_rows(runs, col, b)
    if metric not in pa or metric not in pb or SEED_KEY not in pa:
        return Stat(math.nan, math.nan, 0)
    xa = pa.groupby(pa[SEED_KEY].astype(str))[metric].last()
    xb = pb.groupby(pb[SEED_KEY].astype(str))[metric].last()
    both = xa.index.intersection(xb.index)
    xa, xb = xa[both].astype(float), xb[both].astype(float)
    diff = 100.0 * (xa / xb.where(xb != 0) - 1.0) if relative else xa - xb
    return Stat(*mean_ci(diff))


def ratio(runs: pd.DataFrame, col: str, a: object, b: object, metric: str) -> str:
    """``×1.43``: the mean of ``metric`` for ``a`` over that for ``b``."""
    x, y = level(runs, col, a, metric).mean, level(runs, col, b, metric).mean
    return f"×{x / y:.2f}" if math.isfinite(x) and math.isfinite(y) and y > 0 else "×–"

def finemoe_of(runs: pd.DataFrame) -> str:
    """``finemoe_artifact`` when it ran (the testbed: the artifact's selection), else
    ``finemoe``, else ``finemoe_no_semantic`` (the real trace's stand-in)."""
    for fm in ("finemoe_artifact", "finemoe"):
        if not ok_rows(runs, "system", fm).empty:
            return fm
    return "finemoe_no_semantic"


def baseline_of(runs: pd.DataFrame, baseline: str) -> str:
    """The run of ``baseline`` to compare against: on the testbed the artifact's own
    MoE-Infinity (``moe_infinity_artifact``) when it ran, else ``baseline`` itself."""
    if baseline == "moe_infinity" and not ok_rows(runs, "system", "moe_infinity_artifact").empty:
        return "moe_infinity_artifact"
    return baseline


def at_budget(runs: pd.DataFrame, budget: float) -> pd.DataFrame:
    """The runs at ``budget`` when the sweep holds several budgets, else all."""
    if "cache_capacity" not in runs:
        return runs
    caps = pd.to_numeric(runs["cache_capacity"], errors="coerce")
    return runs[(caps - budget).abs() < 1e-9] if caps.nunique() > 1 else runs
