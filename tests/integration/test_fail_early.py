"""Errors that can be known before any work are raised before any work: no weight read,
no prompt sampled, no trace recorded."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR


def _boom(*_a, **_k):
    raise AssertionError("work started before the error")


@pytest.mark.parametrize("system", ["promoe", "mixtral_offloading", "finemoe", "promoe_learned"])
def test_prefetch_distance_beyond_the_moe_layers_fails_before_the_load(tmp_path, monkeypatch,
                                                                        system):
    """model=tiny has 8 MoE layers: model.prefetch_distance=9 fails in the check with the
    model's dims from its config on the meta device, before load_model (promoe used to fail
    only at fit time, after the load, the sampling and the recording; mixtral_offloading's
    speculative gate at distance 8 did not fail at all)."""
    from moeexp import pipeline

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", ["logger=none", f"system={system}",
                                 "model.prefetch_distance=9"])
        if system == "mixtral_offloading":  # its bundle fixes d = 1: follow the model's
            cfg = compose("config", ["logger=none", f"system={system}",
                                     "model.prefetch_distance=9",
                                     "predictor.distance=${model.prefetch_distance}"])
    monkeypatch.setattr("moeexp.models.loading.load_model", _boom)
    monkeypatch.setattr(pipeline, "sample_prompts", _boom)
    with pytest.raises(ConfigError, match=r"distance.*(1\.\.[78]|valid: 1\.\.8)"):
        pipeline.run(cfg, run_dir=tmp_path / "run")


@pytest.mark.parametrize(("args", "match"), [
    ({"system": "nope"}, r"unknown system 'nope'.*deepspeed"),
    ({"system": "finemoe", "predictor.prefetch_distanse": 3}, r"prefetch_distanse"),
    ({"system": "finemoe", "restricted_routng": True}, r"restricted_routng"),
    ({"system": "deepspeed", "capacity": 1}, r"capacity"),
    ({"system": "promoe", "predictor.distance": 9}, r"promoe: distance must be in 1\.\.8"),
    ({"system": "finemoe", "dataset.num_prompt": 3}, r"num_prompt"),
])
def test_lm_eval_model_args_fail_before_the_load_and_the_store(monkeypatch, args, match):
    """MoeexpLM(system=nope, ...) and every other model argument that can be checked without
    the weights fail before load_model and before the auto store is sampled and recorded
    (before: an unknown system was reported after the load, the sampling and the recording
    of the default store trace)."""
    from moeexp.eval import lm

    monkeypatch.setattr("moeexp.models.loading.load_model", _boom)
    monkeypatch.setattr(lm, "auto_store", _boom)
    with pytest.raises(ConfigError, match=match):
        lm.MoeexpLM(model="tiny", **args)


@pytest.mark.slow
def test_moeexp_lm_eval_console_command(tmp_path):
    """`moeexp lm-eval ...` is lm-eval's CLI with the moeexp model (issue 14 case 10): its
    --help is lm-eval's; `--model moeexp --model_args system=nope` ends with one line and
    status 2 before anything is sampled or recorded."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from moeexp.eval.tasks import prepare_tasks
    from moeexp.paths import ASSETS_DIR, REPO_DIR, load_group_yaml

    script = Path(sys.executable).parent / "moeexp"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "moeexp"]
    assert shutil.which(cmd[0]) or Path(cmd[0]).is_file()
    env = {**os.environ, "MOEEXP_RESULTS": str(tmp_path / "results"), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    out = subprocess.run([*cmd, "lm-eval", "run", "--help"], env=env, cwd=REPO_DIR,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "--model_args" in out.stdout, out.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "tiny")
    dcfg = {**load_group_yaml("dataset", "sharegpt"), "num_prompts": 16, "input_len": 16,
            "output_len": 8}
    tasks = prepare_tasks(tmp_path / "tasks", dcfg, tok, max_chars=200)
    out = subprocess.run([*cmd, "lm-eval", "--model", "moeexp", "--model_args", "system=nope",
                          "--tasks", "moeexp_sharegpt_ppl", "--include_path", str(tasks)],
                         env=env, cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "moeexp: ConfigError: unknown system 'nope'" in out.stderr
    assert "Traceback" not in out.stderr and "sampled" not in out.stderr
    assert not (tmp_path / "results" / "traces").exists()
