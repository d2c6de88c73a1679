"""The eviction landscape's figure: drawn by `make figures` from the experiment's summary."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moeexp.figures.__main__ import FIGURES, make_figures


def _summary() -> pd.DataFrame:
    rows = []
    for src in ("tiny", "gpt_oss_20b"):
        for cap in (0.1, 0.5):
            rows.append(dict(source=src, family="moeexp", policy="lru", semantics="protected",
                             capacity=cap, hit_rate=cap, full=True))
            rows.append(dict(source=src, family="moeexp", policy="belady",
                             semantics="protected", capacity=cap, hit_rate=cap + 0.2, full=True))
            for sem, gap in (("protected", 0.0), ("native", -0.05)):
                rows.append(dict(source=src, family="libcachesim", policy="lcs.LRU",
                                 semantics=sem, capacity=cap, hit_rate=cap + gap, full=True))
                rows.append(dict(source=src, family="libcachesim", policy="lcs.ClockPro",
                                 semantics=sem, capacity=cap, hit_rate=0.01, full=False))
    return pd.DataFrame(rows)


def test_make_figures_draws_the_landscape(tmp_path: Path) -> None:
    """A summary.csv under results/experiments/eviction_landscape/ gives a PNG and a PDF."""
    assert FIGURES["eviction_landscape"][0] == "eviction_landscape"
    d = tmp_path / "experiments" / "eviction_landscape" / "2026-01-01_00-00-00"
    d.mkdir(parents=True)
    _summary().to_csv(d / "summary.csv", index=False)
    written, _ = make_figures(tmp_path)
    names = {p.name for p in written}
    assert {"eviction_landscape.png", "eviction_landscape.pdf"} <= names
    assert all(p.stat().st_size > 1000 for p in written)


def test_one_panel_per_source_and_semantics() -> None:
    """Two rows (protected, native) by one column per source; cells that were not full
    (ClockPro) are not drawn."""
    fig = FIGURES["eviction_landscape"][1](_summary())
    axes = fig.axes  # type: ignore[attr-defined]
    assert len(axes) == 4
    labels = {ln.get_label() for ax in axes for ln in ax.get_lines()}
    assert {"lru", "belady", "lcs.LRU"} <= labels and "lcs.ClockPro" not in labels
