"""Means and 95 % intervals over seeds; paired changes against FineMoE's baselines; the
summary files of a seeded sweep (summary.csv per group, summary_runs.csv per run)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.tracking.compare import paired_changes, paired_markdown
from moeexp.tracking.intervals import aggregate, mean_ci, t975
from moeexp.tracking.results import gather, summarize
from moeexp.tracking.run_dir import write_done, write_metrics
from moeexp.tracking.summary import summarize_dir


def test_t_quantile_matches_scipy() -> None:
    """t(0.975, dof): the table up to 30 and the expansion beyond agree with scipy to 1e-6."""
    stats = pytest.importorskip("scipy.stats")
    for dof in [*range(1, 61), 100, 1000, 10**6]:
        assert t975(dof) == pytest.approx(float(stats.t.ppf(0.975, dof)), abs=1e-6), dof
    with pytest.raises(ValueError):
        t975(0)


def test_mean_ci_student_t_over_finite_values() -> None:
    """[1, 2, 3]: mean 2, half-width t(0.975, 2) * 1 / sqrt(3) = 2.484; NaN and None are
    not samples; one value has no interval; none has no mean."""
    mean, half, n = mean_ci([1.0, 2.0, 3.0, float("nan"), None])
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.302653 / math.sqrt(3))
    mean, half, n = mean_ci([5.0])
    assert (mean, n) == (5.0, 1) and math.isnan(half)
    mean, half, n = mean_ci([float("nan")])
    assert n == 0 and math.isnan(mean) and math.isnan(half)


def _runs() -> pd.DataFrame:
    """deepspeed and finemoe over seeds 0-2 (finemoe's TPOT 10/20/30 % below deepspeed's on
    the same seed), and mixtral_offloading not applicable on every seed."""
    rows = []
    for seed, (ds, fm) in enumerate([(10.0, 9.0), (20.0, 16.0), (40.0, 28.0)]):
        rows += [
            {"run": f"{3 * seed}_deepspeed", "dataset.seed": str(seed), "system": "deepspeed",
             "status": "ok", "tpot_ms_mean": ds, "ttft_ms_mean": 2 * ds, "hit_rate": 0.3,
             "prediction_recall": 0.0, "trace_hash": f"h{seed}"},
            {"run": f"{3 * seed + 1}_finemoe", "dataset.seed": str(seed), "system": "finemoe",
             "status": "ok", "tpot_ms_mean": fm, "ttft_ms_mean": 2 * fm, "hit_rate": 0.6,
             "prediction_recall": 0.7, "trace_hash": f"h{seed}"},
            {"run": f"{3 * seed + 2}_mixtral_offloading", "dataset.seed": str(seed),
             "system": "mixtral_offloading", "status": "not_applicable",
             "not_applicable_reason": "not applicable: the trace lacks spec_probs",
             "trace_hash": f"h{seed}"},
        ]
    return pd.DataFrame(rows)


def test_aggregate_one_row_per_system_with_mean_interval_and_n() -> None:
    """Three seeds fold into one row per system: the mean, the half-width and n = 3; the
    seeds, runs and per-seed trace hashes are kept (joined); the not-applicable system keeps
    its status and no numbers (NaN, not 0)."""
    rows = aggregate(_runs(), ["system"]).set_index("system")
    assert list(rows.index) == ["deepspeed", "finemoe", "mixtral_offloading"]
    assert (rows["n"] == 3).all() and (rows["seeds"] == "0;1;2").all()
    ds = rows.loc["deepspeed"]
    assert ds["tpot_ms_mean"] == pytest.approx(70 / 3)
    sd = pd.Series([10.0, 20.0, 40.0]).std(ddof=1)
    assert ds["tpot_ms_mean_ci95"] == pytest.approx(4.302653 * sd / math.sqrt(3))
    assert ds["hit_rate_ci95"] == 0.0
    assert ds["run"] == "0_deepspeed;3_deepspeed;6_deepspeed" and ds["trace_hash"] == "h0;h1;h2"
    mo = rows.loc["mixtral_offloading"]
    assert mo["status"] == "not_applicable" and math.isnan(mo["tpot_ms_mean"])
    assert mo["not_applicable_reason"].startswith("not applicable")


def test_aggregate_groups_a_null_key() -> None:
    """A swept key that is null in some runs (``backend.arrival_rate=null``: NaN in the
    frame) is a group of its own, not a crash (pandas 3's astype(str) keeps NaN)."""
    runs = pd.DataFrame({"run": ["a", "b", "c"], "seed": [0, 0, 1],
                         "arrival_rate": [100.0, float("nan"), float("nan")],
                         "tpot_ms_mean": [1.0, 2.0, 4.0]})
    rows = aggregate(runs, ["arrival_rate"])
    assert list(rows["n"]) == [1, 2]
    assert list(rows["tpot_ms_mean"]) == [1.0, 3.0]


def test_paired_changes_pair_each_seed_with_the_same_seed() -> None:
    """FineMoE's TPOT change per seed is -10, -20, -30 % (the same seed's deepspeed row, not
    the same position: the rows are shuffled): mean -20 %, interval t(2) * 10 / sqrt(3); the
    paper's -46 % beside it; against the not-applicable baseline: status, no numbers."""
    runs = _runs().sample(frac=1.0, random_state=3).reset_index(drop=True)
    paired = paired_changes(runs).set_index("baseline")
    assert list(paired.index) == ["deepspeed", "mixtral_offloading"]
    ds = paired.loc["deepspeed"]
    assert ds["status"] == "ok" and ds["n"] == 3
    assert ds["tpot_pct"] == pytest.approx(-20.0)
    assert ds["tpot_pct_ci95"] == pytest.approx(4.302653 * 10 / math.sqrt(3))
    assert ds["ttft_pct"] == pytest.approx(-20.0) and ds["tpot_paper"] == -46.0
    assert ds["tpot_ms"] == pytest.approx(-17 / 3)  # (-1 - 4 - 12) / 3 ms
    mo = paired.loc["mixtral_offloading"]
    assert mo["status"] == "not_applicable: mixtral_offloading"
    md = paired_markdown(paired.reset_index())
    assert "| deepspeed | 3 | -20.0% [-44.8, +4.8] | -74.0% | -20.0% [-44.8, +4.8] | -46.0% |" \
        in md
    assert "| mixtral_offloading | - | not applicable: mixtral_offloading | -67.0% | n/a |" in md
    assert "nan" not in md.lower()


def _job(root: Path, name: str, overrides: list[str], config: dict | None = None,
         **metrics) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    if config is not None:
        (d / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    write_metrics(d, metrics)
    write_done(d, {"overrides": overrides}, outputs=["metrics.json"])


@pytest.fixture
def seeded(tmp_path) -> Path:
    """A sweep dataset.seed=0,1,2 x system=deepspeed,finemoe,mixtral_offloading (the last
    not applicable), as the experiments write it."""
    for _, r in _runs().iterrows():
        metrics = {k: v for k, v in r.items() if k not in ("run", "dataset.seed")
                   and not (isinstance(v, float) and math.isnan(v))}
        _job(tmp_path, r["run"], [f"dataset.seed={r['dataset.seed']}", f"system={r['system']}",
                                  "+experiment=x"], **metrics)
    return tmp_path


def test_summary_files_of_a_seeded_sweep(seeded, capsys) -> None:
    """summary.csv: one row per system (mean, _ci95, n); summary_runs.csv: the 9 runs with
    deltas paired on the seed; summary_paired.csv and the printed paired table; summary.md
    with intervals as ±, the not-applicable row as n/a."""
    assert summarize_dir(seeded, title="x") == seeded / "summary.csv"
    rows = pd.read_csv(seeded / "summary.csv")
    assert list(rows["system"]) == ["deepspeed", "finemoe", "mixtral_offloading"]
    assert list(rows["n"]) == [3, 3, 3] and "tpot_ms_mean_ci95" in rows.columns
    fm = rows.set_index("system").loc["finemoe"]
    assert fm["tpot_vs_deepspeed_pct"] == pytest.approx(-20.0)  # mean of the paired changes
    runs = pd.read_csv(seeded / "summary_runs.csv")
    assert len(runs) == 9 and list(runs["tpot_vs_deepspeed_pct"].dropna().round(6)) == \
        [-10.0, -20.0, -30.0]  # deepspeed's own rows have none (never itself)
    paired = pd.read_csv(seeded / "summary_paired.csv")
    assert list(paired["baseline"]) == ["deepspeed", "mixtral_offloading"]
    md = (seeded / "summary.md").read_text()
    assert md.startswith("Each row: mean ± 95 % interval (Student t")
    assert "| finemoe | 3 | ok | 0.600 ± 0.000 |" in md  # system, n, status, hit_rate
    assert "| mixtral_offloading | 3 | not_applicable | n/a |" in md
    assert "nan" not in md.lower()
    out = capsys.readouterr().out
    assert "paired over the same prompts" in out and "-20.0% [-44.8, +4.8]" in out
    assert "over n = 3 seeds" in out


def test_seed_from_the_config_and_repeated_seeds_count_once(tmp_path, caplog) -> None:
    """A run whose seed is not an override takes it from .hydra/config.yaml; the same
    configuration and seed collected twice (two sweeps) is one sample, the later kept."""
    for sweep, hit in (("a", 0.2), ("b", 0.4)):
        _job(tmp_path, f"{sweep}/0", ["system=deepspeed"], {"dataset": {"seed": 7}},
             system="deepspeed", hit_rate=hit)
    _job(tmp_path, "b/1", ["system=deepspeed", "dataset.seed=8"], {"dataset": {"seed": 8}},
         system="deepspeed", hit_rate=0.6)
    assert list(gather(tmp_path)["dataset.seed"]) == ["7", "7", "8"]
    with caplog.at_level(logging.WARNING, logger="moeexp.tracking.intervals"):
        s = summarize(tmp_path)
    assert s.keys == ("label", "system")
    (row,) = s.rows.to_dict("records")
    assert (row["n"], row["seeds"], row["run"]) == (2, "7;8", "b/0;b/1")
    assert row["hit_rate"] == pytest.approx(0.5)
    assert "repeat a configuration and seed" in caplog.text and "a/0" in caplog.text
