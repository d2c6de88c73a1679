"""Issue 27's tables: a system's runs paired on the seed against the shipped regime-map runs.

    python experiments/regime_map/issue27.py SHIPPED_RUNS.csv NEW_RUNS.csv [SYSTEM]

SHIPPED_RUNS.csv: ``summary_embedded_runs.csv`` or ``summary_real_runs.csv`` (one row per
run, c35401f); NEW_RUNS.csv: ``python -m moeexp collect <sweep dir> --out NEW_RUNS.csv`` of
the new system's sweep (``collected.csv``: one row per run). Per budget and link, markdown
rows: the system's TPOT change against the best exact non-oracle system at that point (the
lowest mean TPOT; paired on ``dataset.seed``, mean and 95 % Student-t interval over the
seeds), TTFT against FineMoE's where the trace has TTFT, the share of the gap between
on-demand LRU (``deepspeed``) and ``oracle_aggressive`` closed, in TPOT and in the bytes
over the link (``h2d_bytes_total``: what a copy-bound point pays), bytes over LRU's, hit rates
and ``predictor_query_us_mean``. A pair is made only where both runs replayed the same trace
(``trace_hash``); the script stops otherwise.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
from scipy import stats

EXACT = ("deepspeed", "mixtral_offloading", "promoe", "moe_infinity", "finemoe",
         "finemoe_no_semantic")


def normalised(df: pd.DataFrame) -> pd.DataFrame:
    """``dataset.seed`` also where a one-seed collect wrote it as ``seeds``."""
    if "dataset.seed" not in df.columns:
        df = df.assign(**{"dataset.seed": df["seeds"].astype(int)})
    return df


def interval(x: np.ndarray) -> str:
    """``mean [lo, hi]`` (95 % Student t) of paired changes x (in %)."""
    m = float(np.mean(x))
    if len(x) < 2:
        return f"{m:+.1f} (n=1)"
    h = float(stats.t.ppf(0.975, len(x) - 1) * np.std(x, ddof=1) / np.sqrt(len(x)))
    return f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}]"


def paired(new: pd.DataFrame, old: pd.DataFrame, system: str, col: str) -> np.ndarray:
    """100 (new / old[system] - 1) of ``col``, per seed (rows of one point)."""
    o = old[old.system == system].set_index("dataset.seed")
    n = new.set_index("dataset.seed")
    seeds = sorted(set(o.index) & set(n.index))
    if not seeds:
        return np.array([])
    bad = [s for s in seeds if o.loc[s, "trace_hash"] != n.loc[s, "trace_hash"]]
    if bad:
        raise SystemExit(f"{system}: seeds {bad} replayed another trace")
    return np.array([100.0 * (n.loc[s, col] / o.loc[s, col] - 1.0) for s in seeds])


def point_row(new: pd.DataFrame, old: pd.DataFrame, ttft: bool) -> list[str]:
    """One link's cells (``new``, ``old``: that budget's and link's runs)."""
    means = old[old.system.isin(EXACT)].groupby("system")["tpot_ms_mean"].mean()
    best = str(means.idxmin())
    ds = old[old.system == "deepspeed"].set_index("dataset.seed")
    oa = old[old.system == "oracle_aggressive"].set_index("dataset.seed")
    n = new.set_index("dataset.seed")
    seeds = sorted(set(n.index) & set(ds.index) & set(oa.index))
    def closed(col: str) -> list[float]:
        return [(ds.loc[s, col] - n.loc[s, col]) / (ds.loc[s, col] - oa.loc[s, col])
                for s in seeds]

    gap, byte_gap = closed("tpot_ms_mean"), closed("h2d_bytes_total")
    byt = paired(new, old, "deepspeed", "h2d_bytes_total") / 100.0 + 1.0
    cells = [f"{new['copy_to_compute'].iloc[0]:.3g}", f"{best}",
             interval(paired(new, old, best, "tpot_ms_mean")),
             interval(paired(new, old, "finemoe", "ttft_ms_mean")) if ttft else "n/a",
             f"{np.mean(gap):.2f}" if seeds else "-",
             f"{np.mean(byte_gap):.2f}" if seeds else "-",
             f"{np.mean(byt):.3f}",
             f"{new['hit_rate'].mean():.3f} / {ds['hit_rate'].mean():.3f} / "
             f"{oa['hit_rate'].mean():.3f}",
             f"{new['predictor_query_us_mean'].mean():.0f}", f"{len(new)}"]
    return cells


def main(shipped: str, fresh: str, system: str = "prefetch_if_pays") -> None:
    old, new = normalised(pd.read_csv(shipped)), normalised(pd.read_csv(fresh))
    new = new[(new.system == system) & (new.status == "ok")]
    ttft = bool(new["ttft_ms_mean"].notna().any())
    head = ("| copy/compute | best exact | TPOT vs best exact, % | TTFT vs FineMoE, % | "
            "gap LRU→oracle_aggr. closed | byte gap closed | bytes / LRU | "
            "hit: this / LRU / oracle_aggr. | query µs | n |")
    for cap, part in new.groupby("cache_capacity"):
        print(f"\nbudget {cap:g}\n\n{head}\n|" + "---|" * 10)
        for link, pt in sorted(part.groupby("hardware.h2d_gbps"), key=lambda t: -t[0]):
            ref = old[(old["cache_capacity"] == cap) & (old["hardware.h2d_gbps"] == link)]
            print("| " + " | ".join(point_row(pt, ref, ttft)) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
