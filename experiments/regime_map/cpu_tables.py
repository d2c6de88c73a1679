"""The CPU regime map's tables (issue 26) from a sweep's ``summary.csv``.

    python experiments/regime_map/cpu_tables.py <sweep dir>/summary.csv

Reads one row per system, budget and CPU bandwidth (``hardware.cpu.dram_gbps``): each
metric's mean over the seeds and ``<metric>_ci95`` (95 % Student-t half-width; empty with
one seed). Prints, per budget: TPOT and TTFT (ms) per system against the CPU's bandwidth
with the lowest marked, then the decomposition at each bandwidth (copy stall, the GPU's
wait for the CPU chain, the CPU's busy time, bytes over the link per output token, hit rate).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

AXIS = "hardware.cpu.dram_gbps"


def _cell(mean: float, ci: float) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.1f}" if not math.isfinite(ci) else f"{mean:.1f} ± {ci:.1f}"


def latency_table(df: pd.DataFrame, metric: str) -> list[str]:
    """Markdown rows: system x bandwidth, ``metric`` (ms) mean ± ci, the lowest in bold."""
    bws = sorted(df[AXIS].unique())
    lines = [f"| system | {' | '.join(f'{b:g} GB/s' for b in bws)} |",
             "|---|" + "---|" * len(bws)]
    best = {b: df[df[AXIS] == b][metric].min() for b in bws}
    for system, rows in df.groupby("system", sort=False):
        cells = []
        for b in bws:
            r = rows[rows[AXIS] == b]
            if r.empty:
                cells.append("")
                continue
            mean = float(r[metric].iloc[0])
            ci = float(r.get(f"{metric}_ci95", pd.Series([math.nan])).iloc[0])
            cell = _cell(mean, ci)
            cells.append(f"**{cell}**" if mean == best[b] else cell)
        lines.append(f"| {system} | {' | '.join(cells)} |")
    return lines


def decomposition(df: pd.DataFrame) -> list[str]:
    """Per system and bandwidth: where the time goes."""
    lines = ["| system | CPU GB/s | TPOT ms | copy stall ms | GPU waits on CPU ms | CPU busy ms | "
             "h2d MB / token | hit rate |", "|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values([AXIS, "tpot_ms_mean"]).iterrows():
        wait = r.get("cpu_wait_ms_total", math.nan)
        busy = r.get("cpu_ms_total", math.nan)
        per_tok = r["h2d_bytes_total"] / r["output_tokens_total"] / 1e6
        lines.append(f"| {r['system']} | {r[AXIS]:g} | {r['tpot_ms_mean']:.1f} | "
                     f"{r['stall_ms_total']:.0f} | {_num(wait)} | {_num(busy)} | "
                     f"{per_tok:.0f} | {r['hit_rate']:.3f} |")
    return lines


def _num(v: float) -> str:
    return "0" if not isinstance(v, float) or not math.isfinite(v) else f"{v:.0f}"


def main(path: str) -> None:
    df = pd.read_csv(path).rename(columns=lambda c: c.lstrip("+"))
    out: list[str] = []
    for cap, part in df.groupby("cache.capacity"):
        out += [f"### budget {float(cap):.0%}", "", "TPOT (ms, mean ± 95 % interval over seeds):",
                "", *latency_table(part, "tpot_ms_mean"), ""]
        if part["ttft_ms_mean"].notna().any():
            out += ["TTFT (ms):", "", *latency_table(part, "ttft_ms_mean"), ""]
        out += ["Decomposition:", "", *decomposition(part), ""]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(str(Path(sys.argv[1])))
