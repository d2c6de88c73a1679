"""The eviction landscape's figure (+experiment=eviction_landscape, issue 16).

Hit rate against capacity, one line per policy, one panel per routing source. Two rows:
the running layer protected (moeexp's policies through the simulator, and libCacheSim's
under the protection rule), and libCacheSim's native semantics. A cell whose policy held
fewer objects than its capacity (``full`` false) or could not run is left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

#: Policies drawn thick, in a fixed colour: the baselines a reader looks for first.
_EMPHASIS = {"belady": "black", "lcs.Belady": "black", "lru": "tab:red", "lcs.LRU": "tab:red",
             "finemoe": "tab:blue", "finemoe_scored": "tab:cyan", "lcs.LIRS": "tab:green",
             "lirs": "tab:green", "next_use_scored": "tab:purple"}


def eviction_landscape(df: pd.DataFrame) -> Figure:
    """The figure from the experiment's ``summary.csv`` (columns of
    :data:`moeexp.landscape.study.COLUMNS`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = df.copy()
    ok = df["full"].astype(str).str.lower().isin(("true", "1"))
    df.loc[~ok, "hit_rate"] = np.nan
    sources = list(dict.fromkeys(df["source"]))
    rows = [("protected", "running layer protected (moeexp; libCacheSim reordered)"),
            ("native", "libCacheSim native (its own rule on every request)")]
    fig, axes = plt.subplots(len(rows), len(sources), figsize=(4.6 * len(sources), 7.4),
                             squeeze=False, sharex=True, sharey=True)
    policies = list(dict.fromkeys(df["policy"]))
    # tab20b + tab20c: no pure red, blue or black, which _EMPHASIS keeps for the baselines
    palette = [plt.get_cmap(m)(i) for i in range(20) for m in ("tab20b", "tab20c")]
    others = [p for p in policies if p not in _EMPHASIS]
    colours = {p: _EMPHASIS.get(p, palette[others.index(p) % len(palette)] if p in others
                                else "grey") for p in policies}
    handles: dict[str, Line2D] = {}
    for r, (sem, title) in enumerate(rows):
        for c, src in enumerate(sources):
            ax = axes[r][c]
            sub = df[(df["source"] == src) & (df["semantics"] == sem)]
            if sem == "native":  # Belady has one (native) cell: keep its line in both rows
                sub = pd.concat([sub, df[(df["source"] == src) & (df["policy"] == "belady")]])
            for p in policies:
                line = sub[sub["policy"] == p].sort_values("capacity")
                if line.empty or line["hit_rate"].isna().all():
                    continue
                moeexp = not str(p).startswith("lcs.")
                (h,) = ax.plot(line["capacity"], line["hit_rate"], color=colours[p],
                               lw=2.2 if p in _EMPHASIS else 1.0,
                               ls="-" if moeexp else "--", marker="o" if moeexp else ".",
                               ms=4 if moeexp else 3, label=str(p))
                handles.setdefault(str(p), h)
            ax.set_title(f"{src}\n{title}", fontsize=8)
            ax.grid(alpha=0.3)
            if r == len(rows) - 1:
                ax.set_xlabel("capacity (fraction of all experts)")
            if c == 0:
                ax.set_ylabel("on-demand hit rate")
    fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=6.5,
               ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return fig
