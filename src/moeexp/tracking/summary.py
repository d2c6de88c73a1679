"""A Hydra callback that summarises a multirun: ``summary.csv`` + a printed comparison table.

Registered in ``conf/config.yaml`` under ``hydra.callbacks.summary``, so every multirun
(an experiment's own sweep or ``--multirun``) ends with, in the sweep directory:

- ``summary_runs.csv``: one row per job (its ``label``, the configuration that ran, e.g.
  ``deepspeed+cache=lfu`` (:mod:`moeexp.labels`), swept keys as columns, then every
  metric, then the ``<q>_vs_<baseline>_pct`` deltas against the baseline's own bundle,
  matched on the other swept keys and the seed; see :mod:`moeexp.tracking.results`);
- ``summary.csv``: one row per label and group of the swept keys other than ``dataset.seed``: each
  metric's mean over the seeds, its ``<metric>_ci95`` (half-width of the 95 % Student-t
  interval over the seeds) and ``n`` (see :mod:`moeexp.tracking.intervals`);
- ``summary_paired.csv``: when the sweep holds FineMoE and any of its four baselines,
  FineMoE's paired change against each (mean, interval, ``n``, the paper's number;
  :func:`moeexp.tracking.compare.paired_changes`);
- ``summary.md``: the tables as markdown (for experiment READMEs), intervals as ``±``,
  with a line saying what the ``*_vs_<baseline>_pct`` columns pair;
- the comparison table (and the paired changes) printed on stdout (rich) and logged.

Jobs run by the basic, joblib or submitit launchers all write into the sweep directory,
and ``on_multirun_end`` runs in the launching process, so the callback reads the jobs'
``metrics.json`` files from disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from moeexp.atomic import write_text
from moeexp.tracking.compare import comparison_markdown, interval_cell, paired_changes
from moeexp.tracking.results import (
    pairing_note,
    print_table,
    summarize,
    swept_keys,
    table_columns,
    to_markdown,
)

log = logging.getLogger(__name__)

SUMMARY_CSV = "summary.csv"
SUMMARY_RUNS_CSV = "summary_runs.csv"
SUMMARY_PAIRED_CSV = "summary_paired.csv"
SUMMARY_MD = "summary.md"

#: The first line of summary.md when a row folds several seeds.
INTERVAL_NOTE = ("Each row: mean ± 95 % interval (Student t over the n prompt samples, "
                 "`dataset.seed`); per-run rows in summary_runs.csv.\n\n")


def summarize_dir(sweep_dir: str | Path, baseline: str | None = "deepspeed",
                  title: str | None = None, show: bool = True) -> Path | None:
    """Write the summary files (module docstring) for the runs under ``sweep_dir``; print
    the tables.

    Returns the ``summary.csv`` path, or None (with a warning) when no run completed (a
    ``metrics.json`` with its ``done.json``; incomplete jobs are left out with a warning).
    """
    sweep_dir = Path(sweep_dir)
    return write_summary(sweep_dir, sweep_dir / SUMMARY_CSV, baseline, title, show)


def write_summary(root: Path, csv: Path, baseline: str | None = "deepspeed",
                  title: str | None = None, show: bool = True) -> Path | None:
    """The runs under ``root`` summarised into ``csv`` (the rows over the seeds), beside it
    ``<stem>_runs.csv``, ``<stem>_paired.csv`` (if any) and ``<stem>.md``; None when no run
    completed (with a warning)."""
    summary = summarize(root, baseline=baseline)
    runs, rows = summary.runs, summary.rows
    if runs.empty:
        log.warning("no complete run (metrics.json + done.json) under %s: no summary written",
                    root)
        return None
    write_text(csv.with_name(f"{csv.stem}_runs.csv"), runs.to_csv(index=False))
    write_text(csv, rows.to_csv(index=False))
    paired = paired_changes(runs)
    if len(paired):
        write_text(csv.with_name(f"{csv.stem}_paired.csv"), paired.to_csv(index=False))
    cols = table_columns(rows, baseline)
    note = INTERVAL_NOTE.replace("summary_runs", f"{csv.stem}_runs") \
        if (rows["n"] > 1).any() else ""
    pairs = pairing_note(runs, baseline, swept_keys(runs, summary.keys))
    # + each system against FineMoE's four baselines beside the paper's numbers, if present
    write_text(csv.with_suffix(".md"), note + to_markdown(rows, cols)
               + (f"\n{pairs}\n" if pairs else "") + comparison_markdown(runs))
    title = title or f"{root} ({len(runs)} runs)"
    if show:
        for regime, part in regime_tables(rows, summary.keys):
            text = print_table(part, cols, f"{title}{regime}{_seeds(part)}")
            log.debug("comparison table:\n%s", text)  # printed once above; also in the .md
        if pairs:
            log.info("%s", pairs.replace("`", ""))
        if len(paired):
            print_paired(paired)
    log.info("summary of %d runs in %d rows: %s", len(runs), len(rows), csv)
    return csv


#: Swept keys that change the cost regime a trace is replayed in (moeexp.costmodel.projection):
#: a sweep over them prints one table per regime, titled with it.
REGIME_KEYS = ("cost.as_model", "cost.expert_bytes_scale")


def regime_tables(rows: pd.DataFrame, keys: tuple[str, ...] | list[str]) -> list[tuple[str, pd.DataFrame]]:
    """``rows`` split by the swept cost projection (:data:`REGIME_KEYS`), each part with a
    title suffix naming its regime: the projection, the hardware profile and the
    copy-to-compute ratio (one expert copy over one decode layer's compute); one untitled
    part when no projection key varies."""
    split = [k for k in REGIME_KEYS if k in swept_keys(rows, keys)]
    if not split:
        return [("", rows)]
    out = []
    for _, part in rows.groupby(split, sort=False, dropna=False):
        first = part.iloc[0]
        onto = first.get("cost.as_model")
        onto = "the traced model's own costs" if onto is None or str(onto) in ("None", "null", "nan") \
            else f"projected onto {onto}"
        scale = first.get("cost.expert_bytes_scale")
        if "cost.expert_bytes_scale" in split:
            onto += f", expert bytes x{scale}"
        hw = f" on {first['hardware']}" if "hardware" in part.columns else ""
        ratio = ""
        if "copy_to_compute" in part.columns:
            ratio = f", copy/compute {pd.to_numeric(part['copy_to_compute']).median():.2f}"
        out.append((f" - cost regime: {onto}{hw}{ratio}", part))
    return out


def _seeds(rows: pd.DataFrame) -> str:
    n = sorted({int(x) for x in rows["n"]})
    if n == [1]:
        return ""
    return f" - mean ± 95 % interval (Student t) over n = {'/'.join(map(str, n))} seeds"


def print_paired(paired: pd.DataFrame) -> str:
    """Print FineMoE's paired changes (TTFT, TPOT) against each baseline; returns the text."""
    keys = list(paired.columns[:list(paired.columns).index("baseline")])
    shown = []
    for _, r in paired.iterrows():
        ok = r["status"] == "ok"
        cell = {q: interval_cell(r[q], r[f"{q}_ci95"], " ms" if q.endswith("_ms") else "%")
                if ok else str(r["status"]) if q == "ttft_pct" else "n/a"
                for q in ("ttft_pct", "tpot_pct", "ttft_ms", "tpot_ms")}
        shown.append({**{k: r[k] for k in keys}, "finemoe vs": r["baseline"],
                      "n": int(r["n"]) if ok else "-",
                      "TTFT change [95% CI]": cell["ttft_pct"], "TTFT paper": r["ttft_paper"],
                      "TPOT change [95% CI]": cell["tpot_pct"], "TPOT paper": r["tpot_paper"],
                      "TTFT ms": cell["ttft_ms"], "TPOT ms": cell["tpot_ms"]})
    df = pd.DataFrame(shown)
    for c in ("TTFT paper", "TPOT paper"):
        df[c] = [f"{v:+.0f}%" if isinstance(v, (int, float)) and v == v else "-" for v in df[c]]
    return print_table(df, list(df.columns), "FineMoE against each baseline: paired over the "
                       "same prompts (mean, 95 % Student-t interval over the seeds)")


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
