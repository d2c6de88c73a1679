"""The README's tables from a run's summary.csv (moeexp.landscape.study.COLUMNS).

    python experiments/eviction_landscape/tables.py results/experiments/eviction_landscape/<run>/summary.csv

Per source: the hit rate of every policy at every capacity (libCacheSim's under the
protection rule, with the largest |protected - native| gap of each), cells that held fewer
objects than their capacity marked `*`; then the ranking by mean hit rate over capacities.
"""

from __future__ import annotations

import math
import sys

import pandas as pd


def _fmt(h: float, full: bool) -> str:
    return ("-" if math.isnan(h) else f"{h:.3f}") + ("" if full else "*")


def source_table(sub: pd.DataFrame) -> str:
    caps = sorted(sub["capacity"].unique())
    prot = sub[sub["semantics"] == "protected"]
    nat = sub[sub["semantics"] == "native"]
    lines = ["| policy | " + " | ".join(f"{c:g}" for c in caps) + " | mean | max abs(prot - native) |",
             "|" + "---|" * (len(caps) + 3)]
    order = list(dict.fromkeys(sub["policy"]))
    for p in order:
        rows = prot[prot["policy"] == p].set_index("capacity")
        native_only = rows.empty
        if native_only:  # Belady: native only
            rows = nat[nat["policy"] == p].set_index("capacity")
        cells = [_fmt(float(rows.loc[c, "hit_rate"]), bool(rows.loc[c, "full"]))
                 if c in rows.index else "" for c in caps]
        mean = rows["hit_rate"].mean() if rows["full"].all() else float("nan")
        n = nat[nat["policy"] == p].set_index("capacity")["hit_rate"]
        gap = ("native only" if native_only else
               f"{(rows['hit_rate'] - n).abs().max():.4f}" if len(n) else "")
        label = f"`{p}`"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | "
                     f"{'' if math.isnan(mean) else f'{mean:.3f}'} | {gap} |")
    return "\n".join(lines)


def main(path: str) -> None:
    df = pd.read_csv(path)
    for src, sub in df.groupby("source", sort=False):
        print(f"\n### {src} ({int(sub['accesses'].iloc[0]):,} accesses)\n")
        print(source_table(sub))


if __name__ == "__main__":
    main(sys.argv[1])
