"""lm-eval end to end: the app's eval stage (metrics.json + W&B) and the CLI wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moeexp.paths import REPO_DIR

#: 16 prompts of 16 tokens (5 test prompts: enough for the local tasks), 8 generated.
EVAL_SMALL = ["dataset.num_prompts=16", "dataset.input_len=16", "dataset.output_len=8",
              "trace.prompt_embedder=null", "trace.progress=false", "backend.progress=false"]


def _ok(out) -> None:
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def test_app_eval_stage_metrics_and_wandb(tmp_path, model_overrides, trace_dir, run_app):
    """`system=emoe eval=lm_eval eval.tasks=[...] eval.limit=3 eval.quality=true`: the run's
    metrics.json holds lm_eval/<task>/<metric> for both local tasks, the quality metrics
    (lossy: substitution > 0) and eval_model=engine; W&B got the same numbers."""
    run = tmp_path / "run"
    out = run_app(*model_overrides, *EVAL_SMALL, f"trace.cache_dir={trace_dir}",
                  f"hydra.run.dir={run}", "system=emoe", "eval=lm_eval",
                  "eval.tasks=[moeexp_sharegpt_ppl,moeexp_sharegpt_reply]", "eval.limit=3",
                  "eval.quality=true", "eval.quality_prompts=2", "eval.quality_max_tokens=48",
                  "eval.quality_new_tokens=4", "eval.num_threads=1",
                  f"eval.tasks_dir={tmp_path / 'tasks'}", "logger=wandb")
    _ok(out)
    m = json.loads((run / "metrics.json").read_text())
    for key in ("lm_eval/moeexp_sharegpt_ppl/word_perplexity",
                "lm_eval/moeexp_sharegpt_ppl/bits_per_byte", "lm_eval/moeexp_sharegpt_reply/acc",
                "lm_eval/moeexp_sharegpt_reply/acc_norm", "perplexity", "greedy_agreement",
                "kl_mean", "token_agreement", "eval_time_s"):
        assert isinstance(m[key], float), key
    assert 0 <= m["lm_eval/moeexp_sharegpt_reply/acc"] <= 1
    assert m["eval_model"] == "engine" and m["quality_substitution_rate"] > 0
    assert m["lm_eval/engine/substitution_rate"] > 0
    logged = json.loads((run / "wandb_logged.json").read_text())
    assert logged["metrics"]["lm_eval/moeexp_sharegpt_reply/acc"] == \
        m["lm_eval/moeexp_sharegpt_reply/acc"]
    assert logged["config"]["eval"]["limit"] == 3


@pytest.mark.slow
def test_cli_wrapper_runs_moeexp_model(tmp_path, model_overrides):
    """`python -m moeexp.eval.cli --model moeexp --model_args model=tiny,system=emoe,
    capacity=0.5,... --tasks moeexp_sharegpt_ppl --include_path DIR` prints lm-eval's table
    with the task's perplexities (the auto store recorded on a 16-prompt sample, cached
    under $MOEEXP_RESULTS/traces). `--device` is left at lm-eval's default, cuda:0: it
    falls back to the CPU."""
    from moeexp.eval.tasks import prepare_tasks
    from moeexp.models.loading import load_model
    from moeexp.paths import load_group_yaml

    mcfg = load_group_yaml("model", "tiny")
    path = [o.split("=", 1)[1] for o in model_overrides if o.startswith("model.path=")]
    if path:
        mcfg["path"] = path[0]
    loaded = load_model(mcfg)
    dcfg = {**load_group_yaml("dataset", "sharegpt"), "num_prompts": 16, "input_len": 16,
            "output_len": 8}
    tasks = prepare_tasks(tmp_path / "tasks", dcfg, loaded.tokenizer, max_chars=300)
    args = ["model=tiny", "system=emoe", "capacity=0.5", "dataset.num_prompts=16",
            "dataset.input_len=16", "dataset.output_len=8", "trace.prompt_embedder=None",
            "trace.progress=False", *[f"model_path={p}" for p in path]]
    env = {**os.environ, "MOEEXP_RESULTS": str(tmp_path / "results"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "moeexp.eval.cli", "--model", "moeexp",
                          "--model_args", ",".join(args), "--tasks", "moeexp_sharegpt_ppl",
                          "--include_path", str(tasks), "--limit", "2"],
                         cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=600)
    _ok(out)
    assert "moeexp_sharegpt_ppl" in out.stdout and "word_perplexity" in out.stdout
    assert list((tmp_path / "results" / "traces").glob("*.npz"))  # the auto store
