"""One function per figure. Each takes a summary DataFrame and returns a matplotlib Figure.

The system names on the axes are the config names (``finemoe``, ``moe_infinity``, ...).
Hit rate and prediction recall are drawn as separate panels: they are different metrics
(algorithms.md §8) and are never mixed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moeexp.figures.load import column

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _fig(ncols: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, np.ndarray]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def _need(df: pd.DataFrame, *names: str) -> str:
    c = column(df, *names)
    if c is None:
        raise KeyError(f"summary lacks a column named {names[0]!r}; has {list(df.columns)}")
    return c


def system_bars(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 10: TTFT, TPOT, hit rate and prediction recall per system (and dataset)."""
    sys_c = _need(df, "system", "system.name")
    ds_c = column(df, "dataset", "dataset.name")
    panels = [("ttft_ms_mean", "TTFT (ms)"), ("tpot_ms_mean", "TPOT (ms)"),
              ("hit_rate", "cache hit rate"), ("prediction_recall", "prediction recall")]
    fig, axes = _fig(len(panels))
    datasets = sorted(df[ds_c].unique()) if ds_c else [None]
    systems = list(dict.fromkeys(df[sys_c]))
    width = 0.8 / len(datasets)
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for k, ds in enumerate(datasets):
            sub = df if ds is None else df[df[ds_c] == ds]
            vals = [sub.loc[sub[sys_c] == s, metric].mean() if metric in sub else np.nan
                    for s in systems]
            ax.bar(np.arange(len(systems)) + k * width, vals, width, label=str(ds or ""))
        ax.set_xticks(np.arange(len(systems)) + width * (len(datasets) - 1) / 2)
        ax.set_xticklabels(systems, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(label)
    if ds_c:
        axes[0].legend(title="dataset", fontsize=7)
    fig.tight_layout()
    return fig


def _lines(df: pd.DataFrame, x: str, xlabel: str, panels: list[tuple[str, str]],
           group: tuple[str, ...] = ("system", "system.name")) -> Figure:
    x_c = _need(df, x)
    g_c = column(df, *group)
    fig, axes = _fig(len(panels))
    groups = list(dict.fromkeys(df[g_c])) if g_c else [None]
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for g in groups:
            sub = df if g is None else df[df[g_c] == g]
            sub = sub.groupby(x_c, as_index=False)[metric].mean().sort_values(x_c)
            ax.plot(sub[x_c], sub[metric], marker="o", label=str(g or metric))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def cache_size(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 12: TPOT and hit rate against the expert-cache budget."""
    return _lines(df, "capacity", "expert cache (fraction of all expert bytes)",
                  [("tpot_ms_mean", "TPOT (ms)"), ("hit_rate", "cache hit rate")])


def prefetch_distance(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 4: prediction recall and hit rate against the prefetch distance d."""
    return _lines(df, "prefetch_distance", "prefetch distance d (layers)",
                  [("prediction_recall", "prediction recall"), ("hit_rate", "cache hit rate")])


def ablation(df: pd.DataFrame, key: tuple[str, ...], title: str) -> Figure:
    """FineMoE Fig. 14: one bar per predictor (or cache policy): recall, hit rate, TPOT."""
    k_c = _need(df, *key)
    names = list(dict.fromkeys(df[k_c]))
    panels = [("prediction_recall", "prediction recall"), ("hit_rate", "cache hit rate"),
              ("tpot_ms_mean", "TPOT (ms)")]
    fig, axes = _fig(len(panels))
    for ax, (metric, label) in zip(axes, panels, strict=True):
        vals = [df.loc[df[k_c] == n, metric].mean() if metric in df else np.nan for n in names]
        ax.bar(range(len(names)), vals)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def store_capacity(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 16a: prediction recall and TPOT against the map-store capacity."""
    return _lines(df, "store_capacity", "expert-map store capacity (rows)",
                  [("prediction_recall", "prediction recall"), ("tpot_ms_mean", "TPOT (ms)")])


def emoe_quality(df: pd.DataFrame) -> Figure:
    """eMoE Fig. 10 / tables: quality against experts kept per layer and reuse period p."""
    panels = []
    for metric, label in (("perplexity", "perplexity"), ("greedy_agreement", "greedy agreement"),
                          ("substitution_rate", "substitution rate")):
        c = column(df, metric)
        if c is not None:
            panels.append((c, label))
    if not panels:
        raise KeyError("summary lacks quality columns (perplexity, greedy_agreement, ...)")
    x_c = _need(df, "experts_per_layer", "period")
    return _lines(df, x_c, x_c.split(".")[-1].replace("_", " "), panels,
                  group=("period", "variant") if x_c.endswith("experts_per_layer") else ("variant",))


def sim_vs_engine(df: pd.DataFrame) -> Figure:
    """Simulator against engine: TTFT and TPOT, one point per system (y = x is perfect)."""
    fig, axes = _fig(2, width=3.6, height=3.4)
    sys_c = column(df, "system", "system.name")
    for ax, m in zip(axes, ("ttft_ms_mean", "tpot_ms_mean"), strict=True):
        x, y = df[f"engine_{m}"], df[f"sim_{m}"]
        ax.scatter(x, y)
        if sys_c:
            for xi, yi, s in zip(x, y, df[sys_c], strict=True):
                ax.annotate(str(s), (xi, yi), fontsize=7)
        lo, hi = float(np.nanmin([x.min(), y.min()])), float(np.nanmax([x.max(), y.max()]))
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"engine {m.split('_')[0].upper()} (ms)")
        ax.set_ylabel(f"simulator {m.split('_')[0].upper()} (ms)")
    fig.tight_layout()
    return fig


def regime_map(df: pd.DataFrame) -> Figure:
    """The regime map (issue 11): TPOT over no_offload's and the cache hit rate against the
    copy-to-compute ratio (log axes), one line per system, one pair of panels per budget.
    Rows reported not applicable (no TPOT) are left out."""
    sys_c = _need(df, "system", "system.name")
    cap_c = _need(df, "cache_capacity", "cache.capacity")
    ratio_c = _need(df, "copy_to_compute")
    df = df[np.isfinite(pd.to_numeric(df.get("tpot_norm_mean"), errors="coerce"))]
    caps = sorted(df[cap_c].astype(float).unique())
    fig, axes = _fig(2 * len(caps), width=3.8)
    for i, cap in enumerate(caps):
        sub = df[df[cap_c].astype(float) == cap]
        for s in dict.fromkeys(sub[sys_c]):
            pts = sub[sub[sys_c] == s].sort_values(ratio_c)
            axes[2 * i].plot(pts[ratio_c], pts["tpot_norm_mean"], marker="o", ms=3, label=s)
            axes[2 * i + 1].plot(pts[ratio_c], pts["hit_rate"], marker="o", ms=3, label=s)
        axes[2 * i].set(xscale="log", yscale="log", xlabel="copy / decode-layer compute",
                        ylabel="TPOT / no_offload", title=f"budget {cap:.0%}")
        axes[2 * i + 1].set(xscale="log", xlabel="copy / decode-layer compute",
                            ylabel="cache hit rate", title=f"budget {cap:.0%}")
    axes[-1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    return fig
