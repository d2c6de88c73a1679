"""The paper-testbed ladder (``+experiment=paper_testbed``, issue 25): FineMoE against its four
baselines at each rung, paired over the prompt samples, with the bytes / stall decomposition.

A rung is one bundle of ``conf/experiment/paper_testbed/`` (the ``experiment/paper_testbed``
column of ``summary_runs.csv``). FineMoE is ``finemoe_artifact`` (the V1 artifact's
selection) on the rungs the artifact ran and ``finemoe`` (the paper's selection) below; both
are shown on every rung, so rung (c), the paper's selection, is the step between the two rows
of rung (b). Every number is a cost projection of the embedded model's routing
(``cost.as_model``), never a measurement of Mixtral or Qwen.

``python -m moeexp.analysis.ladder SWEEP_DIR [SWEEP_DIR ...]`` prints the markdown tables.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from moeexp.tracking.compare import PAPER_CHANGES
from moeexp.tracking.intervals import SEED_KEY
from moeexp.tracking.repro_data import Stat, ok_rows, paired

RUNG_KEY = "experiment/paper_testbed"
BASELINES = ("deepspeed", "mixtral_offloading", "promoe", "moe_infinity")
#: baselines shown only when the sweep ran them (the artifact's own MoE-Infinity)
EXTRA_BASELINES = ("moe_infinity_artifact",)
FINEMOES = ("finemoe_artifact", "finemoe")


def _cell(st: Stat) -> str:
    if not st.ok():
        return "–"
    half = f" ±{st.half:.1f}" if math.isfinite(st.half) else ""
    return f"{st.mean:+.1f}%{half}"


def _mean(part: pd.DataFrame, system: str, metric: str) -> float:
    rows = ok_rows(part, "system", system)
    return float(pd.to_numeric(rows[metric], errors="coerce").mean()) if len(rows) else math.nan


def ladder_rows(runs: pd.DataFrame, metric: str = "tpot_ms_mean") -> pd.DataFrame:
    """One row per (projection, rung, FineMoE variant): its paired change in ``metric``
    against each baseline (mean ± 95 % half-width over the seeds), and its bytes copied and
    stall over deepspeed's."""
    out = []
    for (proj, rung), part in runs.groupby(["cost_as_model", RUNG_KEY], sort=True):
        for fm in FINEMOES:
            if fm not in set(part["system"]):
                continue
            row: dict[str, object] = {"projection": proj, "rung": rung, "finemoe": fm}
            extra = [b for b in EXTRA_BASELINES if b in set(runs["system"])]
            for b in (*BASELINES, *extra):
                row[f"vs {b}"] = _cell(paired(part, "system", fm, b, metric))
            for q, name in (("h2d_bytes_total", "bytes / DS"), ("stall_ms_total", "stall / DS")):
                x, y = _mean(part, fm, q), _mean(part, "deepspeed", q)
                row[name] = f"×{x / y:.2f}" if y and math.isfinite(x / y) else "–"
            row["n"] = int(ok_rows(part, "system", fm)[SEED_KEY].nunique())
            out.append(row)
    return pd.DataFrame(out)


def ladder_markdown(*sweeps: Path) -> str:
    """The TPOT and TTFT ladders of the sweeps at ``sweeps`` (pooled: e.g. the ladder and an
    attribution rung run beside it) as markdown."""
    runs = pd.concat([pd.read_csv(s / "summary_runs.csv") for s in sweeps], ignore_index=True)
    parts = []
    for metric, title in (("tpot_ms_mean", "TPOT"), ("ttft_ms_mean", "TTFT")):
        df = ladder_rows(runs, metric)
        paper = ", ".join(f"{b} {v:+.0f}%" for b, v in PAPER_CHANGES[title.lower()].items()
                          if v is not None)
        parts.append(f"### FineMoE's {title} change against each baseline, per rung\n\n"
                     + df.to_markdown(index=False)
                     + f"\n\nThe paper's {title} changes (Fig. 10): {paper}.\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", type=Path, nargs="+",
                    help="+experiment=paper_testbed sweep directories (pooled)")
    args = ap.parse_args(argv)
    sys.stdout.write(ladder_markdown(*args.sweeps) + "\n")


if __name__ == "__main__":
    main()
