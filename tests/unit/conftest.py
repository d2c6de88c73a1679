"""Fixtures of the unit tests that run models: toy models, prompts and store traces (cached).

Shared by tests/unit/engine and tests/unit/eval (the quality helpers run the engine)."""

from __future__ import annotations

import types
from functools import cache

import pytest
import torch

from moeexp.models.toy_configs import SUPPORTED_MODEL_TYPES, toy_model

ARCHS = SUPPORTED_MODEL_TYPES


def prompt_ids(n: int = 10, seed: int = 0) -> torch.Tensor:
    """int64[1, n] random token ids (no special tokens)."""
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


@cache
def _store(model_type: str) -> object:
    from moeexp.data.prompts import Prompt
    from moeexp.models.adapters import adapter_for
    from moeexp.traces.recorder import record_trace

    model = toy_model(model_type)
    g = torch.Generator().manual_seed(123)
    prompts = [Prompt(request_id=i, text="", input_ids=tuple(torch.randint(3, 250, (8,), generator=g).tolist()),
                      prompt_len=8, output_len=4, split="store", dataset="synthetic")
               for i in range(4)]
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name=f"tiny-{model_type}")
    return record_trace(loaded, prompts, sampling="greedy", spec_depth=2, record_hidden=True,
                        prompt_embedder=None, progress=False)


@pytest.fixture(scope="module")
def store_of():
    """store_of(model_type) -> a small store Trace recorded from the tiny model (cached)."""
    return _store


@pytest.fixture()
def mixtral():
    return toy_model("mixtral")
