"""The CPU regime map's tables (issue 26) from one or more sweeps' per-run rows.

    python experiments/regime_map/cpu_tables.py RUNS.csv [RUNS.csv ...] [--whole-system]
        [--decomposition-bw 60] [--accuracy]

Each file is a sweep's ``summary_runs.csv`` / a shipped ``summary_cpu_*_runs.csv`` (or a
summary with its ``_runs.csv`` beside it). The files are merged in order by (system,
budget, CPU bandwidth, expert format, seed), a later file's rows replacing the earlier
ones (``--whole-system``: a later file's systems replace *all* their earlier rows), so that
re-run rows of one system (e.g. ``hybrimoe`` after a change) drop in without re-running
the rest. Copy-only systems (deepspeed, finemoe, finemoe_no_semantic: they never read the
CPU) run at one bandwidth; their rows are repeated across the axis (marked ``=``).

Prints, per budget and format: TPOT and TTFT (ms, mean ± 95 % Student-t half-width over the
seeds) per system against the CPU's bandwidth, the lowest in bold; the same as a paired
change against on-demand LRU (``deepspeed``, same budget, format and seed); the winner at
each bandwidth with its paired margin over the runner-up (``supported`` when the interval
excludes 0); and the decomposition at ``--decomposition-bw`` (means over seeds: copy stall,
the GPU's wait on the CPU chain, CPU busy time, MB over the link per output token, hit
rate). With several formats, ``--accuracy`` adds each format's measured accuracy
(experiments/expert_formats/README.md).
"""

from __future__ import annotations

import argparse
import math
import sys

import pandas as pd

from moeexp.figures.cpu_map import LRU, load_runs, paired_pct, point_stats, repeat_copy_only
from moeexp.tracking.intervals import mean_ci

#: measured on the tiny model (experiments/expert_formats/README.md, commit f7afa78): top-1
#: agreement with the dense model's next token, KL(dense || format) in nats; int4 has no
#: measurement (torchao's groups of 128 do not divide the tiny model's 64-wide rows)
ACCURACY = {"dense": ("lossless", "1.000", "0"),
            "int8": ("lossy", "0.993 ± 0.003", "0.0002 ± 0.0001"),
            "int4": ("lossy", "not measured", "not measured"),
            "hqq3": ("lossy", "0.915 ± 0.017", "0.0070 ± 0.0003"),
            "hqq2": ("lossy", "0.867 ± 0.007", "0.0157 ± 0.0013")}


def _cell(mean: float, ci: float, digits: int = 1) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if not math.isfinite(ci) else f"{mean:.{digits}f} ± {ci:.{digits}f}"


def _pct(mean: float, ci: float) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:+.1f} %" if not math.isfinite(ci) else \
        f"{mean:+.1f} [{mean - ci:+.1f}, {mean + ci:+.1f}]"


def latency_table(st: pd.DataFrame, paired: bool = False) -> list[str]:
    """Markdown rows: system x bandwidth of :func:`point_stats` rows at one budget and
    format: mean ± ci (lowest in bold), or the paired % change against LRU."""
    bws = sorted(st["bw"].unique())
    lines = [f"| system | {' | '.join(f'{b:g} GB/s' for b in bws)} |",
             "|---|" + "---|" * len(bws)]
    best = {b: st[st["bw"] == b]["mean"].min() for b in bws}
    for system, rows in st.groupby("system", sort=False):
        cells = []
        for b in bws:
            r = rows[rows["bw"] == b]
            if r.empty:
                cells.append("")
                continue
            r0 = r.iloc[0]
            if paired:
                cells.append("—" if system == LRU else _pct(r0["lru_pct"], r0["lru_pct_ci95"]))
                continue
            cell = _cell(r0["mean"], r0["ci95"]) + (" =" if r0["repeated"] else "")
            cells.append(f"**{cell}**" if r0["mean"] == best[b] else cell)
        lines.append(f"| {system} | {' | '.join(cells)} |")
    return lines


def winners(runs: pd.DataFrame, st: pd.DataFrame, metric: str) -> list[str]:
    """Per bandwidth: the lowest mean, the runner-up, and the winner's paired margin."""
    lines = ["| CPU GB/s | lowest | runner-up | lowest vs runner-up (paired %) | supported |",
             "|---|---|---|---|---|"]
    for (cap, fmt, bw), part in st.groupby(["cap", "fmt", "bw"]):
        ranked = part[part["mean"].notna()].sort_values("mean")
        if len(ranked) < 2:
            continue
        a, b = ranked.iloc[0]["system"], ranked.iloc[1]["system"]
        m, h, _ = paired_pct(runs, metric, a, b, cap, bw, fmt)
        ok = "yes" if math.isfinite(h) and m + h < 0 else "no"
        lines.append(f"| {bw:g} | {a} | {b} | {_pct(m, h)} | {ok} |")
    return lines


def decomposition(runs: pd.DataFrame, bw: float) -> list[str]:
    """Per system at bandwidth ``bw`` (one budget and format): where the time goes."""
    lines = ["| system | TPOT ms | copy stall ms | GPU waits on CPU ms | CPU busy ms | "
             "h2d MB / token | hit rate |", "|---|---|---|---|---|---|---|"]
    at = runs[runs["bw"] == bw].copy()
    at["_mb_tok"] = at["h2d_bytes_total"] / at["output_tokens_total"] / 1e6
    cols = ["tpot_ms_mean", "stall_ms_total", "cpu_wait_ms_total", "cpu_ms_total", "_mb_tok",
            "hit_rate"]
    for c in cols:
        at[c] = pd.to_numeric(at.get(c), errors="coerce").fillna(0.0) if c in at else 0.0
    means = at.groupby("system", sort=False)[cols].mean().sort_values("tpot_ms_mean")
    for system, r in means.iterrows():
        lines.append(f"| {system} | {r['tpot_ms_mean']:.1f} | {r['stall_ms_total']:.0f} | "
                     f"{r['cpu_wait_ms_total']:.0f} | {r['cpu_ms_total']:.0f} | "
                     f"{r['_mb_tok']:.0f} | {r['hit_rate']:.3f} |")
    return lines


def format_table(runs: pd.DataFrame, metric: str, cap: float, bw: float) -> list[str]:
    """System x format at one budget and bandwidth: mean ± ci, and in brackets the paired
    change against on-demand LRU *in the same format* (the fair comparison); LRU's own row
    gives its change against dense LRU (what the format alone buys)."""
    at = runs[(runs["cap"] == cap) & (runs["bw"] == bw)]
    fmts = [f for f in ACCURACY if f in set(at["fmt"])]
    lru = at[at["system"] == LRU].set_index(["fmt", "seed"])[metric]
    head = [f + (" (lossy)" if ACCURACY[f][0] == "lossy" else "") for f in fmts]
    lines = [f"| system | {' | '.join(head)} |", "|---|" + "---|" * len(fmts)]
    for system, rows in at.groupby("system", sort=False):
        cells = []
        for f in fmts:
            r = rows[rows["fmt"] == f]
            if r.empty:
                cells.append("")
                continue
            base = "dense" if system == LRU else f
            pct = [100 * (float(v) / float(lru[(base, s)]) - 1)
                   for s, v in zip(r["seed"], r[metric], strict=True) if (base, s) in lru]
            m, h, _ = mean_ci(r[metric])
            pm, ph, _ = mean_ci(pct)
            cells.append(f"{_cell(m, h)} ({_pct(pm, ph)})")
        lines.append(f"| {system} | {' | '.join(cells)} |")
    return lines


def report(runs: pd.DataFrame, decomposition_bw: float = 60.0, accuracy: bool = False) -> str:
    """The markdown tables of merged runs (module docstring)."""
    runs = repeat_copy_only(runs)
    out: list[str] = []
    fmts = sorted(runs["fmt"].unique(), key=lambda f: list(ACCURACY).index(f)
                  if f in ACCURACY else 99)
    for cap in sorted(runs["cap"].unique()):
        for fmt in fmts:
            part = runs[(runs["cap"] == cap) & (runs["fmt"] == fmt)]
            if part.empty:
                continue
            lossy = " (lossy)" if ACCURACY.get(fmt, ("lossy",))[0] == "lossy" else ""
            n = part[~part["repeated"]].groupby(["system", "bw"])["seed"].nunique()
            seeds = f"{n.min()}" if n.min() == n.max() else f"{n.min()}-{n.max()} (cells without ± are one)"
            out += [f"### budget {cap:.0%}, experts {fmt}{lossy}, {seeds} seed(s)", ""]
            for metric, name in (("tpot_ms_mean", "TPOT"), ("ttft_ms_mean", "TTFT")):
                if metric not in part or not pd.to_numeric(part[metric], errors="coerce").notna().any():
                    continue
                st = point_stats(part, metric)
                out += [f"{name} (ms, mean ± 95 % interval over seeds; `=` a copy-only system's "
                        "rows repeated across the axis):", "", *latency_table(st), "",
                        f"{name} vs on-demand LRU (paired on the seed, % [95 % interval]):", "",
                        *latency_table(st, paired=True), "",
                        f"{name}: the lowest at each bandwidth:", "",
                        *winners(part, st, metric), ""]
            if decomposition_bw in set(part["bw"]):
                out += [f"Decomposition at {decomposition_bw:g} GB/s (ms summed over the test "
                        "requests, means over seeds):", "", *decomposition(part, decomposition_bw), ""]
    if len(fmts) > 1:
        out += format_section(runs, accuracy)
    return "\n".join(out) + "\n"


def format_section(runs: pd.DataFrame, accuracy: bool) -> list[str]:
    """The formats axis: TPOT per system and format at each (budget, bandwidth)."""
    out = ["### formats as an axis", ""]
    for cap in sorted(runs["cap"].unique()):
        for bw in sorted(runs[runs["cap"] == cap]["bw"].unique()):
            out += [f"TPOT (ms) at {cap:.0%}, {bw:g} GB/s (paired % vs on-demand LRU in the same "
                    "format; LRU's row: vs dense LRU):", "",
                    *format_table(runs, "tpot_ms_mean", cap, bw), ""]
    if accuracy:
        out += ["| format | lossy | top-1 agreement | KL (nats) |", "|---|---|---|---|"]
        out += [f"| {f} | {a[0]} | {a[1]} | {a[2]} |" for f, a in ACCURACY.items()
                if f in set(runs["fmt"])]
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--whole-system", action="store_true")
    parser.add_argument("--decomposition-bw", type=float, default=60.0)
    parser.add_argument("--accuracy", action="store_true")
    ns = parser.parse_args(argv)
    runs = load_runs(ns.files, ns.whole_system)
    sys.stdout.write(report(runs, ns.decomposition_bw, ns.accuracy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
