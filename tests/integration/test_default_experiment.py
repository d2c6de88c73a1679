"""The end-to-end default experiment on CPU: ``python -m moeexp +experiment=finemoe_vs_moeinfinity``.

Shortened (10 prompts of 12 + 8 tokens, two prompt samples instead of three) but otherwise
the default path: model=tiny (the shipped asset once it exists), ShareGPT, the experiment's
own sweep over systems, MiniLM prompt embeddings, W&B offline. It must finish, write
summary.csv (one row per system, means and intervals over the two seeds), summary_runs.csv
(one row per job) and the paired changes, and print the comparison tables.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.paths import CONF_DIR


@pytest.mark.slow
def test_default_experiment_end_to_end(tmp_path, model_overrides, run_app):
    sweep = tmp_path / "exp"
    out = run_app("+experiment=finemoe_vs_moeinfinity", *model_overrides,
                  "dataset.num_prompts=10", "dataset.input_len=12", "dataset.output_len=8",
                  "dataset.seed=0,1",  # replaces the experiment's 0,1,2 (time)
                  f"trace.cache_dir={tmp_path / 'traces'}", f"hydra.sweep.dir={sweep}")
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    exp = OmegaConf.load(CONF_DIR / "experiment" / "finemoe_vs_moeinfinity.yaml")
    systems = str(exp.hydra.sweeper.params.system).split(",")
    assert str(exp.hydra.sweeper.params["dataset.seed"]) == "0,1,2"
    assert str(exp.hydra.sweeper.params["cost.as_model"]) == "null,mixtral_8x7b"
    full = pd.read_csv(sweep / "summary.csv")
    # Both cost regimes over the same traces: the embedded model's own costs and the
    # Mixtral projection (FineMoE's testbed regime), each printed as its own titled table.
    regimes = full["cost.as_model"].fillna("null").astype(str)
    assert sorted(regimes.unique()) == ["mixtral_8x7b", "null"]
    ratio = full.groupby(regimes)["copy_to_compute"].median()
    assert ratio["null"] < 1 < 3 < ratio["mixtral_8x7b"]
    assert "cost regime: the traced model's own costs" in out.stdout
    assert "cost regime: projected onto mixtral_8x7b" in out.stdout
    df = full[regimes == "null"]
    assert list(df["system"]) == systems
    assert (df["n"] == 2).all() and (df["seeds"] == "0;1").all()
    assert (df["cache_capacity"].astype(str) == "0.25").all()
    by = df.set_index("system")
    # no_offload is the latency floor; oracle never hits less than on-demand LRU.
    assert by.loc["no_offload", "hit_rate"] == 1.0
    assert by.loc["no_offload", "hit_rate_ci95"] == 0.0
    assert by.loc["no_offload", "ttft_norm_mean"] == pytest.approx(1.0)
    assert by.loc["oracle", "hit_rate"] >= by.loc["deepspeed", "hit_rate"]
    assert math.isnan(by.loc["deepspeed", "ttft_vs_deepspeed_pct"])  # never against itself
    assert list(df["label"]) == systems  # every system as shipped
    assert by["tpot_ms_mean_ci95"].notna().all()
    # One row per job, each seed its own trace; each job's delta against the same seed's
    # deepspeed job.
    runs = pd.read_csv(sweep / "summary_runs.csv")
    assert len(runs) == 2 * 2 * len(systems)  # seeds x regimes x systems
    assert sorted(runs["dataset.seed"].unique()) == [0, 1]
    assert runs.groupby("dataset.seed")["trace_hash"].nunique().eq(1).all()
    assert runs["trace_hash"].nunique() == 2
    assert runs.loc[runs["system"] == "deepspeed", "tpot_vs_deepspeed_pct"].isna().all()
    assert runs.loc[runs["system"] != "deepspeed", "tpot_vs_deepspeed_pct"].notna().all()
    paired = pd.read_csv(sweep / "summary_paired.csv")
    assert list(paired["baseline"]) == 2 * ["deepspeed", "mixtral_offloading", "promoe",
                                            "moe_infinity"]
    assert (paired["n"] == 2).all() and paired["tpot_pct_ci95"].notna().all()
    # The tables are printed: a title, the systems as rows, the metric columns, the pairs.
    assert "finemoe_vs_moeinfinity" in out.stdout
    for col in ("hit_rate", "prediction_recall", "ttft_norm_mean", "tpot_vs_deepspeed_pct"):
        assert col in out.stdout
    for s in systems:
        assert s in out.stdout
    assert "paired over the same prompts" in out.stdout and "±" in out.stdout
    # Each job mirrored to W&B (offline) in the experiment's group.
    for job in runs["run"]:
        logged = json.loads((sweep / job / "wandb_logged.json").read_text())
        assert logged["group"] == "finemoe_vs_moeinfinity"
