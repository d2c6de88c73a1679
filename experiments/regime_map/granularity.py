"""The README's copy-granularity tables from collected sweeps (issue 11).

    python experiments/regime_map/granularity.py SUMMARY.csv [SUMMARY.csv ...]

Each ``SUMMARY.csv`` is a ``moeexp collect`` of one granularity sweep (one row per system
and ``hardware.copy_chunk_mb``: each metric's mean over the seeds, ``<metric>_ci95`` its
95 % Student-t half-width, ``n``), with ``SUMMARY_runs.csv`` beside it (one row per run;
``*_vs_deepspeed_pct`` paired on the seed and the chunk size). Prints, per sweep, one row
per (copy granularity, system): TPOT and TTFT over no_offload's, the paired change against
on-demand LRU (``deepspeed``) as a ratio [95 % CI], the hit rate, the stalls, the bytes
over DeepSpeed's (paired) and the prefetches started / used / wasted; then each system's change
against its own whole-expert copies, paired on the seed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import tables as T  # experiments/regime_map/tables.py: run as a script, its directory is on sys.path

from moeexp.tracking.intervals import mean_ci

CHUNK = "hardware.copy_chunk_mb"



def _copies(chunk_mb: float, expert_bytes: float) -> str:
    """``whole`` or ``M MB (n chunks)``."""
    if not chunk_mb or chunk_mb * 1e6 >= expert_bytes:
        return "whole"
    return f"{chunk_mb:g} MB ({math.ceil(expert_bytes / (chunk_mb * 1e6))} chunks)"


def sweep_table(rows: pd.DataFrame) -> str:
    """One row per (chunk size, system), chunk sizes from whole copies to the smallest."""
    head = ["copies", "system", "copy/compute", "TPOT / no_offload", "TPOT / DeepSpeed (paired)",
            "TTFT / no_offload", "TTFT / DeepSpeed (paired)", "hit rate",
            "stall s: demand / late prefetch / link", "bytes / DeepSpeed's (paired)",
            "prefetches started / used / wasted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    chunks = sorted(rows[CHUNK].astype(float).unique(), key=lambda v: (v != 0, -v))
    for ch in chunks:
        for _, r in rows[rows[CHUNK].astype(float) == ch].iterrows():
            eb = T._f(r, "cost_expert_bytes")[0]
            st = " / ".join(f"{T._f(r, c)[0] / 1000:.3g}" for c in (
                "stall_demand_ms_total", "stall_late_prefetch_ms_total", "stall_link_ms_total"))
            cells = [_copies(ch, eb), str(r["system"]), f"{T._f(r, 'copy_to_compute')[0]:.3g}",
                     T._pm(*T._f(r, "tpot_norm_mean")), T._ratio(*T._f(r, "tpot_vs_deepspeed_pct")),
                     T._pm(*T._f(r, "ttft_norm_mean")), T._ratio(*T._f(r, "ttft_vs_deepspeed_pct")),
                     T._pm(*T._f(r, "hit_rate"), 2), st,
                     T._ratio(*T._f(r, "h2d_vs_deepspeed_pct")),
                     " / ".join(f"{T._f(r, c)[0]:,.0f}" for c in (
                         "prefetches_issued", "prefetches_used", "prefetches_wasted"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def vs_whole(runs: pd.DataFrame, qs: Sequence[str] = ("tpot_ms_mean", "h2d_bytes_total")) -> str:
    """Each system's change against its own whole-expert copies, % paired on the seed."""
    head = ["copies", "system", *[f"{q} vs whole copies, % [95 % CI]" for q in qs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    runs = runs.assign(_ch=runs[CHUNK].astype(float))
    for ch in sorted(runs["_ch"].unique(), reverse=True):
        if ch == 0:
            continue
        for s in dict.fromkeys(runs["system"]):
            cells = []
            for q in qs:
                base = runs[(runs["system"] == s) & (runs["_ch"] == 0)].set_index("dataset.seed")[q]
                cur = runs[(runs["system"] == s) & (runs["_ch"] == ch)].set_index("dataset.seed")[q]
                both = base.index.intersection(cur.index)
                d = 100 * (cur[both].to_numpy(float) / base[both].to_numpy(float) - 1)
                m, h, _ = mean_ci(list(d[np.isfinite(d)]))
                cells.append(T._pct(m, h))
            eb = float(runs["cost_expert_bytes"].iloc[0])
            lines.append(f"| {_copies(ch, eb)} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    for arg in argv:
        rows, runs = T._read(Path(arg))
        print(f"## {arg} (n = {int(rows['n'].min())}-{int(rows['n'].max())} seeds per row)\n")
        print(sweep_table(rows))
        print(vs_whole(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
