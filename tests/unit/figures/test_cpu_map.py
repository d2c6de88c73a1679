"""The CPU regime map (moeexp.figures.cpu_map) and its tables (experiments/regime_map/
cpu_tables.py): runs files merged by key with later files winning, copy-only rows repeated
across the bandwidth axis, intervals over seeds, the pairing against on-demand LRU on the
seed, and the figure from runs and from a summary."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest

from moeexp.figures.cpu_map import cpu_map, load_runs, paired_pct, point_stats, repeat_copy_only

ROOT = Path(__file__).resolve().parents[3]


def _runs(tpot_cpu: float = 50.0) -> pd.DataFrame:
    """deepspeed (copy-only, run at 60 GB/s only) and `cpu` at 20/60, two budgets, 3 seeds:
    LRU's TPOT 100 + seed, cpu's tpot_cpu * 60 / bw + seed."""
    rows = []
    for cap in (0.25, 0.5):
        for seed in range(3):
            rows.append({"system": "deepspeed", "execution": "copy", "cache_capacity": cap,
                         "hardware.cpu.dram_gbps": 60, "dataset.seed": seed,
                         "tpot_ms_mean": 100.0 + seed, "ttft_ms_mean": 1000.0,
                         "h2d_bytes_total": 4e9, "output_tokens_total": 10, "hit_rate": 0.3,
                         "stall_ms_total": 500.0, "cost_expert_format": "dense"})
            for bw in (20, 60):
                rows.append({"system": "cpu", "execution": "cpu_on_miss", "cache_capacity": cap,
                             "hardware.cpu.dram_gbps": bw, "dataset.seed": seed,
                             "tpot_ms_mean": tpot_cpu * 60 / bw + seed, "ttft_ms_mean": 900.0,
                             "h2d_bytes_total": 0.0, "output_tokens_total": 10, "hit_rate": 0.2,
                             "stall_ms_total": 0.0, "cpu_ms_total": 40.0, "cpu_wait_ms_total": 30.0,
                             "cost_expert_format": "dense"})
    return pd.DataFrame(rows)


def _write(tmp_path: Path, name: str, df: pd.DataFrame) -> Path:
    p = tmp_path / f"{name}_runs.csv"
    df.to_csv(p, index=False)
    return p


def test_later_files_replace_rows_of_the_same_key_or_the_whole_system(tmp_path: Path) -> None:
    first = _write(tmp_path, "a", _runs())
    rerun = _runs(tpot_cpu=40.0)
    rerun = rerun[(rerun["system"] == "cpu") & (rerun["cache_capacity"] == 0.25)]
    second = _write(tmp_path, "b", rerun)
    merged = load_runs([first, second])
    assert len(merged) == len(_runs())
    cpu = merged[merged["system"] == "cpu"].set_index(["cap", "bw", "seed"])["tpot_ms_mean"]
    assert cpu[(0.25, 60.0, 0)] == 40.0 and cpu[(0.5, 60.0, 0)] == 50.0
    whole = load_runs([first, second], whole_system=True)
    assert set(whole[whole["system"] == "cpu"]["cap"]) == {0.25}
    with pytest.raises(FileNotFoundError, match="_runs.csv"):
        load_runs([tmp_path / "nothing.csv"])


def test_copy_only_rows_repeat_across_the_axis_and_pair_on_the_seed() -> None:
    runs = repeat_copy_only(load_runs_df(_runs()))
    lru = runs[runs["system"] == "deepspeed"]
    assert sorted(set(lru["bw"])) == [20.0, 60.0] and lru[lru["bw"] == 20.0]["repeated"].all()
    st = point_stats(runs, "tpot_ms_mean").set_index(["system", "cap", "bw"])
    r = st.loc[("cpu", 0.25, 60.0)]
    assert r["mean"] == pytest.approx(51.0) and r["n"] == 3
    assert r["ci95"] == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-3)
    # paired per seed: (50 + s) / (100 + s) - 1, its own spread, not the two spreads added
    pct = [100 * ((50 + s) / (100 + s) - 1) for s in range(3)]
    assert r["lru_pct"] == pytest.approx(sum(pct) / 3)
    assert r["lru_pct_ci95"] == pytest.approx(4.303 * pd.Series(pct).std() / math.sqrt(3), rel=1e-3)
    assert st.loc[("cpu", 0.25, 20.0)]["lru_pct"] > 0  # at 20 GB/s the CPU loses
    m, h, n = paired_pct(runs, "tpot_ms_mean", "cpu", "deepspeed", 0.25, 60.0, "dense")
    assert (n, m, h) == (3, pytest.approx(sum(pct) / 3), pytest.approx(r["lru_pct_ci95"]))


def load_runs_df(df: pd.DataFrame) -> pd.DataFrame:
    """load_runs' normalisation on an in-memory frame (through a temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load_runs([_write(Path(d), "x", df)])


def _tables():  # type: ignore[no-untyped-def]
    """experiments/regime_map/cpu_tables.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "cpu_tables", ROOT / "experiments" / "regime_map" / "cpu_tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    return tables


def test_the_tables_mark_the_supported_winner_and_the_repeated_rows(tmp_path: Path) -> None:
    tables = _tables()
    text = tables.report(load_runs([_write(tmp_path, "a", _runs())]))
    assert "### budget 25%, experts dense, 3 seed(s)" in text
    assert "| deepspeed | **101.0 ± 2.5 =** | 101.0 ± 2.5 |" in text
    assert "| cpu | 151.0 ± 2.5 | **51.0 ± 2.5** |" in text
    assert "| cpu | +49.5 [+48.3, +50.7] | -49.5 [-50.7, -48.3] |" in text
    assert "| 60 | cpu | deepspeed | -49.5 [-50.7, -48.3] | yes |" in text


def test_the_figure_draws_from_runs_and_from_a_summary() -> None:
    fig = cpu_map(load_runs_df(_runs()))
    assert len(fig.axes) == 4  # two budgets x (TPOT, TTFT)
    labels = {t.get_text() for t in fig.axes[1].get_legend().get_texts()}
    assert labels == {"deepspeed", "cpu"}
    summary = pd.DataFrame([
        {"system": "deepspeed", "execution": "copy", "cache_capacity": 0.25, "n": 3,
         "hardware.cpu.dram_gbps": 60, "tpot_ms_mean": 100.0, "tpot_ms_mean_ci95": 2.0},
        {"system": "cpu", "execution": "cpu_on_miss", "cache_capacity": 0.25, "n": 3,
         "hardware.cpu.dram_gbps": 20, "tpot_ms_mean": 150.0, "tpot_ms_mean_ci95": 2.0},
        {"system": "cpu", "execution": "cpu_on_miss", "cache_capacity": 0.25, "n": 3,
         "hardware.cpu.dram_gbps": 60, "tpot_ms_mean": 50.0, "tpot_ms_mean_ci95": 2.0}])
    assert len(cpu_map(summary).axes) == 1
    with pytest.raises(ValueError, match="int8"):
        cpu_map(summary, fmt="int8")


def test_the_formats_table_pairs_with_lru_in_the_same_format(tmp_path: Path) -> None:
    """int8 halves every TPOT: LRU's int8 row is -50 % against dense LRU, `cpu`'s int8 row
    is paired with int8 LRU (-49.5 %), not with dense LRU; int8 is marked lossy."""
    dense = _runs()
    int8 = dense.assign(cost_expert_format="int8", tpot_ms_mean=dense["tpot_ms_mean"] / 2)
    tables = _tables()
    runs = repeat_copy_only(load_runs([_write(tmp_path, "a", pd.concat([dense, int8]))]))
    text = "\n".join(tables.format_table(runs, "tpot_ms_mean", 0.25, 60.0))
    assert "| system | dense | int8 (lossy) |" in text
    assert "| deepspeed | 101.0 ± 2.5 (+0.0 [+0.0, +0.0]) | 50.5 ± 1.2 (-50.0 [-50.0, -50.0]) |" in text
    assert "| cpu | 51.0 ± 2.5 (-49.5 [-50.7, -48.3]) | 25.5 ± 1.2 (-49.5 [-50.7, -48.3]) |" in text


def test_the_lowest_per_format_and_a_shipped_format_marked_lossless(tmp_path: Path) -> None:
    """The per-format winner table names the lowest system, its margin and its change
    against LRU in the same format; a format the runs flag lossless (gpt-oss's MXFP4) is
    not marked lossy, whatever the default says."""
    dense = _runs()
    mx = dense.assign(cost_expert_format="mxfp4", expert_format_lossy=False,
                      tpot_ms_mean=dense["tpot_ms_mean"] / 2)
    tables = _tables()
    runs = repeat_copy_only(load_runs([_write(tmp_path, "a", pd.concat([dense, mx]))]))
    text = "\n".join(tables.format_winners(runs, "tpot_ms_mean", 0.25))
    assert "| mxfp4 | 60 | cpu | 25.5 ± 1.2 | deepspeed | -49.5 [-50.7, -48.3] | yes | " \
           "-49.5 [-50.7, -48.3] |" in text
    assert "| dense | 20 | deepspeed | 101.0 ± 2.5 | cpu |" in text
    assert not tables.lossy(runs, "mxfp4") and tables.lossy(runs.drop(
        columns="expert_format_lossy"), "mxfp4")
    assert "| mxfp4 | lossless | 1.000 (the shipped weights) | 0 |" in "\n".join(
        tables.format_section(runs, accuracy=True))


def test_merged_rows_are_written_unchanged_and_selected(tmp_path: Path) -> None:
    """--write: runs and the summaries beside them merged (a later file wins), selected by
    budget, bandwidth and system, every kept cell as its input's text."""
    first = _write(tmp_path, "a", _runs().assign(note="x"))
    pd.DataFrame([{"system": "cpu", "cache_capacity": 0.25, "hardware.cpu.dram_gbps": 60,
                   "n": 3, "tpot_ms_mean": 51.0}]).to_csv(tmp_path / "a.csv", index=False)
    rerun = _runs(tpot_cpu=40.0)
    second = _write(tmp_path, "b", rerun[rerun["system"] == "cpu"])
    pd.DataFrame([{"system": "cpu", "cache_capacity": 0.25, "hardware.cpu.dram_gbps": 60,
                   "n": 3, "tpot_ms_mean": 41.0}]).to_csv(tmp_path / "b.csv", index=False)
    tables = _tables()
    out = tmp_path / "merged.csv"
    assert tables.write_merged([first, second], out, False, [0.25], [60.0], None) == (6, 1)
    runs = pd.read_csv(tmp_path / "merged_runs.csv", dtype=str, keep_default_na=False)
    assert list(runs.columns) == list(pd.read_csv(first).columns)
    assert set(runs["system"]) == {"deepspeed", "cpu"} and set(runs["cache_capacity"]) == {"0.25"}
    assert sorted(runs[runs["system"] == "cpu"]["tpot_ms_mean"]) == ["40.0", "41.0", "42.0"]
    assert set(runs[runs["system"] == "cpu"]["note"]) == {""}  # not in the re-run's file
    assert pd.read_csv(out)["tpot_ms_mean"].tolist() == [41.0]
    with pytest.raises(FileNotFoundError, match="summary"):
        tables.write_merged([_write(tmp_path, "c", _runs())], out, False, None, None, None)
