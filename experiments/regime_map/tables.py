"""The README's tables from a regime map's collected summary (issue 11).

    python experiments/regime_map/tables.py experiments/regime_map/summary_embedded.csv
    python experiments/regime_map/tables.py experiments/regime_map/summary_real.csv

Reads ``summary.csv`` (one row per system, budget and link: each metric's mean over the
seeds, ``<metric>_ci95`` its 95 % Student-t half-width, ``n``) and ``summary_runs.csv``
beside it (one row per run; the ``*_vs_deepspeed_pct`` deltas paired on the seed). Prints,
per budget: TPOT (and TTFT) over no_offload's with the floor ``bound_*``, each system's
paired change against on-demand LRU (``deepspeed``), the hit rate, the crossovers (the
copy-to-compute ratio where a system starts or stops beating on-demand loading, per seed by
log-linear interpolation between sweep points, then mean and 95 % interval over the
seeds), the oracles against the floor and the best exact system, and the decomposition
(where the bytes and the stalls go) at chosen ratios.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from moeexp.tracking.intervals import mean_ci

ON_DEMAND = "deepspeed"
REFERENCE = "no_offload"
ORACLES = ("oracle", "oracle_aggressive")


def _read(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = pd.read_csv(path)
    runs = pd.read_csv(path.with_name(f"{path.stem}_runs.csv"))
    out = []
    for df in (rows, runs):
        df = df.rename(columns=lambda c: c.lstrip("+")).copy()
        out.append(df.assign(_cap=pd.to_numeric(df["cache_capacity"], errors="coerce"),
                             _x=pd.to_numeric(df["copy_to_compute"], errors="coerce")))
    rows, runs = out
    ok = np.isfinite(pd.to_numeric(rows["tpot_norm_mean"], errors="coerce"))
    return rows[ok], runs


def _pm(mean: float, half: float, d: int = 2) -> str:
    """``1.23 ± 0.04`` (significant digits grow with the value: 3 figures)."""
    if not math.isfinite(mean):
        return "-"
    dd = max(0, d - int(math.floor(math.log10(abs(round(mean, 3)))))) if mean else d
    return f"{mean:.{dd}f}" + (f" ± {half:.{dd}f}" if math.isfinite(half) else "")


def _ratio(pct: float, half: float) -> str:
    """A paired % change as a ratio to on-demand's: ``1.234 [1.200, 1.268]``."""
    if not math.isfinite(pct):
        return "-"
    m = f"{1 + pct / 100:.3f}"
    return m if not math.isfinite(half) else \
        f"{m} [{1 + (pct - half) / 100:.3f}, {1 + (pct + half) / 100:.3f}]"


def _pct(mean: float, half: float) -> str:
    if not math.isfinite(mean):
        return "-"
    if not math.isfinite(half):
        return f"{mean:+.1f} %"
    return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]"


def _f(row: pd.Series, col: str) -> tuple[float, float]:
    m = pd.to_numeric(row.get(col), errors="coerce")
    h = pd.to_numeric(row.get(f"{col}_ci95"), errors="coerce")
    return (float(m) if pd.notna(m) else math.nan, float(h) if pd.notna(h) else math.nan)


def _systems(rows: pd.DataFrame) -> list[str]:
    return [s for s in dict.fromkeys(rows["system"]) if s != REFERENCE]


def _ratios(sub: pd.DataFrame) -> list[float]:
    return sorted(sub["_x"].round(6).unique())


def _at(sub: pd.DataFrame, s: str, x: float) -> pd.Series | None:
    m = sub[(sub["system"] == s) & (sub["_x"].round(6) == x)]
    return m.iloc[0] if len(m) else None


def _floor(sub: pd.DataFrame, x: float, bound: str) -> float:
    """The floor at ratio ``x``: the same for every system of a seed, so taken from the
    rows with the most seeds there (a row over fewer seeds averages other prompts).
    ``no_offload`` is left out: all experts resident is another budget, its floor is 1."""
    at = sub[(sub["_x"].round(6) == x) & (sub["system"] != REFERENCE)]
    at = at[pd.to_numeric(at["n"], errors="coerce") == pd.to_numeric(at["n"], errors="coerce").max()]
    b = pd.to_numeric(at[bound], errors="coerce")
    return float(b.mean()) if b.notna().any() else math.nan


def _header(first: str, xs: Sequence[float]) -> list[str]:
    return [f"| {first} | " + " | ".join(f"{x:.3g}" for x in xs) + " |",
            "|---|" + "---|" * len(xs)]


def metric_table(sub: pd.DataFrame, col: str, title: str, bound: str | None = None,
                 pct: bool = False) -> str:
    """One row per system (and the floor), one column per copy-to-compute ratio."""
    xs = _ratios(sub)
    lines = [f"{title}:", "", *_header("system \\ copy/compute", xs)]
    for s in _systems(sub):
        cells = []
        for x in xs:
            r = _at(sub, s, x)
            m, h = _f(r, col) if r is not None else (math.nan, math.nan)
            cells.append(_pct(m, h) if pct else _pm(m, h))
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if bound:
        cells = [_pm(_floor(sub, x, bound), math.nan) for x in xs]
        lines.append("| **bound (floor)** | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _crossings(x: np.ndarray, d: np.ndarray) -> list[tuple[float, str]]:
    """Where ``d`` (a % change against on-demand) changes sign along ``x``: (ratio,
    'starts' | 'stops' beating), log-linear between the two sweep points."""
    out = []
    for i in range(len(x) - 1):
        a, b = d[i], d[i + 1]
        if not (math.isfinite(a) and math.isfinite(b)) or (a < 0) == (b < 0):
            continue
        t = a / (a - b)
        out.append((math.exp(math.log(x[i]) + t * (math.log(x[i + 1]) - math.log(x[i]))),
                    "stops" if a < 0 else "starts"))
    return out


def crossover_table(runs: pd.DataFrame, cap: float, qs: Sequence[str]) -> str:
    """Per system and quantity: the ratios where it starts / stops beating on-demand LRU."""
    sub = runs[np.isclose(runs["_cap"], cap)]
    lines = ["| system | " + " | ".join(f"{q.upper()}: crossings (copy/compute, mean [95 % CI] "
                                         "over seeds)" for q in qs) + " |",
             "|---|" + "---|" * len(qs)]
    for s in [s for s in dict.fromkeys(sub["system"]) if s not in (REFERENCE, ON_DEMAND)]:
        cells = []
        for q in qs:
            col = f"{q}_vs_{ON_DEMAND}_pct"
            per_seed = []
            for _, g in sub[sub["system"] == s].groupby("dataset.seed"):
                g = g.sort_values("_x")
                d = pd.to_numeric(g[col], errors="coerce").to_numpy(float)
                if not np.isfinite(d).any():
                    continue
                per_seed.append((_crossings(g["_x"].to_numpy(float), d), float(np.nanmean(d))))
            cells.append(_crossing_cell(per_seed))
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _crossing_cell(per_seed: list[tuple[list[tuple[float, str]], float]]) -> str:
    if not per_seed:
        return "n/a"
    kinds = {tuple(k for _, k in c) for c, _ in per_seed}
    if kinds == {()}:
        signs = {m < 0 for _, m in per_seed}
        return "none: faster everywhere" if signs == {True} else \
            "none: slower everywhere" if signs == {False} else "none (sign differs by seed)"
    if len(kinds) > 1:
        return "differs by seed: " + "; ".join(
            f"#{i} " + (", ".join(f"{k} {x:.2g}" for x, k in c) or "none")
            for i, (c, _) in enumerate(per_seed))
    parts = []
    for i, kind in enumerate(next(iter(kinds))):
        m, h, n = mean_ci([c[i][0] for c, _ in per_seed])
        parts.append(f"{kind} beating at {m:.2g}" + (f" [{m - h:.2g}, {m + h:.2g}]"
                                                     if math.isfinite(h) else "") + f" (n={n})")
    return "; ".join(parts)


def oracle_table(sub: pd.DataFrame, q: str) -> str:
    """Per ratio: the floor, each oracle, and the best exact non-oracle system (mean over
    seeds), each over no_offload's; the oracles' gap to the floor and to the best."""
    col = f"{q}_norm_mean" if q != "hit_rate" else "hit_rate"
    xs = _ratios(sub)
    others = [s for s in _systems(sub) if s not in ORACLES]
    lines = [*_header(f"{q} \\ copy/compute", xs)]
    best: list[tuple[str, float, float]] = []
    for x in xs:
        vals = [(s, *_f(r, col)) for s in others if (r := _at(sub, s, x)) is not None]
        vals = [v for v in vals if math.isfinite(v[1])]
        pick = max(vals, key=lambda v: v[1]) if q == "hit_rate" else min(vals, key=lambda v: v[1])
        best.append(pick)
    if q != "hit_rate":
        b = [_floor(sub, x, f"bound_{col}") for x in xs]
        lines.append("| bound (floor) | " + " | ".join(_pm(v, math.nan) for v in b) + " |")
    for o in ORACLES:
        cells = []
        for x, (_name, bm, _) in zip(xs, best, strict=True):
            r = _at(sub, o, x)
            m, h = _f(r, col) if r is not None else (math.nan, math.nan)
            rel = f" ({100 * (m / bm - 1):+.1f} % vs best)" if math.isfinite(m) else ""
            cells.append(_pm(m, h) + rel)
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    lines.append("| best exact non-oracle | " + " | ".join(
        f"{_pm(m, h)} ({s})" for s, m, h in best) + " |")
    return "\n".join(lines) + "\n"


def decomposition(sub: pd.DataFrame, xs: Sequence[float], expert_bytes: float) -> str:
    """Where the bytes and the stalls go, at the sweep points nearest ``xs``."""
    have = _ratios(sub)
    lines = ["| copy/compute | system | TPOT / on-demand [95 % CI] | copies per token: demand / "
             "prefetch used / wasted | bytes / on-demand's (paired) | wasted share of prefetched "
             "bytes | stall s: demand / late prefetch / behind other copies |",
             "|---|---|---|---|---|---|---|"]
    for want in xs:
        x = min(have, key=lambda v: abs(math.log(v / want)))
        for s in _systems(sub):
            r = _at(sub, s, x)
            if r is None:
                continue
            d, u, w = (_f(r, c)[0] / expert_bytes for c in (
                "h2d_demand_bytes_per_token", "prefetch_used_bytes_per_token",
                "prefetch_waste_bytes_per_token"))
            tp, th = _f(r, f"tpot_vs_{ON_DEMAND}_pct")
            bp, bh = _f(r, f"h2d_vs_{ON_DEMAND}_pct")
            share = w / (u + w) if u + w > 0 else math.nan
            st = [_f(r, c)[0] / 1000 for c in ("stall_demand_ms_total",
                                                "stall_late_prefetch_ms_total",
                                                "stall_link_ms_total")]
            lines.append(
                f"| {x:.3g} | {s} | {_ratio(tp, th)} | {d:.2f} / {u:.2f} / {w:.2f} | "
                f"{_ratio(bp, bh)} | " + (f"{share:.0%}" if math.isfinite(share) else "-")
                + " | " + " / ".join(f"{v:.3g}" for v in st) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    path = Path(argv[0])
    at = [float(v) for v in argv[1].split(",")] if len(argv) > 1 else [0.27, 12.0]
    rows, runs = _read(path)
    ttft = np.isfinite(pd.to_numeric(rows["ttft_norm_mean"], errors="coerce")).any()
    qs = ["tpot", "ttft"] if ttft else ["tpot"]
    eb = float(pd.to_numeric(rows["cost_expert_bytes"], errors="coerce").iloc[0])
    for cap in sorted(rows["_cap"].unique()):
        sub = rows[np.isclose(rows["_cap"], cap)]
        lo, hi = int(sub["n"].min()), int(sub["n"].max())
        print(f"## budget {cap:.0%} (n = {lo if lo == hi else f'{lo}-{hi}'} seeds per row)\n")
        for q in qs:
            print(metric_table(sub, f"{q}_norm_mean", f"{q.upper()} / no_offload",
                               bound=f"bound_{q}_norm_mean"))
            print(metric_table(sub, f"{q}_vs_{ON_DEMAND}_pct",
                               f"{q.upper()} change vs on-demand LRU, % (paired)", pct=True))
        print(metric_table(sub, "hit_rate", "hit rate"))
        print("Crossovers: where a system starts or stops beating on-demand LRU (the paired "
              "change crosses 0), per seed by log-linear interpolation between sweep points, "
              "within the swept ratios only:\n")
        print(crossover_table(runs, cap, qs))
        print("The oracles against the floor and against the best exact non-oracle system at "
              "each ratio (latency over no_offload's; for the hit rate, higher is better):\n")
        for q in [*qs, "hit_rate"]:
            print(oracle_table(sub, q))
        print("Where the bytes and the stalls go (copies = bytes / expert bytes; per token = "
              "per output token, the prefill's included; stalls summed over the test "
              "requests):\n")
        print(decomposition(sub, at, eb))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
