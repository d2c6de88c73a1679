"""`make figures` draws from results/ only and explains what is missing."""

from __future__ import annotations

import pandas as pd

from moeexp.figures.__main__ import FIGURES, make_figures


def _write(results, experiment, df):
    d = results / "experiments" / experiment / "2026-01-01"
    d.mkdir(parents=True)
    df.to_csv(d / "summary.csv", index=False)


def test_no_results_says_which_experiment_to_run(tmp_path):
    written, missing = make_figures(tmp_path)
    assert written == []
    assert len(missing) == len(FIGURES)
    assert any("+experiment=finemoe_vs_moeinfinity" in m for m in missing)


def test_figures_from_summaries(tmp_path):
    systems = ["deepspeed", "finemoe", "oracle"]
    _write(tmp_path, "finemoe_vs_moeinfinity", pd.DataFrame({
        "system": systems, "ttft_ms_mean": [3.0, 2.0, 1.0], "tpot_ms_mean": [2.0, 1.5, 1.0],
        "hit_rate": [0.3, 0.6, 0.9], "prediction_recall": [float("nan"), 0.7, 1.0]}))
    _write(tmp_path, "cache_size_sweep", pd.DataFrame({
        "system": ["deepspeed"] * 3, "cache.capacity": [0.25, 0.5, 1.0],
        "tpot_ms_mean": [3.0, 2.0, 1.0], "hit_rate": [0.3, 0.6, 1.0]}))
    _write(tmp_path, "sim_vs_engine", pd.DataFrame({
        "system": systems, "engine_ttft_ms_mean": [1.0, 2.0, 3.0], "sim_ttft_ms_mean": [1.1, 2.1, 2.9],
        "engine_tpot_ms_mean": [1.0, 2.0, 3.0], "sim_tpot_ms_mean": [1.2, 1.9, 3.1]}))
    written, missing = make_figures(tmp_path)
    names = {p.name for p in written}
    assert {"fig10_systems.png", "fig10_systems.pdf", "fig12_cache_size.png",
            "sim_vs_engine.pdf"} <= names
    assert all(p.stat().st_size > 1000 for p in written)
    assert len(missing) == len(FIGURES) - 3


def test_regime_map_draws_one_line_per_system_and_skips_not_applicable_rows():
    """A hand-built regime summary: two systems over three ratios at one budget, plus a
    not-applicable row (no TPOT) that must not be drawn."""
    import pandas as pd

    from moeexp.figures import plots

    rows = [{"system": s, "cache_capacity": "0.25", "copy_to_compute": r,
             "tpot_norm_mean": 1 + r * k, "hit_rate": 0.5} for s, k in (("a", 1), ("b", 2))
            for r in (0.3, 3.0, 30.0)]
    rows.append({"system": "na", "cache_capacity": "0.25", "copy_to_compute": 1.0,
                 "tpot_norm_mean": float("nan"), "hit_rate": float("nan")})
    fig = plots.regime_map(pd.DataFrame(rows))
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["a", "b"]
    assert list(lines[1].get_xdata()) == [0.3, 3.0, 30.0]
