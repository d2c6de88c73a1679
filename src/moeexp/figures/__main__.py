"""``make figures`` / ``python -m moeexp.figures``: every figure whose results exist.

Reads ``results/experiments/<experiment>/**/summary.csv`` (newest per experiment; one row
per configuration with its mean and 95 % interval over the seeds, and
``summary_paired.csv`` beside it for FineMoE's paired changes) and writes PNG and PDF
files under ``results/figures/``. For a figure whose experiment has not
run yet it says which experiment to run instead.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from moeexp.figures import plots
from moeexp.figures.eviction_landscape import eviction_landscape
from moeexp.figures.load import latest_summary, read_summary
from moeexp.figures.regime_map import regime_map
from moeexp.paths import results_dir

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
    "real_routing_systems": ("real_routing", plots.system_bars),
    "eviction_landscape": ("eviction_landscape", eviction_landscape),
    "emoe_serving_latency": ("emoe_serving", plots.serving_latency),
    "emoe_serving_slo": ("emoe_serving", plots.slo_attainment),
}


def make_figures(results: Path, out: Path | None = None) -> tuple[list[Path], list[str]]:
    """Draw every figure with data; returns (written files, messages for missing ones)."""
    out = out or results / "figures"
    written: list[Path] = []
    missing: list[str] = []
    for stem, (experiment, fn) in FIGURES.items():
        summary = latest_summary(results, experiment)
        if summary is None:
            missing.append(f"{stem}: no results yet; run `python -m moeexp +experiment={experiment}`")
            continue
        fig = fn(read_summary(summary))
        out.mkdir(parents=True, exist_ok=True)
        for ext in ("png", "pdf"):
            path = out / f"{stem}.{ext}"
            fig.savefig(path, dpi=150)  # type: ignore[attr-defined]
            written.append(path)
        log.info("%s <- %s", stem, summary)
    return written, missing


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = sys.argv[1:] if argv is None else argv
    results = Path(args[0]) if args else results_dir()
    written, missing = make_figures(results)
    for m in missing:
        log.warning(m)
    log.info("wrote %d files under %s", len(written), results / "figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
