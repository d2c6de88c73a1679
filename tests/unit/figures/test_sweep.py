"""Figures of any sweep directory (``make figures SWEEP=DIR``), each configuration named."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moeexp.figures.__main__ import main, sweep_figures
from moeexp.figures.sweep import configuration_names, numeric_keys, sweep_figures_of
from moeexp.tracking.results import summarize
from moeexp.tracking.run_dir import write_done, write_metrics


def _job(root: Path, name: str, overrides: list[str], **metrics) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    write_metrics(d, {"model": "tiny", "hardware": "rtx3090_pcie4", "backend": "sim",
                      "predictor": "none", "tpot_norm_mean": 1.2, "ttft_norm_mean": 1.3,
                      "prediction_recall": 0.0, **metrics})
    write_done(d, {"overrides": overrides}, outputs=["metrics.json"])


@pytest.fixture
def sweep(tmp_path) -> Path:
    """The issue's shape: cache=lru,lfu x cache.capacity=0.125,0.25 x dataset=a,b."""
    i = 0
    for cache in ("lru", "lfu"):
        for cap in ("0.125", "0.25"):
            for ds in ("a", "b"):
                label = "deepspeed" if cache == "lru" else "deepspeed+cache=lfu"
                _job(tmp_path, f"{i}_{label}", ["system=deepspeed", f"cache={cache}",
                                                f"cache.capacity={cap}", f"dataset={ds}"],
                     system="deepspeed", cache=cache, label=label, dataset=ds,
                     hit_rate=float(cap) + (0.1 if cache == "lfu" else 0.0))
                i += 1
    return tmp_path


def test_lines_against_the_numeric_key_with_a_legend_naming_each_configuration(sweep) -> None:
    s = summarize(sweep, baseline=None)
    assert numeric_keys(s.rows, s.keys) == ["cache.capacity"]  # not cache: the label names it
    figs = sweep_figures_of(s.rows, s.keys)
    assert list(figs) == ["sweep_cache.capacity"]
    legend = [t.get_text() for t in figs["sweep_cache.capacity"].axes[-1].get_legend().get_texts()]
    assert legend == ["deepspeed, dataset=a", "deepspeed, dataset=b",
                      "deepspeed+cache=lfu, dataset=a", "deepspeed+cache=lfu, dataset=b"]
    # hit rate, TPOT and TTFT over no_offload's; no recall panel: nothing predicts
    assert [ax.get_ylabel() for ax in figs["sweep_cache.capacity"].axes] == \
        ["TPOT / no_offload", "TTFT / no_offload", "cache hit rate"]
    assert "model tiny" in figs["sweep_cache.capacity"]._suptitle.get_text()


def test_bars_without_a_numeric_key(tmp_path) -> None:
    for i, cache in enumerate(("lru", "lfu")):
        _job(tmp_path, str(i), ["system=deepspeed", f"cache={cache}"], system="deepspeed",
             cache=cache, hit_rate=0.1 * (i + 1))
    s = summarize(tmp_path, baseline=None)
    assert list(configuration_names(s.rows, s.keys)) == ["deepspeed", "deepspeed+cache=lfu"]
    fig = sweep_figures_of(s.rows, s.keys)["sweep_configurations"]
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["deepspeed", "deepspeed+cache=lfu"]  # labels from the runs' configs


def test_cli_writes_png_and_pdf_and_fails_clearly_without_runs(sweep, tmp_path, caplog) -> None:
    out = tmp_path / "figs"
    assert main(["--sweep", str(sweep), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["sweep_cache.capacity.pdf",
                                                     "sweep_cache.capacity.png"]
    assert sweep_figures(sweep)[0].parent == sweep / "figures"  # default: beside the runs
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--sweep", str(empty)]) == 1
    assert "no complete run" in caplog.text
