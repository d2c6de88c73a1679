"""One function per figure. Each takes a summary DataFrame and returns a matplotlib Figure.

A summary row is one configuration over its prompt samples (``summary.csv``,
:mod:`moeexp.tracking.intervals`): ``<metric>`` is the mean over the seeds and
``<metric>_ci95`` the half-width of its 95 % Student-t interval, drawn as the error bar
(none when a row has one seed). Latency is drawn normalised to ``no_offload`` (the
``*_norm_mean`` metrics: the tiny model's absolute milliseconds mean little), falling back
to milliseconds for a summary without them. Lossy systems (restricted routing: a
``substitution_rate``, or eMoE by name) are hatched and labelled apart from the exact
ones: their latency belongs to a different model output. A row reported not applicable
is written ``n/a`` where its bar would be, never drawn as zero.

The names on the axes and in the legends are the configurations' labels (the config
names ``finemoe``, ``moe_infinity``, ..., and e.g. ``deepspeed+cache=lfu`` for a bundle run
with another cache: :mod:`moeexp.labels`), or the system names of a summary written
before labels.
Hit rate and prediction recall are drawn as separate panels: they are different metrics
(algorithms.md §8) and are never mixed. Where the paper gives a number (FineMoE's
reductions against its four baselines, algorithms.md §9) it is drawn beside ours; where it
gives an ordering only (the ablations), the ordering is written under the title.
Legends sit outside the axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from moeexp.figures.load import column
from moeexp.tracking.compare import PAPER_BASELINES, PAPER_CHANGES, paired_changes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Systems whose replay is lossy when the summary has no ``substitution_rate`` column.
LOSSY_SYSTEMS = frozenset({"emoe"})

#: Colours: exact systems, lossy systems, the paper's numbers.
EXACT, LOSSY, PAPER = "tab:blue", "tab:orange", "0.55"

#: The paper's orderings (algorithms.md §9), worst first.
PAPER_ORDER_PREDICTORS = ("hit_count", "speculative", "map_t", "map_ts", "map_tsd")
PAPER_ORDER_CACHES = ("lru", "lfu", "finemoe")

_LATENCY = {"ttft": ("ttft_norm_mean", "ttft_ms_mean"), "tpot": ("tpot_norm_mean", "tpot_ms_mean")}


def _fig(ncols: int, width: float = 4.2, height: float = 3.2,
         nrows: int = 1) -> tuple[Figure, np.ndarray]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes if nrows > 1 else axes[0]


def _need(df: pd.DataFrame, *names: str) -> str:
    c = column(df, *names)
    if c is None:
        raise KeyError(f"summary lacks a column named {names[0]!r}; has {list(df.columns)}")
    return c


def _num(df: pd.DataFrame, col: str) -> np.ndarray:
    """``df[col]`` as floats (NaN where missing or not a number, or no such column)."""
    if col not in df.columns:
        return np.full(len(df), np.nan)
    return pd.to_numeric(df[col], errors="coerce").to_numpy(float)


def _flag(df: pd.DataFrame, col: str) -> np.ndarray:
    """``df[col]`` as booleans: True, "True" or a number > 0 (a mean over seeds); False
    where missing."""
    if col not in df.columns:
        return np.zeros(len(df), bool)
    v = df[col]
    num = pd.to_numeric(v, errors="coerce").to_numpy(float)
    return (np.nan_to_num(num) > 0) | v.astype(str).str.lower().eq("true").to_numpy()


def _ci(df: pd.DataFrame, col: str) -> np.ndarray | None:
    """The 95 % half-widths of ``col`` (None when the summary has none: one seed each)."""
    err = _num(df, f"{col}_ci95")
    return None if not np.isfinite(err).any() else np.nan_to_num(err)


def latency(df: pd.DataFrame, q: str) -> tuple[str, str]:
    """(column, axis label) for latency ``q`` (ttft|tpot): normalised when present."""
    norm, ms = _LATENCY[q]
    if np.isfinite(_num(df, norm)).any():
        return norm, f"{q.upper()} / no_offload"
    return ms, f"{q.upper()} (ms)"


def is_lossy(df: pd.DataFrame, sys_c: str | None) -> np.ndarray:
    """Per row: a lossy system (restricted routing) or lossy expert format (quantised
    experts: ``expert_format_lossy``)?"""
    lossy = np.isfinite(_num(df, "substitution_rate")) | _flag(df, "expert_format_lossy")
    if sys_c is not None:  # a label's system: its name before the first "+"
        lossy |= df[sys_c].astype(str).str.split("+").str[0].isin(LOSSY_SYSTEMS).to_numpy()
    return lossy


def _not_applicable(df: pd.DataFrame) -> np.ndarray:
    if "status" not in df.columns:
        return np.zeros(len(df), bool)
    return (df["status"].astype(str) == "not_applicable").to_numpy()


def _bars(ax: Axes, df: pd.DataFrame, names: Sequence[str], name_c: str, metric: str,
          label: str, lossy: np.ndarray, offset: float = 0.0, width: float = 0.8) -> None:
    """One bar per name (its mean, 95 % error bar), lossy ones hatched, n/a ones written."""
    x = np.arange(len(names)) + offset
    first = [int(np.flatnonzero(df[name_c].astype(str).to_numpy() == n)[0]) for n in names]
    sub = df.iloc[first]
    vals, err = _num(sub, metric), _ci(sub, metric)
    colours = [LOSSY if lossy[i] else EXACT for i in first]
    bars = ax.bar(x, np.nan_to_num(vals), width, yerr=err, capsize=2, color=colours,
                  error_kw={"lw": 0.8}, edgecolor="black", linewidth=0.3)
    for bar, i, v in zip(bars, first, vals, strict=True):
        if lossy[i]:
            bar.set_hatch("//")
        if not np.isfinite(v):
            bar.set_height(0)
            bar.set_linewidth(0)
            ax.text(bar.get_x() + bar.get_width() / 2, 0.03, "n/a" if _not_applicable(df)[i]
                    else "-", ha="center", va="bottom", fontsize=7, rotation=90,
                    transform=ax.get_xaxis_transform())
    if metric.endswith("_norm_mean"):
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.set_ylabel(label)


def _names_axis(ax: Axes, names: Sequence[str], lossy_names: set[str]) -> None:
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels([f"{n} (lossy)" if n in lossy_names else n for n in names],
                       rotation=45, ha="right", fontsize=8)


def _legend_handles(lossy_any: bool, paper: bool) -> list[Any]:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=EXACT, edgecolor="black", label="exact system")]
    if lossy_any:
        handles.append(Patch(facecolor=LOSSY, edgecolor="black", hatch="//",
                             label="lossy (restricted routing: another output)"))
    if paper:
        handles.append(Patch(facecolor=PAPER, edgecolor="black", label="paper (FineMoE §9)"))
    return handles


def system_bars(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 10: TTFT and TPOT over no_offload's, hit rate and prediction recall per
    system (first dataset / budget), and FineMoE's paired change against each of its four
    baselines beside the paper's (second row, when the summary has them)."""
    sys_c = _need(df, "label", "system", "system.name")
    df, where = _first_of_other_keys(df)
    systems = list(dict.fromkeys(df[sys_c].astype(str)))
    lossy = is_lossy(df, sys_c)
    lossy_names = {str(s) for s, lo in zip(df[sys_c], lossy, strict=True) if lo}
    paired = _paired_for(df)
    fig, axes = _fig(4, width=3.6, height=3.4, nrows=2 if paired is not None else 1)
    top = axes[0] if paired is not None else axes
    panels = [latency(df, "ttft"), latency(df, "tpot"),
              ("hit_rate", "cache hit rate"), ("prediction_recall", "prediction recall")]
    for ax, (metric, label) in zip(top, panels, strict=True):
        _bars(ax, df, systems, sys_c, metric, label, lossy)
        _names_axis(ax, systems, lossy_names)
        if not np.isfinite(_num(df, metric)).any():
            ax.text(0.5, 0.5, "not measured\n(no prefill routing)" if metric.startswith("ttft")
                    else "not measured", transform=ax.transAxes, ha="center", fontsize=8)
            ax.set_yticks([])
    n = sorted({int(v) for v in _num(df, "n") if np.isfinite(v)}) if "n" in df else []
    top[0].set_title((f"mean, 95 % CI over {'/'.join(map(str, n))} seeds" if n and n != [1]
                      else "one prompt sample") + where, fontsize=8, loc="left")
    if paired is not None:
        _paired_row(axes[1], paired)
    fig.legend(handles=_legend_handles(bool(lossy.any()), paired is not None),
               loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _first_of_other_keys(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows at the first value of each other swept label (dataset, budget): one bar per
    system (a sweep over those has its own figure: cache_size, ...); and ``"; key=value"``
    naming the values kept ("" when nothing was swept)."""
    kept = []
    for c in ("dataset", "dataset.name", "cache.capacity", "cache_capacity"):
        if c in df.columns and df[c].astype(str).nunique() > 1:
            value = str(df[c].iloc[0])
            df = df[df[c].astype(str) == value]
            kept.append(f"{c.split('.')[0]}={value}")
    return df, "".join(f"; {k}" for k in kept)


def _paired_for(df: pd.DataFrame) -> pd.DataFrame | None:
    """FineMoE's paired changes: the summary's ``summary_paired.csv`` (``df.attrs``), else
    computed from the rows themselves (no interval); None without FineMoE or a baseline."""
    paired = df.attrs.get("paired")
    if paired is None or not len(paired):
        paired = paired_changes(df) if "system" in df.columns else pd.DataFrame()
    return paired if len(paired) else None


def _paired_row(axes: np.ndarray, paired: pd.DataFrame) -> None:
    """FineMoE's change (%) against each baseline, ours with its interval beside the paper's."""
    paired = paired.drop_duplicates("baseline")
    names = [b for b in PAPER_BASELINES if b in set(paired["baseline"])]
    by = paired.set_index("baseline").loc[names]
    x = np.arange(len(names))
    for ax, q, title in zip(axes, ("ttft", "tpot", "recall"),
                            ("TTFT", "TPOT", "prediction recall (paper: \"hit rate\")"),
                            strict=False):
        ok = (by["status"] == "ok").to_numpy()
        ours = np.where(ok, _num(by, f"{q}_pct"), np.nan)  # NaN: n/a, or undefined (recall 0)
        err = np.where(ok, np.nan_to_num(_num(by, f"{q}_pct_ci95")), 0)
        paper = np.array([PAPER_CHANGES[q].get(b) or np.nan for b in names], float)
        ax.bar(x - 0.2, np.nan_to_num(ours), 0.4, yerr=err, capsize=2, color=EXACT,
               edgecolor="black", linewidth=0.3, error_kw={"lw": 0.8})
        ax.bar(x + 0.2, np.nan_to_num(paper), 0.4, color=PAPER, edgecolor="black", linewidth=0.3)
        for i in range(len(names)):
            where = {"ha": "center", "va": "bottom", "rotation": 90,
                     "transform": ax.get_xaxis_transform()}
            if not np.isfinite(ours[i]):
                ax.text(x[i] - 0.2, 0.03, "-" if ok[i] else "n/a", fontsize=7, **where)
            if not np.isfinite(paper[i]):
                ax.text(x[i] + 0.2, 0.03, "none", fontsize=6, color="0.4", **where)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"FineMoE's change in {title.split(' (')[0]} (%)", fontsize=8)
        ax.set_title(f"vs each baseline: {title}", fontsize=8)
    axes[3].axis("off")
    axes[3].text(0, 0.5, "blue: ours, paired over the same\nprompts (mean, 95 % CI)\n"
                 "grey: FineMoE paper (Mixtral,\nRTX 3090); negative = faster",
                 fontsize=8, va="center")


def _line(ax: Axes, x: Any, y: Any, err: np.ndarray | None, **kw: Any) -> None:
    """A labelled line, and its 95 % error bars in the same colour when there are any."""
    (ln,) = ax.plot(x, y, marker="o", ms=3, lw=1, **kw)
    if err is not None:
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor=ln.get_color(), capsize=2, lw=0.8)


def _lines(df: pd.DataFrame, x: str, xlabel: str, panels: list[tuple[str, str]],
           group: tuple[str, ...] = ("label", "system", "system.name"), note: str = "",
           xlog: bool = False) -> Figure:
    """One line per group over ``x`` with 95 % error bars; lossy groups dashed."""
    x_c = _need(df, x)
    g_c = column(df, *group)
    fig, axes = _fig(len(panels))
    groups = list(dict.fromkeys(df[g_c])) if g_c else [None]
    lossy = is_lossy(df, g_c if g_c and g_c.split(".")[0] in ("system", "label") else None)
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for g in groups:
            mask = np.ones(len(df), bool) if g is None else (df[g_c] == g).to_numpy()
            sub = df[mask].copy()
            sub["_x"] = pd.to_numeric(sub[x_c], errors="coerce")
            sub = sub.sort_values("_x")
            err = _ci(sub, metric)
            dashed = bool(lossy[mask].any())
            _line(ax, sub["_x"], _num(sub, metric), err, ls="--" if dashed else "-",
                  label=f"{g} (lossy)" if dashed and g is not None else str(g or metric))
        if metric.endswith("_norm_mean"):
            ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if xlog:
            ax.set_xscale("log")
    if note:
        fig.suptitle(note, fontsize=8)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _seed_note(df: pd.DataFrame) -> str:
    n = sorted({int(v) for v in _num(df, "n") if np.isfinite(v)})
    return f"mean and 95 % CI over {'/'.join(map(str, n))} prompt samples" if n and n != [1] \
        else ""


def cache_size(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 12: TPOT over no_offload's and hit rate against the expert-cache budget."""
    return _lines(df, "capacity", "expert cache (fraction of all expert bytes)",
                  [latency(df, "tpot"), ("hit_rate", "cache hit rate")], note=_seed_note(df))


def prefetch_distance(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 4: prediction recall and hit rate against the prefetch distance d."""
    return _lines(df, "prefetch_distance", "prefetch distance d (layers)",
                  [("prediction_recall", "prediction recall"), ("hit_rate", "cache hit rate")],
                  note=_seed_note(df))


def ablation(df: pd.DataFrame, key: tuple[str, ...], title: str,
             paper_order: Sequence[str] = ()) -> Figure:
    """FineMoE Fig. 14: one bar per predictor (or cache policy): recall, hit rate, TPOT over
    no_offload's; the paper's ordering (worst first) under the title."""
    k_c = _need(df, *key)
    names = [str(n) for n in dict.fromkeys(df[k_c])]
    lossy = is_lossy(df, None)
    panels = [("prediction_recall", "prediction recall"), ("hit_rate", "cache hit rate"),
              latency(df, "tpot")]
    fig, axes = _fig(len(panels))
    for ax, (metric, label) in zip(axes, panels, strict=True):
        _bars(ax, df, names, k_c, metric, label, lossy)
        _names_axis(ax, names, set())
    sub = " < ".join(p for p in paper_order)
    note = "; ".join(s for s in (_seed_note(df), f"paper: {sub}" if sub else "") if s)
    fig.suptitle(f"{title}\n{note}" if note else title, fontsize=9)
    fig.tight_layout()
    return fig


def store_capacity(df: pd.DataFrame) -> Figure:
    """FineMoE Fig. 16a: prediction recall and TPOT over no_offload's against the map-store
    capacity."""
    return _lines(df, "store_capacity", "expert-map store capacity (rows)",
                  [("prediction_recall", "prediction recall"), latency(df, "tpot")],
                  note=_seed_note(df), xlog=True)


def emoe_quality(df: pd.DataFrame) -> Figure:
    """eMoE Fig. 10 / tables: quality against experts kept per layer and reuse period p
    (every line is lossy by design: restricted routing)."""
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
                  group=("period", "variant") if x_c.endswith("experts_per_layer") else ("variant",),
                  note=_seed_note(df))


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


def serving_latency(df: pd.DataFrame) -> Figure:
    """``+experiment=emoe_serving``: end-to-end latency (p50, p99) and queueing delay against
    the arrival rate, one line per system bundle (95 % error bars over the seeds); eMoE's
    bundles are lossy (restricted routing) and dashed."""
    return _rate_ticks(df, _lines(
        df, "backend.arrival_rate", "arrival rate (requests/s)",
        [("e2e_ms_p50", "end-to-end p50 (ms)"), ("e2e_ms_p99", "end-to-end p99 (ms)"),
         ("queue_ms_mean", "queueing delay, mean (ms)")], note=_seed_note(df), xlog=True))


def slo_attainment(df: pd.DataFrame) -> Figure:
    """``+experiment=emoe_serving``: SLO attainment, goodput and throughput against the
    arrival rate, one line per system bundle (95 % error bars over the seeds)."""
    return _rate_ticks(df, _lines(
        df, "backend.arrival_rate", "arrival rate (requests/s)",
        [("slo_attainment", "SLO attainment (TTFT and end-to-end)"),
         ("goodput_rps", "goodput (requests/s within SLO)"),
         ("throughput_rps", "throughput (requests/s)")], note=_seed_note(df), xlog=True))


def _rate_ticks(df: pd.DataFrame, fig: Figure) -> Figure:
    """Label a log arrival-rate axis at the measured rates only (no overlapping minor labels)."""
    from matplotlib.ticker import NullFormatter, NullLocator

    rates = sorted(set(_num(df, _need(df, "backend.arrival_rate"))) - {float("nan")})
    for ax in fig.axes:
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
    return fig
