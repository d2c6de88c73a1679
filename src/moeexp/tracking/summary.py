"""A Hydra callback that summarises a multirun: ``summary.csv`` + a printed comparison table.

Registered in ``conf/config.yaml`` under ``hydra.callbacks.summary``, so every multirun
(an experiment's own sweep or ``--multirun``) ends with, in the sweep directory:

- ``summary.csv``: one row per job (swept keys as columns, then every metric, then the
  ``<q>_vs_<baseline>_pct`` deltas; see :mod:`moeexp.tracking.results`);
- ``summary.md``: the comparison table as markdown (for experiment READMEs);
- the comparison table printed on stdout (rich) and logged.

Jobs run by the basic, joblib or submitit launchers all write into the sweep directory,
and ``on_multirun_end`` runs in the launching process, so the callback reads the jobs'
``metrics.json`` files from disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from moeexp.atomic import write_text
from moeexp.tracking.compare import comparison_markdown
from moeexp.tracking.results import gather, print_table, table_columns, to_markdown

log = logging.getLogger(__name__)

SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"


def summarize_dir(sweep_dir: str | Path, baseline: str | None = "deepspeed",
                  title: str | None = None, show: bool = True) -> Path | None:
    """Write ``summary.csv``/``summary.md`` for the runs under ``sweep_dir``; print the table.

    Returns the csv path, or None (with a warning) when no run completed (a ``metrics.json``
    with its ``done.json``; incomplete jobs are left out with a warning).
    """
    sweep_dir = Path(sweep_dir)
    df = gather(sweep_dir, baseline=baseline)
    if df.empty:
        log.warning("no complete run (metrics.json + done.json) under %s: no summary written",
                    sweep_dir)
        return None
    csv = sweep_dir / SUMMARY_CSV
    write_text(csv, df.to_csv(index=False))
    cols = table_columns(df, baseline)
    # + each system against FineMoE's four baselines beside the paper's numbers, if present
    write_text(sweep_dir / SUMMARY_MD, to_markdown(df, cols) + comparison_markdown(df))
    title = title or f"{sweep_dir} ({len(df)} runs)"
    if show:
        text = print_table(df, cols, title)
        log.debug("comparison table:\n%s", text)  # printed once above; also in summary.md
    log.info("summary of %d runs: %s", len(df), csv)
    return csv


class SummaryCallback(Callback):
    """At the end of a multirun, summarise the sweep directory.

    Args:
        baseline: the system the ``*_vs_<baseline>_pct`` columns compare against
            (``deepspeed``, FineMoE's on-demand baseline); None for no deltas.
        show: print the comparison table.
    """

    def __init__(self, baseline: str | None = "deepspeed", show: bool = True) -> None:
        self.baseline = baseline
        self.show = show

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        name = config.get("experiment_name") or "multirun"
        summarize_dir(sweep_dir, baseline=self.baseline, title=f"{name}: {sweep_dir}",
                      show=self.show)
