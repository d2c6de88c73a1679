"""Fixtures for the eval tests: one loaded model, a small prompt sample, its local tasks.

The model is the shipped tiny one (``src/moeexp/assets/tiny``) or, before it ships, a
random tiny Mixtral with a character-level tokenizer. Torch runs on one thread here: with
the engine's copy thread, two intra-op threads on a shared 2-core CPU are ~100x slower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from tests.integration.conftest import save_random_tiny_mixtral, tiny_asset_ready

    from moeexp.paths import ASSETS_DIR

    if tiny_asset_ready():
        return ASSETS_DIR / "tiny"
    return save_random_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral"))


@pytest.fixture(scope="session")
def model_cfg(model_dir) -> dict[str, Any]:
    from moeexp.paths import load_group_yaml

    return {**load_group_yaml("model", "tiny"), "path": str(model_dir)}


@pytest.fixture(scope="session")
def loaded(model_cfg, one_thread) -> Any:
    from moeexp.models.loading import load_model

    return load_model(model_cfg)


@pytest.fixture(scope="session")
def dataset_cfg() -> dict[str, Any]:
    """16 held-out ShareGPT prompts of 16 tokens (11 store / 5 test)."""
    from moeexp.paths import load_group_yaml

    return {**load_group_yaml("dataset", "sharegpt"), "num_prompts": 16, "input_len": 16,
            "output_len": 8}


@pytest.fixture(scope="session")
def prompts(loaded, dataset_cfg) -> list[Any]:
    from moeexp.data.prompts import sample_prompts

    return sample_prompts(dataset_cfg, loaded.tokenizer)


@pytest.fixture(scope="session")
def tasks_dir(loaded, dataset_cfg, tmp_path_factory) -> Path:
    from moeexp.eval.tasks import prepare_tasks

    return prepare_tasks(tmp_path_factory.mktemp("eval_tasks"), dataset_cfg, loaded.tokenizer,
                         max_chars=400, cloze_per_reply=2)
