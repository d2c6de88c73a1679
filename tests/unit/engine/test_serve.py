"""serve_engine: the app's backend=engine entry (prompts in, metrics and series out)."""

from __future__ import annotations

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.cache import CACHES
from moeexp.data.prompts import Prompt
from moeexp.engine.serve import check_serve_settings, serve_engine
from moeexp.errors import ConfigError
from moeexp.metrics import CORE_KEYS
from moeexp.models.adapters import adapter_for
from moeexp.models.loading import LoadedModel
from moeexp.predictors import PREDICTORS
from moeexp.traces.recorder import trace_dims


def _loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, adapter=adapter_for(model), name="tiny",
                       source="test")


def _prompts(n: int, out: int) -> list[Prompt]:
    return [Prompt(request_id=10 + i, text=f"p{i}", input_ids=tuple(prompt_ids(6 + i, seed=i)[0].tolist()),
                   prompt_len=6 + i, output_len=out, split="test", dataset="synthetic")
            for i in range(n)]


def test_backend_serves_every_prompt(mixtral, store_of) -> None:
    """Three prompts of 4 output tokens, seeded top-k sampling, finemoe's policies fitted on
    a store: every CORE_KEY, 3 requests, 4 forward passes each (prefill + 3 decodes)."""
    loaded = _loaded(mixtral)
    dims = trace_dims(loaded.adapter, 4)
    pred = PREDICTORS.build("expert_map", dims=dims, prefetch_distance=1)
    cache = CACHES.build("finemoe", capacity_slots=8, num_layers=dims.num_layers,
                         num_experts=dims.num_experts)
    store = store_of("mixtral")
    pred.fit(store)
    cache.fit(store)
    m = serve_engine(loaded, _prompts(3, 4), pred, cache,
                           {"sampling": "top_k", "top_k": 20, "seed": 1, "progress": False,
                            "batch_size": 1}).metrics
    assert set(CORE_KEYS) <= set(m)
    assert m["requests_total"] == 3
    assert m["expert_slots"] == 8
    assert m["accesses_total"] > 0 and m["ttft_ms_mean"] > 0 and m["tpot_ms_mean"] > 0
    assert mixtral.config._experts_implementation == "grouped_mm"


def test_backend_greedy_is_deterministic(mixtral) -> None:
    """Greedy deepspeed twice: identical hit rate and traffic (no timing-dependent choice)."""
    loaded = _loaded(mixtral)
    dims = trace_dims(loaded.adapter, 0)
    runs = []
    for _ in range(2):
        pred = PREDICTORS.build("none", dims=dims)
        cache = CACHES.build("lru", capacity_slots=4, num_layers=dims.num_layers,
                             num_experts=dims.num_experts)
        runs.append(serve_engine(loaded, _prompts(2, 3), pred, cache,
                                       {"progress": False, "warmup": 0}).metrics)
    assert runs[0]["hit_rate"] == runs[1]["hit_rate"]
    assert runs[0]["h2d_bytes_total"] == runs[1]["h2d_bytes_total"]


def test_backend_rejects_bad_sampling(mixtral) -> None:
    loaded = _loaded(mixtral)
    dims = trace_dims(loaded.adapter, 0)
    pred = PREDICTORS.build("none", dims=dims)
    cache = CACHES.build("lru", capacity_slots=4, num_layers=dims.num_layers,
                         num_experts=dims.num_experts)
    with pytest.raises(ConfigError, match="sampling"):
        _ = serve_engine(loaded, _prompts(1, 2), pred, cache,
                           {"sampling": "nucleus", "progress": False, "warmup": 0}).metrics


def test_serve_settings_are_checked_before_any_work() -> None:
    """A misspelled backend key names the close valid one; a bad setting value and an
    unknown device are refused by the same check the backend runs at validation."""
    with pytest.raises(ConfigError, match="'bandwith_bps' \\(did you mean 'bandwidth_bps'\\?\\)"):
        check_serve_settings({"name": "engine", "bandwith_bps": 1e9})
    with pytest.raises(ConfigError, match="backend.device='tpu'"):
        check_serve_settings({"device": "tpu"})
    check_serve_settings({"name": "engine", "sampling": "greedy", "bandwidth_bps": 1e9})
