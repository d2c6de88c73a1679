"""``python -m moeexp.tracking.collect DIR`` (or ``moeexp collect DIR``): gather runs into one table.

Finds every complete run (a directory with ``metrics.json`` and its completion marker
``done.json``) under ``DIR``, writes
``DIR/collected.csv`` (one row per run: its Hydra overrides as columns, then its metrics)
and ``DIR/collected.md``, and prints the comparison table. ``--baseline SYSTEM`` sets the
system the ``*_vs_SYSTEM_pct`` columns compare against (default ``deepspeed``; ``none``
to omit them); ``--out PATH`` writes the csv elsewhere.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from moeexp.atomic import write_text
from moeexp.tracking.results import find_runs, gather, print_table, table_columns, to_markdown

log = logging.getLogger("moeexp.tracking.collect")


def collect(root: str | Path, out: str | Path | None = None,
            baseline: str | None = "deepspeed", show: bool = True) -> Path:
    """Gather the runs under ``root``; returns the csv path. FileNotFoundError if none."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    df = gather(root, baseline=baseline)
    if df.empty:
        partial = find_runs(root, complete=False)
        raise FileNotFoundError(f"no complete run under {root}: {len(partial)} incomplete "
                                f"(metrics.json without done.json)" if partial else
                                f"no run (metrics.json) under {root}")
    csv = Path(out) if out else root / "collected.csv"
    write_text(csv, df.to_csv(index=False))
    cols = table_columns(df, baseline)
    write_text(csv.with_suffix(".md"), to_markdown(df, cols))
    if show:
        print_table(df, cols, f"{root} ({len(df)} runs)")
    log.info("%d runs -> %s", len(df), csv)
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
