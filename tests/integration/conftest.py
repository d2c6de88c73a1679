"""Fixtures for the app's integration tests: a small model directory and how to run the app.

Until the trained tiny model ships in ``src/moeexp/assets/tiny/``, the app runs on a
random-weight tiny Mixtral (2 MoE layers, 8 experts, top-2, vocab 256) saved with a
character-level tokenizer (bos/eos like the real one). Once the asset exists,
:func:`model_overrides` returns no override, so the default ``model=tiny`` is exercised.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from moeexp.paths import ASSETS_DIR, REPO_DIR

#: A run small enough for a test: 6 prompts of 8 tokens + 6 generated (4 store / 2 test).
SMALL = ["dataset.num_prompts=6", "dataset.input_len=8", "dataset.output_len=6",
         "trace.prompt_embedder=null", "backend.progress=false", "trace.progress=false"]


def tiny_asset_ready() -> bool:
    return (ASSETS_DIR / "tiny" / "config.json").is_file() and \
        (ASSETS_DIR / "tiny" / "model.safetensors").is_file()


def save_random_tiny_mixtral(out: Path) -> Path:
    """A random tiny Mixtral + a character-level tokenizer (ids < 256) saved in ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moeexp.models.toy_configs import toy_model

    chars = [chr(c) for c in range(33, 127)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    model = toy_model("mixtral", seed=0)
    assert model.config.bos_token_id == 1 and model.config.eos_token_id == 2
    assert model.config.vocab_size >= len(vocab)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model_overrides(tmp_path_factory) -> list[str]:
    """Overrides selecting the model: none with the shipped asset, else a random tiny one."""
    if tiny_asset_ready():
        return []
    d = save_random_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral"))
    return [f"model.path={d}"]


@pytest.fixture(scope="session")
def trace_dir(tmp_path_factory) -> Path:
    """One trace cache for the session: the same small trace is recorded once."""
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="session")
def small(model_overrides, trace_dir) -> list[str]:
    """Overrides for a small, fast run (model, SMALL lengths, the session's trace cache)."""
    return [*model_overrides, *SMALL, f"trace.cache_dir={trace_dir}"]


def _run_app(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m moeexp ARGS`` from the repository root (offline W&B and hubs)."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "moeexp", *args], cwd=REPO_DIR, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def run_app():
    """``run_app(*overrides, timeout=600)``: the app in a subprocess; a CompletedProcess."""
    return _run_app


def check_two_cache_summary(sweep: Path, stdout: str) -> None:
    """A ``--multirun cache=lru,lfu`` sweep with ``logger=none``: one job dir each and
    summary.csv with one row per job, the swept key as a column, in sweep order; the
    comparison table printed; no W&B files. Checked after the basic launcher's sweep
    (``test_app``) and the joblib one's (``test_launchers``)."""
    df = pd.read_csv(sweep / "summary.csv")
    assert len(df) == 2 and list(df["cache"]) == ["lru", "lfu"]
    assert list(df["label"]) == ["deepspeed", "deepspeed+cache=lfu"]
    assert list(df["run"]) == ["0_deepspeed", "1_deepspeed+cache=lfu"]
    for job in df["run"]:
        d = sweep / job
        assert (d / "metrics.json").is_file() and (d / "env.json").is_file()
        assert not (d / "wandb").exists() and not (d / "wandb_logged.json").exists()
    assert "hit_rate" in stdout and "lfu" in stdout
    assert (sweep / "summary.md").read_text().startswith("| label | n |")
