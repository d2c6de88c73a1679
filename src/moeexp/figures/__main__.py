"""``make figures`` / ``python -m moeexp.figures``: every figure whose results exist.

Reads ``results/experiments/<experiment>/**/summary.csv`` (newest per experiment; one row
per configuration with its mean and 95 % interval over the seeds, and
``summary_paired.csv`` beside it for FineMoE's paired changes) and writes PNG and PDF
files under ``results/figures/``. For a figure whose experiment has not
run yet it says which experiment to run instead. The CPU regime map's experiments
(:data:`MERGED_SWEEPS`) are drawn from every sweep's ``summary_runs.csv`` merged.

``make figures SWEEP=DIR`` / ``python -m moeexp.figures --sweep DIR [--out OUT]``: the
figures of one sweep directory (any ``--multirun``, an experiment's or one's own) into
``OUT`` (default ``DIR/figures``), each configuration named by its label in the legend
(:mod:`moeexp.figures.sweep`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from moeexp.figures import plots
from moeexp.figures.cpu_map import cpu_map, load_runs
from moeexp.figures.eviction_landscape import eviction_landscape
from moeexp.figures.load import all_runs, latest_summary, read_summary
from moeexp.figures.regime_map import regime_map
from moeexp.figures.sweep import sweep_figures_of
from moeexp.paths import results_dir
from moeexp.tracking.results import summarize

log = logging.getLogger("moeexp.figures")

#: figure file stem -> (experiment that produces its data, plotting function)
FIGURES: dict[str, tuple[str, Callable[[pd.DataFrame], object]]] = {
    "fig10_systems": ("finemoe_vs_moeinfinity", plots.system_bars),
    "fig12_cache_size": ("cache_size_sweep", plots.cache_size),
    "fig4_prefetch_distance": ("prefetch_distance_sweep", plots.prefetch_distance),
    "fig14_predictor_ablation": (
        "predictor_ablation",
        lambda df: plots.ablation(df, ("system", "system.name", "predictor"),
                                   "prediction ablation", plots.PAPER_ORDER_PREDICTORS)),
    "fig14_cache_ablation": (
        "cache_ablation", lambda df: plots.ablation(df, ("cache", "cache.name"), "cache ablation",
                                                    plots.PAPER_ORDER_CACHES)),
    "fig16a_store_capacity": ("store_capacity_sweep", plots.store_capacity),
    "emoe_quality": ("emoe_accuracy", plots.emoe_quality),
    "sim_vs_engine": ("sim_vs_engine", plots.sim_vs_engine),
    "regime_map": ("regime_map", regime_map),
    "regime_map_real": ("regime_map_real", regime_map),
    "regime_map_cpu": ("regime_map_cpu", cpu_map),
    "regime_map_cpu_real": ("regime_map_cpu_real", cpu_map),
    "real_routing_systems": ("real_routing", plots.system_bars),
    "eviction_landscape": ("eviction_landscape", eviction_landscape),
    "emoe_serving_latency": ("emoe_serving", plots.serving_latency),
    "emoe_serving_slo": ("emoe_serving", plots.slo_attainment),
}

#: experiments run as several sweeps (the CPU map: copy-only systems at one bandwidth, the
#: CPU systems at every one, re-run rows of one system later): their figures merge every
#: sweep's runs, oldest first (:func:`moeexp.figures.cpu_map.load_runs`)
MERGED_SWEEPS = frozenset({"regime_map_cpu", "regime_map_cpu_real"})


def make_figures(results: Path, out: Path | None = None) -> tuple[list[Path], list[str]]:
    """Draw every figure with data; returns (written files, messages for missing ones)."""
    out = out or results / "figures"
    written: list[Path] = []
    missing: list[str] = []
    for stem, (experiment, fn) in FIGURES.items():
        if experiment in MERGED_SWEEPS:
            files = all_runs(results, experiment)
            if files:
                written += _save(fn(load_runs(files)), out, stem)
                log.info("%s <- %d sweeps of %s merged", stem, len(files), experiment)
                continue
        summary = latest_summary(results, experiment)
        if summary is None:
            missing.append(f"{stem}: no results yet; run `python -m moeexp +experiment={experiment}`")
            continue
        written += _save(fn(read_summary(summary)), out, stem)
        log.info("%s <- %s", stem, summary)
    return written, missing


def _save(fig: Any, out: Path, stem: str) -> list[Path]:
    """``fig`` as ``out/<stem>.png`` and ``.pdf`` (closed afterwards); the paths."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.{ext}" for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def sweep_figures(sweep: Path, out: Path | None = None) -> list[Path]:
    """The figures of the sweep directory ``sweep`` into ``out`` (default ``sweep/figures``):
    the generic ones (:mod:`moeexp.figures.sweep`) and, for a named experiment's sweep, its
    own (:data:`FIGURES`). FileNotFoundError when it holds no complete run."""
    sweep = Path(sweep)
    out = out or sweep / "figures"
    summary = summarize(sweep, baseline=None)
    if summary.runs.empty:
        raise FileNotFoundError(f"no complete run (metrics.json + done.json) under {sweep}")
    written: list[Path] = []
    for stem, fig in sweep_figures_of(summary.rows, summary.keys).items():
        written += _save(fig, out, stem)
    experiments = set(summary.rows.get("experiment", pd.Series(dtype=str)).astype(str))
    csv = sweep / "summary.csv"
    for stem, (experiment, fn) in FIGURES.items():
        if experiment not in experiments:
            continue
        try:
            drawn = fn(read_summary(csv) if csv.is_file() else summary.rows)
        except (KeyError, ValueError) as err:
            log.warning("%s (experiment %s) not drawn: %s", stem, experiment, err)
            continue
        written += _save(drawn, out, stem)
    log.info("%d figures of %s (%d runs) in %s", len(written) // 2, sweep, len(summary.runs), out)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m moeexp.figures",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("results", nargs="?", default=None,
                        help="results directory (default $MOEEXP_RESULTS or results/)")
    parser.add_argument("--sweep", default=None,
                        help="draw the figures of this sweep directory instead")
    parser.add_argument("--out", default=None, help="output directory")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(ns.out) if ns.out else None
    if ns.sweep:
        try:
            sweep_figures(Path(ns.sweep), out)
        except FileNotFoundError as err:
            log.error("%s", err)
            return 1
        return 0
    results = Path(ns.results) if ns.results else results_dir()
    written, missing = make_figures(results, out)
    for m in missing:
        log.warning(m)
    if missing:
        log.info("for the figures of one sweep (e.g. your own --multirun): "
                 "make figures SWEEP=<sweep dir>, or python -m moeexp.figures --sweep <dir>")
    log.info("wrote %d files under %s", len(written), out or results / "figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
