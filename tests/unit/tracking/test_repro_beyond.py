"""The reproduction table's beyond rows: prefetch_if_pays on a regime map, at the profile's
link and the Fig. 10 budget, paired per seed like every other cell."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeexp.tracking.repro_beyond import gap_closed
from moeexp.tracking.repro_data import load
from moeexp.tracking.reproduction import Row, build_rows

from .test_reproduction import _sweep

# TPOT ms per system at 32 GB/s and 25 % (seed s adds s * 0.1 to the new system's)
TPOT = {"deepspeed": 10.0, "finemoe": 9.0, "oracle_aggressive": 6.0, "prefetch_if_pays": 8.0}


def _map(model: str = "tiny", exp: str = "regime_map") -> list[dict[str, object]]:
    rows = []
    for seed in range(3):
        for gbps in (32.0, 0.2):  # the slow link must not reach the cells
            for cap in (0.25, 0.5):
                for system, tpot in TPOT.items():
                    t = tpot + (0.1 * seed if system == "prefetch_if_pays" else 0.0)
                    t *= 1.0 if (gbps, cap) == (32.0, 0.25) else 100.0
                    rows.append({"dataset.seed": seed, "system": system, "experiment": exp,
                                 "model": model, "cost_as_model": "", "status": "ok",
                                 "cache_capacity": cap, "hardware.h2d_gbps": gbps,
                                 "tpot_ms_mean": t, "ttft_ms_mean": t if model == "tiny"
                                 else float("nan"), "h2d_bytes_total": 2.0 * t,
                                 "copy_to_compute": 0.27 if gbps == 32.0 else 12.0})
    return rows


def test_beyond_rows_pair_the_system_against_the_best_exact_one(tmp_path: Path) -> None:
    data = load([_sweep(tmp_path, "emb", _map()),
                 _sweep(tmp_path, "real", _map("gpt_oss_20b", "regime_map_real"))])
    assert sorted(data) == [("beyond", "embedded"), ("beyond", "real")]
    rows = {r.rid: r for r in build_rows(data) if r.rid.startswith("f-")}
    assert isinstance(next(iter(rows.values())), Row)
    tpot = rows["f-tpot-prefetch_if_pays"].cells
    # 8.0 / 8.1 / 8.2 against finemoe's 9.0 (the best exact one; the oracle is not exact)
    assert tpot["embedded"].startswith("-10.0 % [") and "**ahead** vs finemoe" in tpot["embedded"]
    assert tpot["projected"] == "not measured"
    assert "vs finemoe" in rows["f-ttft-prefetch_if_pays"].cells["embedded"]
    assert rows["f-ttft-prefetch_if_pays"].cells["real"].startswith("n/a: the trace has no prefill")
    gap = rows["f-gap-prefetch_if_pays"].cells["embedded"]
    # per seed (10 - 8.0, 8.1, 8.2) / (10 - 6): 0.5, 0.475, 0.45; bytes 8.1 / 10 on average
    assert gap.startswith("0.48±") and "×0.81 LRU's" in gap


def test_gap_closed_is_per_seed_and_needs_all_three_systems(tmp_path: Path) -> None:
    import pandas as pd

    runs = pd.DataFrame([r for r in _map() if r["hardware.h2d_gbps"] == 32.0
                         and r["cache_capacity"] == 0.25])
    st = gap_closed(runs)
    assert st.n == 3 and st.mean == pytest.approx(0.475)
    assert not gap_closed(runs[runs.system != "oracle_aggressive"]).ok()


# CPU map: TPOT / TTFT ms per system at a 60 GB/s CPU and 25 % (seed s adds s * 0.1 to the
# CPU system's); at 200 GB/s and at 50 % everything is 100x, so those cells are never read
CPU_TPOT = {"deepspeed": 20.0, "ktransformers": 10.0, "hybrimoe_late_cpu": 11.0,
            "prefetch_if_pays_cpu": 9.0}
CPU_TTFT = {"deepspeed": 200.0, "ktransformers": 120.0, "hybrimoe_late_cpu": 100.0,
            "prefetch_if_pays_cpu": 99.0}


def _cpu_map(model: str = "tiny", exp: str = "regime_map_cpu") -> list[dict[str, object]]:
    rows = []
    for seed in range(3):
        for bw in (60.0, 200.0):
            for cap in (0.25, 0.5):
                for system, tpot in CPU_TPOT.items():
                    k = (1.0 if (bw, cap) == (60.0, 0.25) else 100.0)
                    d = 0.1 * seed if system == "prefetch_if_pays_cpu" else 0.0
                    rows.append({"dataset.seed": seed, "system": system, "experiment": exp,
                                 "model": model, "cost_as_model": "mixtral_8x7b"
                                 if model == "tiny" else "", "status": "ok",
                                 "cache_capacity": cap, "hardware.cpu.dram_gbps": bw,
                                 "tpot_ms_mean": (tpot + d) * k,
                                 "ttft_ms_mean": (CPU_TTFT[system] + d) * k if model == "tiny"
                                 else float("nan"), "copy_to_compute": 12.0})
    return rows


def test_cpu_rows_pair_the_cpu_system_against_the_best_other_one(tmp_path: Path) -> None:
    """f-cpu-*: prefetch_if_pays_cpu at a 60 GB/s CPU and 25 % against the lowest mean TPOT
    (ktransformers) and the lowest mean TTFT (hybrimoe_late_cpu) of every other system, per
    seed; the embedded CPU map sits in the projected setting (Mixtral cost), the real one in
    the real setting, which has no TTFT; settings without a CPU map: not measured."""
    data = load([_sweep(tmp_path, "cpu", _cpu_map()),
                 _sweep(tmp_path, "cpu_real", _cpu_map("gpt_oss_20b", "regime_map_cpu_real"))])
    assert sorted(data) == [("beyond_cpu", "projected"), ("beyond_cpu", "real")]
    rows = {r.rid: r for r in build_rows(data) if r.rid.startswith("f-cpu-")}
    tpot = rows["f-cpu-tpot-prefetch_if_pays_cpu"].cells
    # 9.0 / 9.1 / 9.2 against 10.0: -10, -9, -8 %
    assert tpot["projected"].startswith("-9.0 % [") and "**ahead** vs ktransformers" in tpot["projected"]
    assert "vs ktransformers" in tpot["real"] and tpot["embedded"] == "not measured"
    ttft = rows["f-cpu-ttft-prefetch_if_pays_cpu"].cells
    # 99.0 / 99.1 / 99.2 against 100: the interval holds 0 only if it spans it; it does not
    assert "vs hybrimoe_late_cpu" in ttft["projected"]
    assert ttft["real"].startswith("n/a: the trace has no prefill")
    # without the CPU system's runs the cell says so
    other = load([_sweep(tmp_path, "cpu2", [r for r in _cpu_map()
                                             if r["system"] != "prefetch_if_pays_cpu"])])
    cells = {r.rid: r for r in build_rows(other)}["f-cpu-tpot-prefetch_if_pays_cpu"].cells
    assert cells["projected"].startswith("not measured: no run of prefetch_if_pays_cpu")
