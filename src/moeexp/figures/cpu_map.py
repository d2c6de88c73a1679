"""The CPU regime map (issue 26): who wins where when missed experts can run on the host CPU.

Input: the per-run rows of ``+experiment=regime_map_cpu`` / ``regime_map_cpu_real`` /
``regime_map_cpu_formats`` (a sweep's ``summary_runs.csv``, or the shipped
``experiments/regime_map/summary_cpu_*_runs.csv``), or a sweep's ``summary.csv`` (one row
per point with each metric's mean and ``_ci95``). A *point* is (system, budget, CPU DRAM
bandwidth, expert format); a run adds its prompt sample / split (``dataset.seed``).

- :func:`load_runs` merges several runs files: a later file's rows replace the earlier rows
  with the same (system, budget, bandwidth, format, seed) (or, with ``whole_system``, every
  earlier row of a system it holds), so re-run rows of one system drop in without re-running
  the rest;
- copy-only systems (``execution == copy``: they never read the CPU) are run at one
  bandwidth and :func:`repeat_copy_only` repeats their rows across the axis (marked
  ``repeated``);
- :func:`point_stats` gives each point's mean and 95 % Student-t half-width over the seeds,
  and the paired change against on-demand LRU (``deepspeed``) at the same budget, format and
  seed (``<metric>_vs_lru_pct``);
- :func:`cpu_map` draws TPOT (and TTFT where the trace has a prefill) against the CPU's
  bandwidth, one line per system, one panel per budget; copy-only systems are dashed.

``python -m moeexp.figures.cpu_map RUNS.csv [RUNS.csv ...] --out FILE.png`` draws it from
shipped files.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moeexp.tracking.intervals import mean_ci

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("moeexp.figures.cpu_map")

#: on-demand LRU: the paired baseline
LRU = "deepspeed"
#: the sweep's columns -> the short names used here
_COLS = {"system": "system", "cache_capacity": "cap", "hardware.cpu.dram_gbps": "bw",
         "cost_expert_format": "fmt", "dataset.seed": "seed"}
#: what identifies one run
KEYS = ("system", "cap", "bw", "fmt", "seed")
_COLOURS = {"deepspeed": "tab:red", "finemoe": "tab:blue", "finemoe_no_semantic": "tab:blue",
            "fiddler": "tab:green", "llamacpp_cpu_moe": "tab:brown",
            "ktransformers": "tab:purple", "hybrimoe": "tab:orange",
            "hybrimoe_split_only": "tab:olive",
            "finemoe_cpu": "tab:cyan", "finemoe_cpu_no_semantic": "tab:cyan",
            # the rivals that prefetch, with the replay's execution.late_to_cpu (issue 27)
            "hybrimoe_late_cpu": "gold", "finemoe_cpu_late_cpu": "tab:gray",
            "finemoe_cpu_no_semantic_late_cpu": "tab:gray", "prefetch_if_pays_cpu": "black",
            "prefetch_if_pays": "black"}


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Column names without hydra's ``+``, the key columns under their short names."""
    df = df.rename(columns=lambda c: c.lstrip("+")).copy()
    if "cache_capacity" not in df.columns and "cache.capacity" in df.columns:
        df["cache_capacity"] = df["cache.capacity"]
    for src, dst in _COLS.items():
        if src in df.columns:
            df[dst] = df[src]
    if "fmt" not in df.columns:
        df["fmt"] = "dense"
    if "seed" not in df.columns:
        df["seed"] = 0
    df["fmt"] = df["fmt"].where(df["fmt"].astype(str) != "", np.nan).fillna("dense").astype(str)
    df["cap"] = pd.to_numeric(df["cap"], errors="raise").astype(float)
    df["bw"] = pd.to_numeric(df["bw"], errors="raise").astype(float)
    df["seed"] = pd.to_numeric(df["seed"], errors="raise").astype(int)
    if "execution" not in df.columns:
        df["execution"] = "copy"
    return df


def read_csv(path: Path, as_text: bool = False) -> pd.DataFrame:
    """``path`` as a frame; ``as_text``: every cell as its text ('' where empty)."""
    if as_text:
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    return pd.read_csv(path)


def runs_file(path: Path) -> Path:
    """``x_runs.csv`` itself, or the ``x_runs.csv`` beside a summary ``x.csv``."""
    path = Path(path)
    if path.stem.endswith("_runs"):
        return path
    runs = path.with_name(f"{path.stem}_runs.csv")
    if not runs.is_file():
        raise FileNotFoundError(f"{path}: no per-run file {runs.name} beside it (the intervals "
                                "and the pairing need one row per seed)")
    return runs


def load_runs(paths: Sequence[Path | str], whole_system: bool = False,
              as_text: bool = False) -> pd.DataFrame:
    """Merge the runs files ``paths`` in order (module docstring); one row per run key.
    ``as_text``: every column of the files kept as its text (to write the merged rows back
    unchanged); only the key columns are parsed."""
    if not paths:
        raise ValueError("load_runs: no file given")
    merged: pd.DataFrame | None = None
    for p in paths:
        df = normalise(read_csv(runs_file(Path(p)), as_text))
        df = df.drop_duplicates(list(KEYS), keep="last")
        if merged is not None:
            if whole_system:
                merged = merged[~merged["system"].isin(set(df["system"]))]
            merged = pd.concat([merged, df], ignore_index=True)
            merged = merged.drop_duplicates(list(KEYS), keep="last")
        else:
            merged = df
    assert merged is not None
    merged = merged.assign(repeated=False)
    return merged.reset_index(drop=True)


def repeat_copy_only(runs: pd.DataFrame) -> pd.DataFrame:
    """Copy-only systems' rows repeated at every bandwidth of their (budget, format) where
    they were not run (``repeated`` True): they do not read the CPU."""
    runs = runs if "repeated" in runs.columns else runs.assign(repeated=False)
    extra = []
    copy_rows = runs[runs["execution"].astype(str) == "copy"]
    for (cap, fmt), part in runs.groupby(["cap", "fmt"]):
        bws = set(part["bw"])
        for _, rows in copy_rows[(copy_rows["cap"] == cap) & (copy_rows["fmt"] == fmt)].groupby(
                ["system", "seed"]):
            src = rows.iloc[[0]]
            for bw in sorted(bws - set(rows["bw"])):
                extra.append(src.assign(bw=bw, repeated=True))
    return pd.concat([runs, *extra], ignore_index=True) if extra else runs


def point_stats(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per point: ``mean``, ``ci95``, ``n`` of ``metric`` over the seeds, and the paired %
    change against on-demand LRU at the same budget, format and seed (``lru_pct``,
    ``lru_pct_ci95``; NaN where LRU has no run); ``repeated`` when the rows were repeated."""
    lru = runs[runs["system"] == LRU].set_index(["cap", "fmt", "seed", "bw"])[metric]
    out = []
    for (system, cap, bw, fmt), part in runs.groupby(["system", "cap", "bw", "fmt"], sort=False):
        m, h, n = mean_ci(part[metric])
        base = [lru.get((cap, fmt, s, bw), np.nan) for s in part["seed"]]
        pct = 100.0 * (pd.to_numeric(part[metric]).to_numpy(float) / np.asarray(base, float) - 1)
        pm, ph, _ = mean_ci(pct)
        out.append({"system": system, "cap": cap, "bw": bw, "fmt": fmt, "mean": m, "ci95": h,
                    "n": n, "lru_pct": pm, "lru_pct_ci95": ph,
                    "repeated": bool(part["repeated"].all())})
    return pd.DataFrame(out)


def paired_pct(runs: pd.DataFrame, metric: str, a: str, b: str, cap: float, bw: float,
               fmt: str) -> tuple[float, float, int]:
    """(mean, 95 % half-width, n) of ``100 (a / b - 1)`` for ``metric`` paired on the seed
    at one point: how much faster (negative) system ``a`` is than ``b``."""
    at = runs[(runs["cap"] == cap) & (runs["bw"] == bw) & (runs["fmt"] == fmt)]
    x = at[at["system"] == a].set_index("seed")[metric]
    y = at[at["system"] == b].set_index("seed")[metric]
    seeds = sorted(set(x.index) & set(y.index))
    return mean_ci([100.0 * (float(x[s]) / float(y[s]) - 1) for s in seeds])


def _as_stats(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """:func:`point_stats` of runs, or a summary's own mean and ``_ci95`` per row."""
    df = normalise(df)
    if "n" in df.columns and f"{metric}_ci95" in df.columns and "dataset.seed" not in df.columns:
        return pd.DataFrame({"system": df["system"], "cap": df["cap"], "bw": df["bw"],
                             "fmt": df["fmt"], "mean": pd.to_numeric(df[metric], errors="coerce"),
                             "ci95": pd.to_numeric(df[f"{metric}_ci95"], errors="coerce"),
                             "repeated": False, "execution": df["execution"]})
    runs = repeat_copy_only(df.assign(repeated=False) if "repeated" not in df.columns else df)
    st = point_stats(runs, metric)
    kinds = runs.drop_duplicates("system").set_index("system")["execution"]
    return st.assign(execution=st["system"].map(kinds))


def cpu_map(df: pd.DataFrame, fmt: str = "dense") -> Figure:
    """TPOT (ms; TTFT beside it when any is finite) against the CPU's DRAM bandwidth, one
    line per system with 95 % error bars, one row of panels per budget, format ``fmt``.
    Copy-only systems are dashed (flat: they do not read the CPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in ("tpot_ms_mean", "ttft_ms_mean")
               if m in normalise(df).columns
               and np.isfinite(pd.to_numeric(normalise(df)[m], errors="coerce")).any()]
    stats = {m: _as_stats(df, m) for m in metrics}
    first = stats[metrics[0]]
    first = first[first["fmt"] == fmt]
    if first.empty:
        raise ValueError(f"cpu_map: no rows with expert format {fmt!r}")
    caps = sorted(first["cap"].unique())
    fig, axes = plt.subplots(len(caps), len(metrics), figsize=(5.2 * len(metrics), 3.6 * len(caps)),
                             squeeze=False)
    for i, cap in enumerate(caps):
        for j, m in enumerate(metrics):
            _panel(axes[i][j], stats[m], cap, fmt, m)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _panel(ax, st: pd.DataFrame, cap: float, fmt: str, metric: str) -> None:  # type: ignore[no-untyped-def]
    part = st[(st["cap"] == cap) & (st["fmt"] == fmt) & np.isfinite(st["mean"])]
    bws = sorted(part["bw"].unique())
    for system, rows in part.groupby("system", sort=False):
        rows = rows.sort_values("bw")
        err = np.nan_to_num(rows["ci95"].to_numpy(float))
        colour = _COLOURS.get(str(system))
        if str(rows["execution"].iloc[0]) == "copy":  # flat: one value across the axis
            y, e = float(rows["mean"].iloc[0]), float(err[0])
            ax.hlines(y, bws[0], bws[-1], colors=colour, linestyles="--", label=system)
            if e > 0:
                ax.fill_between([bws[0], bws[-1]], y - e, y + e, color=colour, alpha=0.15)
            continue
        ax.errorbar(rows["bw"], rows["mean"], yerr=err if err.any() else None, label=system,
                    capsize=2, marker="o", ms=3, color=colour)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(bws, [f"{b:g}" for b in bws])
    ax.minorticks_off()
    ax.set_xlabel("host CPU achieved DRAM bandwidth (GB/s)")
    ax.set_ylabel(f"{metric.split('_')[0].upper()} (ms)")
    ax.set_title(f"budget {cap:.0%}, {fmt}", fontsize=9)
    ax.grid(alpha=0.3, which="both")


def main(argv: list[str] | None = None) -> int:
    """``python -m moeexp.figures.cpu_map RUNS.csv ... --out FILE``: the map from files."""
    parser = argparse.ArgumentParser(prog="python -m moeexp.figures.cpu_map",
                                     description="the CPU regime map from runs files")
    parser.add_argument("files", nargs="+", help="runs files (x_runs.csv) or summaries beside them")
    parser.add_argument("--out", required=True, help="output image (png/pdf)")
    parser.add_argument("--format", default="dense", help="model.expert_format to draw")
    parser.add_argument("--whole-system", action="store_true",
                        help="a later file's systems replace all their earlier rows")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fig = cpu_map(load_runs(ns.files, ns.whole_system), ns.format)
    fig.savefig(ns.out, dpi=110)
    log.info("wrote %s", ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
