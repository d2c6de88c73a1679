"""The end-to-end default experiment on CPU: ``python -m moeexp +experiment=finemoe_vs_moeinfinity``.

Shortened (10 prompts of 12 + 8 tokens) but otherwise the default path: model=tiny (the
shipped asset once it exists), ShareGPT, the experiment's own sweep over systems, MiniLM
prompt embeddings, W&B offline. It must finish, write summary.csv (one row per system)
and print the comparison table.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.paths import CONF_DIR


def test_default_experiment_end_to_end(tmp_path, model_overrides, run_app):
    sweep = tmp_path / "exp"
    out = run_app("+experiment=finemoe_vs_moeinfinity", *model_overrides,
                  "dataset.num_prompts=10", "dataset.input_len=12", "dataset.output_len=8",
                  f"trace.cache_dir={tmp_path / 'traces'}", f"hydra.sweep.dir={sweep}")
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    exp = OmegaConf.load(CONF_DIR / "experiment" / "finemoe_vs_moeinfinity.yaml")
    systems = str(exp.hydra.sweeper.params.system).split(",")
    df = pd.read_csv(sweep / "summary.csv")
    assert list(df["system"]) == systems
    assert (df["cache_capacity"].astype(str) == "0.25").all()
    by = df.set_index("system")
    # no_offload is the latency floor; oracle never hits less than on-demand LRU.
    assert by.loc["no_offload", "hit_rate"] == 1.0
    assert by.loc["no_offload", "ttft_norm_mean"] == pytest.approx(1.0)
    assert by.loc["oracle", "hit_rate"] >= by.loc["deepspeed", "hit_rate"]
    assert by.loc["deepspeed", "ttft_vs_deepspeed_pct"] == 0.0
    # The table is printed: a title, the systems as rows, the metric columns.
    assert "finemoe_vs_moeinfinity" in out.stdout
    for col in ("hit_rate", "prediction_recall", "ttft_norm_mean", "tpot_vs_deepspeed_pct"):
        assert col in out.stdout
    for s in systems:
        assert s in out.stdout
    # Each job mirrored to W&B (offline) in the experiment's group.
    for job in df["run"]:
        logged = json.loads((sweep / job / "wandb_logged.json").read_text())
        assert logged["group"] == "finemoe_vs_moeinfinity"
