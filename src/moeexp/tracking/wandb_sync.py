"""``moeexp wandb-sync DIR ...``: upload the offline W&B runs of the *complete* jobs under DIR.

A job's directory holds at most one ``wandb/offline-run-*`` (a rerun removes the earlier
attempt's, :mod:`moeexp.tracking.loggers`), but a job killed before its completion marker
``done.json`` still holds the run of that attempt, without its final metrics. A plain
``wandb sync <sweep>/*/wandb/offline-run-*`` would upload it too; this command picks, for
every complete job (:func:`moeexp.tracking.results.find_runs`), the offline run whose id the
marker records, and runs ``wandb sync`` on exactly those (incomplete jobs are named in a
warning and left out)::

    moeexp wandb-sync results/experiments/cache_size_sweep/2026-11-30_10-00-00
    moeexp wandb-sync DIR --list                # print the run directories, upload nothing
    moeexp wandb-sync DIR -- --project other    # options after -- go to `wandb sync`
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from moeexp.tracking.results import find_runs
from moeexp.tracking.run_dir import read_done

log = logging.getLogger("moeexp.tracking.wandb_sync")


def complete_offline_runs(roots: Sequence[str | Path]) -> list[Path]:
    """The ``wandb/offline-run-*-<id>`` directories of the complete jobs under ``roots``
    (``<id>`` = the run id in the job's ``done.json``; jobs run with ``logger=none`` have
    none)."""
    out: list[Path] = []
    for root in roots:
        for run in find_runs(root):
            rid = (read_done(run) or {}).get("wandb_run_id")
            if rid:
                out.extend(sorted((run / "wandb").glob(f"offline-run-*-{rid}")))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(prog="moeexp wandb-sync",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="sweep, experiment or run directories")
    parser.add_argument("--list", action="store_true",
                        help="print the offline run directories instead of uploading them")
    ns = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    missing = [d for d in ns.dirs if not Path(d).is_dir()]
    if missing:
        log.error("not a directory: %s", ", ".join(missing))
        return 1
    runs = complete_offline_runs(ns.dirs)
    if not runs:
        log.error("no offline W&B run of a complete job under %s", ", ".join(ns.dirs))
        return 1
    if ns.list:
        sys.stdout.write("".join(f"{r}\n" for r in runs))
        return 0
    log.info("wandb sync of %d offline run(s) of complete jobs", len(runs))
    return subprocess.call([sys.executable, "-m", "wandb", "sync", *extra, *map(str, runs)])


if __name__ == "__main__":
    sys.exit(main())
