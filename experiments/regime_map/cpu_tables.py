"""The CPU regime map's tables (issue 26) from one or more sweeps' per-run rows.

    python experiments/regime_map/cpu_tables.py RUNS.csv [RUNS.csv ...] [--whole-system]
        [--decomposition-bw 60] [--accuracy] [--cap 0.25] [--bw 60 100] [--systems a,b]
        [--write OUT.csv]

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
rate). With several formats: TPOT per system and format (paired against LRU in the same
format), the lowest system per format and bandwidth with its margin, and with
``--accuracy`` each format's measured accuracy (experiments/expert_formats/README.md: the
embedded tiny model's; a format is marked lossy by the runs' own ``expert_format_lossy``,
so gpt-oss's shipped MXFP4 is lossless on its trace).

``--cap`` / ``--bw`` / ``--systems`` keep only those budgets, bandwidths and systems;
``--write OUT.csv`` writes the merged, selected rows, cells unchanged: the runs to
``OUT_runs.csv`` and the per-point rows of the summaries beside the inputs (``x.csv``
beside ``x_runs.csv``, merged the same way) to ``OUT.csv`` (how the shipped
``summary_cpu_*`` files are assembled from several sweeps).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from moeexp.atomic import write_text
from moeexp.figures.cpu_map import (
    KEYS,
    LRU,
    load_runs,
    normalise,
    paired_pct,
    point_stats,
    read_csv,
    repeat_copy_only,
    runs_file,
)
from moeexp.tracking.intervals import mean_ci

#: measured on the tiny model (experiments/expert_formats/README.md, commit f7afa78): top-1
#: agreement with the dense model's next token, KL(dense || format) in nats; int4 has no
#: measurement (torchao's groups of 128 do not divide the tiny model's 64-wide rows), nor
#: MXFP4 (the engine does not hold it; for gpt-oss it is the shipped checkpoint: lossless).
#: The first field is the default; a run's own ``expert_format_lossy`` decides (:func:`lossy`)
ACCURACY = {"dense": ("lossless", "1.000", "0"),
            "int8": ("lossy", "0.993 ± 0.003", "0.0002 ± 0.0001"),
            "mxfp4": ("lossy", "not measured", "not measured"),
            "int4": ("lossy", "not measured", "not measured"),
            "hqq3": ("lossy", "0.915 ± 0.017", "0.0070 ± 0.0003"),
            "hqq2": ("lossy", "0.867 ± 0.007", "0.0157 ± 0.0013")}


def lossy(runs: pd.DataFrame, fmt: str) -> bool:
    """Whether format ``fmt`` changes the model's weights: the runs' own
    ``expert_format_lossy`` where they record it (gpt-oss's MXFP4: lossless), else
    :data:`ACCURACY`'s default (unknown formats: lossy)."""
    col = runs.get("expert_format_lossy")
    if col is not None:
        flags = col[runs["fmt"] == fmt].astype(str).str.lower()
        flags = flags[flags.isin(["true", "false"])]
        if len(flags):
            return bool((flags == "true").any())
    return ACCURACY.get(fmt, ("lossy",))[0] == "lossy"


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
    head = [f + (" (lossy)" if lossy(runs, f) else "") for f in fmts]
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
            mark = " (lossy)" if lossy(part, fmt) else ""
            n = part[~part["repeated"]].groupby(["system", "bw"])["seed"].nunique()
            seeds = f"{n.min()}" if n.min() == n.max() else f"{n.min()}-{n.max()} (cells without ± are one)"
            out += [f"### budget {cap:.0%}, experts {fmt}{mark}, {seeds} seed(s)", ""]
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


def format_winners(runs: pd.DataFrame, metric: str, cap: float) -> list[str]:
    """Per format and bandwidth at budget ``cap``: the lowest system, its mean, the
    runner-up, its paired margin over the runner-up (``supported`` when the interval excludes
    0) and its paired change against on-demand LRU in the same format."""
    lines = ["| format | CPU GB/s | lowest | ms | runner-up | lowest vs runner-up (paired %) "
             "| supported | lowest vs LRU, same format |", "|---|---|---|---|---|---|---|---|"]
    at = runs[runs["cap"] == cap]
    for fmt in [f for f in ACCURACY if f in set(at["fmt"])]:
        st = point_stats(at[at["fmt"] == fmt], metric)
        for bw, part in st.groupby("bw"):
            ranked = part[part["mean"].notna()].sort_values("mean")
            if len(ranked) < 2:
                continue
            a, b = ranked.iloc[0], ranked.iloc[1]
            m, h, _ = paired_pct(at, metric, a["system"], b["system"], cap, bw, fmt)
            ok = "yes" if math.isfinite(h) and m + h < 0 else "no"
            name = fmt + (" (lossy)" if lossy(at, fmt) else "")
            lines.append(f"| {name} | {bw:g} | {a['system']} | {_cell(a['mean'], a['ci95'])} | "
                         f"{b['system']} | {_pct(m, h)} | {ok} | "
                         f"{_pct(a['lru_pct'], a['lru_pct_ci95'])} |")
    return lines


def format_section(runs: pd.DataFrame, accuracy: bool) -> list[str]:
    """The formats axis: TPOT per system and format at each (budget, bandwidth), and the
    lowest system per format and bandwidth."""
    out = ["### formats as an axis", ""]
    for cap in sorted(runs["cap"].unique()):
        for bw in sorted(runs[runs["cap"] == cap]["bw"].unique()):
            out += [f"TPOT (ms) at {cap:.0%}, {bw:g} GB/s (paired % vs on-demand LRU in the same "
                    "format; LRU's row: vs dense LRU):", "",
                    *format_table(runs, "tpot_ms_mean", cap, bw), ""]
        out += [f"TPOT at {cap:.0%}: the lowest system per format and bandwidth:", "",
                *format_winners(runs, "tpot_ms_mean", cap), ""]
    if accuracy:
        out += ["Accuracy: measured on the embedded tiny model (experiments/expert_formats/"
                "README.md), not on the model whose routing is replayed; lossless/lossy is "
                "the runs' own flag.", "",
                "| format | lossy | top-1 agreement | KL (nats) |", "|---|---|---|---|"]
        for f, a in ACCURACY.items():
            if f not in set(runs["fmt"]):
                continue
            kind = "lossy" if lossy(runs, f) else "lossless"
            top1, kl = (a[1], a[2]) if kind == a[0] else ("1.000 (the shipped weights)", "0")
            out.append(f"| {f} | {kind} | {top1} | {kl} |")
        out.append("")
    return out


def select(df: pd.DataFrame, caps: Sequence[float] | None, bws: Sequence[float] | None,
           systems: Sequence[str] | None) -> pd.DataFrame:
    """The rows of normalised ``df`` at budgets ``caps``, bandwidths ``bws`` and of
    ``systems`` (None: all)."""
    keep = pd.Series(True, index=df.index)
    if caps:
        keep &= df["cap"].isin([float(c) for c in caps])
    if bws:
        keep &= df["bw"].isin([float(b) for b in bws])
    if systems:
        keep &= df["system"].isin(list(systems))
    return df[keep]


def _summary_rows(files: Sequence[str | Path], whole_system: bool) -> pd.DataFrame:
    """The per-point rows of the summaries beside runs ``files`` (text), merged as
    :func:`load_runs` merges runs, by (system, budget, bandwidth, format)."""
    point = [k for k in KEYS if k != "seed"]
    merged = pd.DataFrame()
    for f in files:
        runs = runs_file(Path(f))
        summary = runs.with_name(runs.name.removesuffix("_runs.csv") + ".csv")
        if not summary.is_file():
            raise FileNotFoundError(f"{runs}: no summary {summary.name} beside it")
        df = normalise(read_csv(summary, as_text=True)).drop_duplicates(point, keep="last")
        if whole_system and len(merged):
            merged = merged[~merged["system"].isin(set(df["system"]))]
        merged = pd.concat([merged, df], ignore_index=True).drop_duplicates(point, keep="last")
    return merged


def write_merged(files: Sequence[str | Path], out: Path, whole_system: bool,
                 caps: Sequence[float] | None, bws: Sequence[float] | None,
                 systems: Sequence[str] | None) -> tuple[int, int]:
    """Write the merged, selected runs of ``files`` to ``out``'s ``_runs.csv`` and their
    summaries' rows to ``out`` (cells as in the inputs); (runs, points) written."""
    short = {"cap", "bw", "fmt", "seed", "repeated"}
    parts = []
    for frame in (select(load_runs(files, whole_system, as_text=True), caps, bws, systems),
                  select(_summary_rows(files, whole_system), caps, bws, systems)):
        cols = [c for c in frame.columns if c not in short]
        parts.append(frame[cols].fillna(""))
    runs, points = parts
    write_text(out.with_name(f"{out.stem}_runs.csv"), runs.to_csv(index=False))
    write_text(out, points.to_csv(index=False))
    return len(runs), len(points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--whole-system", action="store_true")
    parser.add_argument("--decomposition-bw", type=float, default=60.0)
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--cap", type=float, nargs="+", help="budgets to keep")
    parser.add_argument("--bw", type=float, nargs="+", help="CPU bandwidths (GB/s) to keep")
    parser.add_argument("--systems", type=lambda v: v.split(","), help="systems to keep: a,b")
    parser.add_argument("--write", type=Path, help="write the merged rows to OUT.csv + OUT_runs.csv")
    ns = parser.parse_args(argv)
    if ns.write is not None:
        n_runs, n_points = write_merged(ns.files, ns.write, ns.whole_system, ns.cap, ns.bw,
                                        ns.systems)
        sys.stderr.write(f"wrote {n_runs} runs and {n_points} points to {ns.write}\n")
    runs = select(load_runs(ns.files, ns.whole_system), ns.cap, ns.bw, ns.systems)
    sys.stdout.write(report(runs, ns.decomposition_bw, ns.accuracy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
