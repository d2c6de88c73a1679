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


def _seeded_sweep(root):
    """A sweep dataset.seed=0,1,2 x five systems as the experiments write it: emoe lossy
    (substitution_rate), mixtral_offloading not applicable; summarised by the callback."""
    from omegaconf import OmegaConf

    from moeexp.tracking.run_dir import write_done, write_metrics
    from moeexp.tracking.summary import summarize_dir

    tpot = {"no_offload": 1.0, "deepspeed": 1.5, "promoe": 1.3, "moe_infinity": 1.4,
            "finemoe": 1.2, "emoe": 1.0}
    job = 0
    for seed in range(3):
        for system in ["mixtral_offloading", *tpot]:
            d = root / f"{job}_{system}"
            (d / ".hydra").mkdir(parents=True)
            (d / ".hydra" / "overrides.yaml").write_text(
                OmegaConf.to_yaml([f"dataset.seed={seed}", f"system={system}"]))
            if system == "mixtral_offloading":
                m = {"status": "not_applicable", "system": system}
            else:
                t = tpot[system] * (1 + 0.02 * seed)
                m = {"status": "ok", "system": system, "tpot_ms_mean": t, "ttft_ms_mean": 3 * t,
                     "tpot_norm_mean": t / (1 + 0.02 * seed), "ttft_norm_mean": t,
                     "hit_rate": 0.5 + 0.01 * seed, "prediction_recall": 0.6 - 0.01 * seed}
                if system == "emoe":
                    m["substitution_rate"] = 0.3
            write_metrics(d, m)
            write_done(d, {}, outputs=["metrics.json"])
            job += 1
    return summarize_dir(root, show=False)


def test_system_bars_error_bars_lossy_na_and_the_papers_numbers(tmp_path):
    """Fig. 10 from a 3-seed summary: latency over no_offload's with 95 % error bars, the
    lossy eMoE bar hatched and labelled, the not-applicable system written n/a (no bar),
    and a second row with FineMoE's paired change beside the paper's (-74/-67/-56/-53 %
    TTFT), ours n/a against the not-applicable baseline."""
    from matplotlib.container import BarContainer

    from moeexp.figures import plots
    from moeexp.figures.load import read_summary

    def bar_groups(ax):
        return [c for c in ax.containers if isinstance(c, BarContainer)]

    df = read_summary(_seeded_sweep(tmp_path))
    assert "paired" in df.attrs and (df["n"] == 3).all()
    fig = plots.system_bars(df)
    axes = fig.axes
    assert len(axes) == 8
    assert axes[1].get_ylabel() == "TPOT / no_offload"
    bars = bar_groups(axes[1])[0]
    assert bars.errorbar is not None
    labels = [t.get_text() for t in axes[1].get_xticklabels()]
    assert labels[0] == "mixtral_offloading" and "emoe (lossy)" in labels
    hatched = [b.get_hatch() for b in bars.patches]
    assert hatched[labels.index("emoe (lossy)")] == "//" and hatched[1] is None
    assert bars.patches[0].get_height() == 0
    assert "n/a" in [t.get_text() for t in axes[1].texts]
    paper = [b.get_height() for b in bar_groups(axes[4])[1].patches]
    assert paper == [-74.0, -67.0, -56.0, -53.0]
    ours = bar_groups(axes[4])[0].patches
    assert ours[1].get_height() == 0 and "n/a" in [t.get_text() for t in axes[4].texts]
    assert ours[0].get_height() < 0  # FineMoE faster than deepspeed
    assert fig.legends  # outside the axes, not over the data


def test_line_figures_draw_error_bars_and_the_papers_ordering(tmp_path):
    """cache_size: TPOT over no_offload's with error bars when the summary has intervals;
    the cache ablation names the paper's ordering under its title."""
    from moeexp.figures import plots

    df = pd.DataFrame({"system": ["deepspeed"] * 3, "cache.capacity": [0.25, 0.5, 1.0],
                       "n": 3, "tpot_norm_mean": [1.3, 1.1, 1.0],
                       "tpot_norm_mean_ci95": [0.05, 0.02, 0.0], "hit_rate": [0.3, 0.6, 1.0],
                       "hit_rate_ci95": [0.01, 0.01, 0.0]})
    fig = plots.cache_size(df)
    assert fig.axes[0].get_ylabel() == "TPOT / no_offload"
    assert fig.axes[0].collections  # the error bars
    assert "3 prompt samples" in fig._suptitle.get_text()
    abl = pd.DataFrame({"cache": ["lru", "lfu", "finemoe"], "n": 3,
                        "prediction_recall": [0.7] * 3, "hit_rate": [0.5, 0.6, 0.7],
                        "hit_rate_ci95": [0.01] * 3, "tpot_norm_mean": [1.2, 1.1, 1.05]})
    fig = plots.ablation(abl, ("cache",), "cache ablation", plots.PAPER_ORDER_CACHES)
    assert "paper: lru < lfu < finemoe" in fig._suptitle.get_text()


def test_serving_figures_one_line_per_bundle_over_the_arrival_rate_lossy_dashed():
    """emoe_serving: a line per system bundle over the arrival rate with error bars; the
    eMoE bundle (lossy) is dashed and labelled so."""
    from moeexp.figures import plots

    rows = [{"system": s, "backend.arrival_rate": r, "n": 3, "e2e_ms_p50": 10 * r,
             "e2e_ms_p50_ci95": 1.0, "e2e_ms_p99": 20 * r, "queue_ms_mean": r,
             "slo_attainment": 1 / r, "goodput_rps": r / 2, "throughput_rps": r}
            for s in ("deepspeed", "emoe") for r in (50, 100, 200)]
    df = pd.DataFrame(rows)
    for fn in (plots.serving_latency, plots.slo_attainment):
        fig = fn(df)
        lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label()[0] != "_"]
        assert [ln.get_label() for ln in lines] == ["deepspeed", "emoe (lossy)"]
        assert list(lines[0].get_xdata()) == [50, 100, 200]
        assert lines[1].get_linestyle() == "--" and lines[0].get_linestyle() == "-"
    assert FIGURES["emoe_serving_slo"][0] == "emoe_serving"
