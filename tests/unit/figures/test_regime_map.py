"""The regime map's figure (moeexp.figures.regime_map): one line per system, the floor as a
line normalised like the systems, the on-demand-relative panels, no TTFT panels without a
prefill, not-applicable rows left out."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeexp.figures.regime_map import regime_map

RATIOS = (0.3, 3.0, 30.0)


def _summary(ttft: bool = True) -> pd.DataFrame:
    """no_offload, deepspeed and a prefetcher `a` over three ratios at two budgets; the
    prefetcher beats deepspeed below ratio 1 and loses above; a not-applicable row. The
    floor is the offloading systems' (no_offload's own floor, 1, must not be averaged in)."""
    rows = []
    for cap in ("0.25", "0.5"):
        for r in RATIOS:
            od = 1 + r
            bound = 1 + 0.5 * r
            for s, t in (("no_offload", 1.0), ("deepspeed", od), ("a", od * (0.9 if r < 1 else 1.2))):
                rows.append({
                    "system": s, "cache_capacity": cap, "copy_to_compute": r, "n": 3,
                    "tpot_norm_mean": t, "tpot_norm_mean_ci95": 0.01,
                    "tpot_vs_deepspeed_pct": 100 * (t / od - 1), "tpot_vs_deepspeed_pct_ci95": 2.0,
                    "ttft_norm_mean": 2 * t if ttft else np.nan,
                    "ttft_vs_deepspeed_pct": 100 * (t / od - 1) if ttft else np.nan,
                    # no_offload holds every expert: its floor is 1 (another budget)
                    "bound_tpot_norm_mean": 1.0 if s == "no_offload" else bound,
                    "bound_ttft_norm_mean": (1.0 if s == "no_offload" else 2 * bound)
                    if ttft else np.nan,
                    "hit_rate": 0.5})
    rows.append({"system": "na", "cache_capacity": "0.25", "copy_to_compute": 1.0,
                 "tpot_norm_mean": np.nan, "hit_rate": np.nan})
    return pd.DataFrame(rows)


def _lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()
            if not ln.get_label().startswith("_")}


def test_every_system_and_the_bound_are_lines_normalised_like_the_systems() -> None:
    fig = regime_map(_summary())
    # two budgets x (TPOT, TPOT/on-demand, TTFT, TTFT/on-demand, hit rate)
    assert len(fig.axes) == 10
    tpot = _lines(fig.axes[0])
    assert set(tpot) == {"deepspeed", "a", "bound (floor)", "no_offload"}
    assert tpot["a"][0] == list(RATIOS)
    assert tpot["bound (floor)"][1] == pytest.approx([1.15, 2.5, 16.0])
    ttft = _lines(fig.axes[2])
    assert ttft["bound (floor)"][1] == pytest.approx([2.3, 5.0, 32.0])


def test_the_on_demand_panel_shows_the_crossover_and_the_bound_over_deepspeed() -> None:
    fig = regime_map(_summary())
    vs = _lines(fig.axes[1])
    assert vs["a"][1] == pytest.approx([0.9, 1.2, 1.2])  # beats on-demand below 1, loses above
    assert vs["deepspeed"][1] == pytest.approx([1.0, 1.0, 1.0])
    assert vs["bound (floor)"][1] == pytest.approx([1.15 / 1.3, 2.5 / 4.0, 16.0 / 31.0])


def test_no_ttft_panels_without_a_prefill_and_no_not_applicable_line() -> None:
    fig = regime_map(_summary(ttft=False))
    assert len(fig.axes) == 6  # two budgets x (TPOT, TPOT/on-demand, hit rate)
    labels = {lab for ax in fig.axes for lab in _lines(ax)}
    assert "na" not in labels
    assert fig.axes[2].get_ylabel().startswith("cache hit rate")


def test_a_system_over_fewer_seeds_says_so_in_its_label() -> None:
    df = _summary()
    df.loc[df["system"] == "a", "n"] = 1
    labels = set(_lines(regime_map(df).axes[0]))
    assert "a (n=1)" in labels and "deepspeed" in labels
