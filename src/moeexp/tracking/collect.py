"""``python -m moeexp.tracking.collect DIR`` (or ``moeexp collect DIR``): gather runs into one table.

Finds every complete run (a directory with ``metrics.json`` and its completion marker
``done.json``) under ``DIR``, writes ``DIR/collected.csv`` (one row per group of the swept
keys other than ``dataset.seed``: each metric's mean, its 95 % Student-t interval over the
seeds ``<metric>_ci95`` and ``n``), ``DIR/collected_runs.csv`` (one row per run: its Hydra
overrides as columns, then its metrics), ``DIR/collected_paired.csv`` (FineMoE's paired
changes against its baselines, when present) and ``DIR/collected.md``, and prints the
comparison table, as the end of a multirun does (:mod:`moeexp.tracking.summary`).
``--baseline SYSTEM`` sets the system the ``*_vs_SYSTEM_pct`` columns compare against
(default ``deepspeed``; ``none`` to omit them); ``--out PATH`` writes the csv elsewhere
(the other files beside it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from moeexp.tracking.results import find_runs
from moeexp.tracking.summary import write_summary

log = logging.getLogger("moeexp.tracking.collect")


def collect(root: str | Path, out: str | Path | None = None,
            baseline: str | None = "deepspeed", show: bool = True) -> Path:
    """Gather the runs under ``root``; returns the csv path. FileNotFoundError if none."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    csv = write_summary(root, Path(out) if out else root / "collected.csv", baseline,
                        show=show)
    if csv is None:
        partial = find_runs(root, complete=False)
        raise FileNotFoundError(f"no complete run under {root}: {len(partial)} incomplete "
                                f"(metrics.json without done.json)" if partial else
                                f"no run (metrics.json) under {root}")
    return csv


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="moeexp collect", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="directory to search for runs (metrics.json)")
    parser.add_argument("--out", default=None, help="csv path (default DIR/collected.csv)")
    parser.add_argument("--baseline", default="deepspeed",
                        help="system to compare against ('none' for no deltas)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    baseline = None if args.baseline.lower() == "none" else args.baseline
    try:
        collect(args.dir, args.out, baseline)
    except FileNotFoundError as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
