"""The reproduction table's "beyond" rows: a system built past the paper, on the same settings.

Issue 27's ``prefetch_if_pays`` against the systems of the table, from the regime-map sweeps
(``+experiment=regime_map`` and ``regime_map_real``; claim ``beyond`` in
:data:`moeexp.tracking.repro_data.CLAIMS`). A regime map sweeps the host link; a setting's cell
reads the runs at the profile's own link (:data:`LINK_GBPS`, where the embedded setting sits at
copy/compute 0.27 and the real one at 3.6) and at the Fig. 10 budget. Per seed, paired as every
other cell: TPOT against the best exact non-oracle system at that point (the lowest mean TPOT
of :data:`EXACT`), TTFT against FineMoE's (where the trace has a prefill), and the share of the
TPOT gap between on-demand LRU (``deepspeed``) and ``oracle_aggressive`` it closes.

The ``f-cpu-*`` rows (:func:`beyond_cpu_rows`, claim ``beyond_cpu``: ``+experiment=
regime_map_cpu`` and ``regime_map_cpu_real``) hold ``prefetch_if_pays_cpu``, the variant whose
missed experts may run on the host CPU, against the best *other* system of the CPU map (every
system there: copy-only, CPU placements and any variant a sweep added) at a CPU of the paper's
era (:data:`CPU_GBPS`) and the Fig. 10 budget: TPOT against the lowest mean TPOT, TTFT against
the lowest mean TTFT. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd

from moeexp.tracking.intervals import SEED_KEY, mean_ci
from moeexp.tracking.repro_data import (
    FIG10_BUDGET,
    REGIMES,
    Regime,
    Setting,
    Stat,
    at_budget,
    finemoe_of,
    level,
    ok_rows,
    paired,
    ratio,
)

SYSTEM = "prefetch_if_pays"  #: the system the rows are about
#: The exact, non-oracle systems it is held against ("the best exact system at the point").
EXACT = ("deepspeed", "mixtral_offloading", "promoe", "moe_infinity", "finemoe",
         "finemoe_no_semantic")
LINK_GBPS = 32.0  #: ``hardware.h2d_gbps`` of the cells: rtx3090_pcie4's own link
VERDICT = {-1: "**ahead**", 0: "**≈ 0**", 1: "**behind**"}
CPU_SYSTEM = "prefetch_if_pays_cpu"  #: the ``f-cpu-*`` rows' system
CPU_GBPS = 60.0  #: ``hardware.cpu.dram_gbps`` of those cells: a CPU of the paper's era


def _at(runs: pd.DataFrame, col: str, value: float) -> pd.DataFrame:
    """The runs whose ``col`` is ``value`` (all of them when the sweep has no such column)."""
    if col not in runs:
        return runs
    return runs[(pd.to_numeric(runs[col], errors="coerce") - value).abs() < 1e-9]


def at_link(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs at :data:`LINK_GBPS` (all of them when the sweep has no link column)."""
    return _at(runs, "hardware.h2d_gbps", LINK_GBPS)


def _lowest(runs: pd.DataFrame, names: Iterable[str], metric: str) -> str | None:
    """Of ``names``, the system of lowest mean ``metric`` among ``runs`` (None: none ran)."""
    means = {s: level(runs, "system", s, metric).mean for s in names
             if not ok_rows(runs, "system", s).empty}
    means = {s: m for s, m in means.items() if math.isfinite(m)}
    return min(means, key=lambda s: means[s]) if means else None


def best_exact(runs: pd.DataFrame) -> str | None:
    """The exact non-oracle system of lowest mean TPOT among ``runs`` (None: none ran)."""
    return _lowest(runs, (s for s in EXACT if s != SYSTEM), "tpot_ms_mean")


def gap_closed(runs: pd.DataFrame) -> Stat:
    """Per seed ``(LRU - this) / (LRU - oracle_aggressive)`` of TPOT: mean and interval."""
    per = []
    for name in ("deepspeed", "oracle_aggressive", SYSTEM):
        part = ok_rows(runs, "system", name)
        if "tpot_ms_mean" not in part or SEED_KEY not in part:
            return Stat(math.nan, math.nan, 0)
        per.append(part.groupby(part[SEED_KEY].astype(str))["tpot_ms_mean"].last())
    lru, oa, me = per
    seeds = lru.index.intersection(oa.index).intersection(me.index)
    span = (lru[seeds] - oa[seeds]).astype(float)
    return Stat(*mean_ci(((lru[seeds] - me[seeds]) / span.where(span > 0)).dropna()))


def _cell(runs: pd.DataFrame, q: str) -> str:
    if ok_rows(runs, "system", SYSTEM).empty:
        return f"not measured: no run of {SYSTEM} at {LINK_GBPS:g} GB/s"
    if q == "gap":
        st = gap_closed(runs)
        return (f"{st.text(2)} of the gap closed; bytes "
                f"{ratio(runs, 'system', SYSTEM, 'deepspeed', 'h2d_bytes_total')} LRU's"
                if st.ok() else "n/a: no deepspeed / oracle_aggressive runs to pair")
    other = best_exact(runs) if q == "tpot" else finemoe_of(runs)
    metric = "tpot_ms_mean" if q == "tpot" else "ttft_ms_mean"
    st = paired(runs, "system", SYSTEM, other, metric) if other else Stat(math.nan, math.nan, 0)
    if not st.ok():
        return ("n/a: the trace has no prefill (TTFT not available)" if q == "ttft"
                else "n/a: no exact system ran")
    ctc = level(runs, "system", SYSTEM, "copy_to_compute").mean
    return f"{st.change()} {VERDICT[st.sign()]} vs {other} (c/c {ctc:.2g})"


def beyond_rows(data: dict[tuple[str, Regime], Setting], row: type) -> list:
    """The ``f-*`` rows (``row``: the table's Row class): TPOT vs the best exact system,
    TTFT vs FineMoE, the LRU→oracle_aggressive gap closed; "not measured" where no
    regime-map sweep of the setting was given."""
    spec = (("tpot", "TPOT vs the best exact non-oracle system at the point"),
            ("ttft", "TTFT vs FineMoE"),
            ("gap", "share of the TPOT gap on-demand LRU → oracle_aggressive closed"))
    out = []
    for q, title in spec:
        cells: dict[Regime, str] = {}
        for regime in REGIMES:
            s = data.get(("beyond", regime))
            cells[regime] = ("not measured" if s is None
                             else _cell(at_link(at_budget(s.runs, FIG10_BUDGET)), q))
        out.append(row(f"f-{q}-{SYSTEM}", f"Beyond the paper (issue 27): {SYSTEM} {title} "
                       f"(cache {FIG10_BUDGET:.0%}, {LINK_GBPS:g} GB/s)",
                       "– (not in the paper)", cells))
    return out


def at_cpu(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs at :data:`CPU_GBPS` (all of them when the sweep has no CPU column)."""
    return _at(runs, "hardware.cpu.dram_gbps", CPU_GBPS)


def best_other(runs: pd.DataFrame, metric: str) -> str | None:
    """The system other than :data:`CPU_SYSTEM` of lowest mean ``metric`` (None: none)."""
    names = runs["system"].dropna().astype(str).unique() if "system" in runs else []
    return _lowest(runs, (s for s in names if s != CPU_SYSTEM), metric)


def _cpu_cell(runs: pd.DataFrame, metric: str) -> str:
    if ok_rows(runs, "system", CPU_SYSTEM).empty:
        return f"not measured: no run of {CPU_SYSTEM} at a {CPU_GBPS:g} GB/s CPU"
    other = best_other(runs, metric)
    st = paired(runs, "system", CPU_SYSTEM, other, metric) if other else Stat(math.nan, math.nan, 0)
    if not st.ok():
        return ("n/a: the trace has no prefill (TTFT not available)"
                if metric == "ttft_ms_mean" else "n/a: no other system ran")
    return f"{st.change()} {VERDICT[st.sign()]} vs {other}"


def beyond_cpu_rows(data: dict[tuple[str, Regime], Setting], row: type) -> list:
    """The ``f-cpu-*`` rows (module docstring); "not measured" where no CPU-map sweep of
    the setting was given."""
    out = []
    for q, metric in (("tpot", "tpot_ms_mean"), ("ttft", "ttft_ms_mean")):
        cells: dict[Regime, str] = {}
        for regime in REGIMES:
            s = data.get(("beyond_cpu", regime))
            cells[regime] = ("not measured" if s is None
                             else _cpu_cell(at_cpu(at_budget(s.runs, FIG10_BUDGET)), metric))
        out.append(row(f"f-cpu-{q}-{CPU_SYSTEM}",
                       f"Beyond the paper (issue 27): {CPU_SYSTEM} {q.upper()} vs the best "
                       f"other system of the CPU map (cache {FIG10_BUDGET:.0%}, "
                       f"{CPU_GBPS:g} GB/s CPU)", "– (not in the paper)", cells))
    return out
