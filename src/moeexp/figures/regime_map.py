"""The regime map's figure (``+experiment=regime_map`` / ``regime_map_real``, issue 11).

Every exact system's latency against the copy-to-compute ratio (one expert copy over one
decode layer's compute; ``copy_to_compute`` in the summary), one row of panels per budget:

- TPOT (and TTFT, when the trace has a prefill) over ``no_offload``'s, log axes, with the
  provable floor ``bound_tpot_norm_mean`` / ``bound_ttft_norm_mean``
  (:mod:`moeexp.simulator.bound`) as a black dashed line normalised the same way;
- the same latency over on-demand loading's (``deepspeed``: on-demand LRU), linear in the
  ratio to DeepSpeed so that the crossovers (where a line crosses 1) are visible; error
  bars are the paired 95 % intervals of ``*_vs_deepspeed_pct`` (matched on the seed);
- the cache hit rate (resident *and* landed when the layer needs it).

Lines are means over the prompt samples (``dataset.seed``) with 95 % Student-t error bars.
``no_offload`` is the dotted line at 1 of the first panels, not a line of its own. The
paper's regime (copy / compute 10-20: Mixtral-8x7B over PCIe 4.0) is shaded. A row
reported not applicable (no TPOT) is left out, never drawn as zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from moeexp.figures.load import column

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: The baseline of the relative panels: on-demand LRU.
ON_DEMAND = "deepspeed"
#: The reference that every panel draws as its 1-line instead of a system line.
REFERENCE = "no_offload"
#: FineMoE's testbed regime (copy over decode-layer compute), shaded on every panel.
PAPER_REGIME = (10.0, 20.0)
#: Fixed colours for the systems a reader looks for first; the rest take tab10's order.
_COLOURS = {"deepspeed": "tab:red", "finemoe": "tab:blue", "finemoe_no_semantic": "tab:blue",
            "oracle": "0.35", "oracle_aggressive": "tab:purple",
            "moe_infinity": "tab:orange", "mixtral_offloading": "tab:green",
            "promoe": "tab:olive"}


def _num(df: pd.DataFrame, col: str) -> np.ndarray:
    """``df[col]`` as floats (NaN where missing, not a number, or no such column)."""
    if col not in df.columns:
        return np.full(len(df), np.nan)
    return pd.to_numeric(df[col], errors="coerce").to_numpy(float)


def _err(df: pd.DataFrame, col: str, scale: float = 1.0) -> np.ndarray | None:
    """The 95 % half-widths of ``col`` times ``scale``; None when there are none (one seed)."""
    e = _num(df, f"{col}_ci95") * scale
    return None if not np.isfinite(e).any() else np.nan_to_num(e)


def _col(df: pd.DataFrame, *names: str) -> str:
    c = column(df, *names)
    if c is None:
        raise KeyError(f"summary lacks a column named {names[0]!r}; has {list(df.columns)}")
    return c


def _panels(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(kind, quantity) of every panel of a row: latencies with data, then the hit rate."""
    out: list[tuple[str, str]] = []
    for q in ("tpot", "ttft"):
        if np.isfinite(_num(df, f"{q}_norm_mean")).any():
            out += [("norm", q), ("vs", q)]
    return [*out, ("hit", "hit_rate")]


def _draw(ax: Axes, x: np.ndarray, y: np.ndarray, err: np.ndarray | None, **kw: Any) -> None:
    ok = np.isfinite(x) & np.isfinite(y)
    if not ok.any():
        return
    (ln,) = ax.plot(x[ok], y[ok], marker="o", ms=3, lw=1.1, **kw)
    if err is not None:
        ax.errorbar(x[ok], y[ok], yerr=err[ok], fmt="none", ecolor=ln.get_color(),
                    capsize=2, lw=0.8)


def _bound(ax: Axes, sub: pd.DataFrame, ratio_c: str, sys_c: str, kind: str, q: str) -> None:
    """The floor ``bound_<q>_norm_mean`` (one value per link: the same for every system of
    a seed, so taken from the rows over the most seeds), over no_offload's (``norm``) or
    over on-demand loading's mean latency (``vs``). ``no_offload``'s rows are left out:
    every expert resident is another budget (its floor is 1)."""
    sub = sub[sub[sys_c] != REFERENCE]
    n = _num(sub, "n") if "n" in sub.columns else np.ones(len(sub))
    frame = pd.DataFrame({"x": _num(sub, ratio_c), "b": _num(sub, f"bound_{q}_norm_mean"),
                          "n": np.nan_to_num(n, nan=1.0)}).dropna()
    # the same for every system of a seed: take it from the rows with the most seeds
    frame = frame[frame["n"] == frame.groupby("x")["n"].transform("max")]
    b = frame.groupby("x")["b"].mean()
    if b.empty:
        return
    y = b.to_numpy()
    if kind == "vs":
        od = sub[sub[sys_c] == ON_DEMAND]
        od_y = pd.Series(_num(od, f"{q}_norm_mean"), index=_num(od, ratio_c)).groupby(level=0).mean()
        y = y / od_y.reindex(b.index).to_numpy()
    _draw(ax, b.index.to_numpy(float), y, None, color="black", ls="--", label="bound (floor)")


def _system_line(ax: Axes, pts: pd.DataFrame, ratio_c: str, kind: str, q: str, s: str,
                 colour: str) -> None:
    x = _num(pts, ratio_c)
    if kind == "norm":
        _draw(ax, x, _num(pts, f"{q}_norm_mean"), _err(pts, f"{q}_norm_mean"),
              color=colour, label=s)
    elif kind == "vs":
        col = f"{q}_vs_{ON_DEMAND}_pct"
        _draw(ax, x, 1 + _num(pts, col) / 100, _err(pts, col, 0.01), color=colour, label=s)
    else:
        _draw(ax, x, _num(pts, q), _err(pts, q), color=colour, label=s)


def _decorate(ax: Axes, kind: str, q: str, cap: float) -> None:
    ax.axvspan(*PAPER_REGIME, color="0.9", zorder=0, label="paper's regime (10-20)")
    ax.set_xscale("log")
    ax.set_xlabel("copy / decode-layer compute")
    name = q.upper()
    if kind == "norm":
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", lw=0.6, ls=":", label=REFERENCE)
        ax.set_ylabel(f"{name} / {REFERENCE}")
    elif kind == "vs":
        ax.axhline(1.0, color="tab:red", lw=0.6, ls=":")
        ax.set_ylabel(f"{name} / on-demand LRU ({ON_DEMAND})")
    else:
        ax.set_ylabel("cache hit rate (resident and landed)")
        ax.set_ylim(0, 1)
    ax.set_title(f"budget {cap:.0%}", fontsize=9)


def _labels(df: pd.DataFrame, sys_c: str, systems: list[str]) -> dict[str, str]:
    """Each system's legend label; one measured over fewer seeds than the most says so
    (``moe_infinity (n=1-2)``), so a point without error bars is not read as exact."""
    n = _num(df, "n")
    top = np.nanmax(n) if np.isfinite(n).any() else 1.0
    out = {}
    for s in systems:
        ns = n[(df[sys_c] == s).to_numpy()]
        ns = ns[np.isfinite(ns)]
        lo, hi = (int(ns.min()), int(ns.max())) if len(ns) else (int(top), int(top))
        out[s] = str(s) if lo == top else f"{s} (n={lo})" if lo == hi else f"{s} (n={lo}-{hi})"
    return out


def regime_map(df: pd.DataFrame) -> Figure:
    """The figure from a regime map's ``summary.csv`` (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys_c = _col(df, "system", "system.name")
    cap_c = _col(df, "cache_capacity", "cache.capacity")
    ratio_c = _col(df, "copy_to_compute")
    df = df[np.isfinite(_num(df, "tpot_norm_mean"))]
    caps = sorted(df[cap_c].astype(float).unique())
    panels = _panels(df)
    fig, axes = plt.subplots(len(caps), len(panels), figsize=(3.6 * len(panels), 3.1 * len(caps)),
                             squeeze=False)
    systems = [s for s in dict.fromkeys(df[sys_c]) if s != REFERENCE]
    tab = iter(plt.get_cmap("tab10").colors)  # type: ignore[attr-defined]
    colours = {s: _COLOURS.get(s) or next(tab) for s in systems}
    labels = _labels(df, sys_c, systems)
    for i, cap in enumerate(caps):
        sub = df[df[cap_c].astype(float) == cap]
        for ax, (kind, q) in zip(axes[i], panels, strict=True):
            for s in systems:
                pts = sub[sub[sys_c] == s].sort_values(ratio_c, key=lambda c: c.astype(float))
                _system_line(ax, pts, ratio_c, kind, q, labels[s], colours[s])
            if kind != "hit":
                _bound(ax, sub, ratio_c, sys_c, kind, q)
            _decorate(ax, kind, q, cap)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    for ax in axes[0][:-1]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[0][-1].legend(handles, labels, fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       frameon=False)
    n = pd.to_numeric(df.get("n", pd.Series(dtype=float)), errors="coerce")
    seeds = f"{int(n.min())}-{int(n.max())}" if n.notna().any() and n.min() != n.max() else \
        (f"{int(n.max())}" if n.notna().any() else "1")
    fig.suptitle(f"regime map: mean over {seeds} prompt samples, 95 % intervals; "
                 "bound = provable latency floor", fontsize=9)
    fig.tight_layout()
    return fig
