"""``python -m moeexp.bench [NAME ...] [--out DIR] [--list]``: run benchmarks, print a table."""

from __future__ import annotations

import argparse
import logging
import sys

from moeexp.bench import discover, format_table, run_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeexp.bench", description=__doc__)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(discover())})")
    ap.add_argument("--out", default="results/bench", help="directory of the JSON files")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.list:
        sys.stdout.write("\n".join(discover()) + "\n")
        return 0
    outcomes = run_all(args.names or None, args.out)
    sys.stdout.write(format_table(outcomes) + "\n")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
