"""One MoE layer's procedure (:mod:`moeexp.engine.layer`): under ``prefetch_wait`` the
engine takes the simulator's copy order (algorithms.md §4: on-demand loads pre-empt queued
prefetches), so a prefetching system's every policy call equals the simulator's."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
from tests.unit.conftest import prompt_ids

from moeexp.cache import build_cache
from moeexp.costmodel import CostModel, load_profile
from moeexp.engine import build_offloaded
from moeexp.engine.routing_replay import RoutingReplay, replay_requests
from moeexp.engine.runtime import EngineSettings
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import build_predictor
from moeexp.simulator import simulate
from moeexp.systems import resolve_system
from moeexp.traces.schema import Trace

Event = tuple[Any, ...]


@pytest.fixture(scope="module")
def test_trace() -> Trace:
    """Three greedy requests of the seed-0 tiny Mixtral (prefill + 4 decode steps),
    speculative gates and hidden states recorded (every predictor can run on it)."""
    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    model = toy_model("mixtral", seed=0)
    prompts = [Prompt(request_id=i, text="", input_ids=tuple(prompt_ids(6 + i, seed=i)[0].tolist()),
                      prompt_len=6 + i, output_len=4, split="test", dataset="synthetic")
               for i in range(3)]
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name="t")
    return record_trace(loaded, prompts, sampling="greedy", spec_depth=2, record_hidden=True,
                        prompt_embedder=None, progress=False)


def _logged(policy: Any, log: list[Event]) -> Any:
    """``policy`` with every access, insertion and eviction appended to ``log`` (in call
    order: (layer, expert), the policy's clock, hit / prefetched)."""
    on_access, on_insert, on_evict = policy.on_access, policy.on_insert, policy.on_evict

    def access(key: Any, now: int, hit: bool) -> None:
        log.append(("access", key, now, bool(hit)))
        on_access(key, now, hit)

    def insert(key: Any, now: int, prefetched: bool) -> None:
        log.append(("insert", key, now, bool(prefetched)))
        on_insert(key, now, prefetched)

    def evict(key: Any) -> None:
        log.append(("evict", key))
        on_evict(key)

    policy.on_access, policy.on_insert, policy.on_evict = access, insert, evict
    return policy


def _per_layer_hits(log: list[Event], num_layers: int) -> list[int]:
    out = [0] * num_layers
    for ev in log:
        if ev[0] == "access" and ev[3]:
            out[ev[1][0]] += 1
    return out


@pytest.mark.parametrize("capacity", [0.25, 0.5])
@pytest.mark.parametrize("system", ["finemoe_no_semantic", "moe_infinity", "mixtral_offloading"])
def test_prefetch_wait_takes_the_simulators_order(system: str, capacity: float,
                                                  test_trace: Trace, store_of) -> None:
    """A prefetching system on the engine (routing replayed from the trace, inline
    predictor, ``prefetch_wait``) against the simulator on a link of zero copy time (the
    counterpart of ``prefetch_wait``): every access (hit or miss), insertion (demand or
    prefetch) and eviction is the same call in the same order, so the per-layer hits are
    equal. Capacity 0.5 (8 of 16 slots): no layer needs more experts than fit; 0.25 (4
    slots): a prefill needs all 8 experts of a layer and streams through the budget, the
    computed experts released one per refused victim search, as the simulator's. Before
    this order, the engine started layer l's own predictions ahead of layer l's demand
    loads (the first insertion differed) and released a streamed chunk all at once (the
    victims of a streaming prefill differed for every policy but LRU)."""
    dims = test_trace.dims
    store = store_of("mixtral")
    pcfg, ccfg, _ = resolve_system(system, None, {"capacity": capacity},
                                   model={"prefetch_distance": 1})
    prof = dataclasses.replace(load_profile("rtx3090_pcie4"), h2d_gbps=1e12, copy_latency_us=0.0)
    logs: dict[str, list[Event]] = {"sim": [], "engine": []}
    objs = {}
    for side in logs:
        pred, pol = build_predictor(pcfg, dims), build_cache(ccfg, dims)
        pred.fit(store)
        pol.fit(store)
        objs[side] = (pred, _logged(pol, logs[side]))
    sim = simulate(test_trace, *objs["sim"], CostModel.from_profile(prof, dims),
                   progress=False).metrics
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    replay = RoutingReplay(test_trace, ad)
    with build_offloaded(model, ad, *objs["engine"],
                         EngineSettings(predictor_async=False, prefetch_wait=True),
                         routing=replay) as om:
        replay_requests(om, replay)
        eng = om.metrics()
    assert sim["prefetches_issued"] > 0  # a prefetching case, not an on-demand one
    assert any(ev[0] == "insert" and ev[3] for ev in logs["sim"])
    assert logs["engine"] == logs["sim"]
    assert (_per_layer_hits(logs["engine"], dims.num_layers)
            == _per_layer_hits(logs["sim"], dims.num_layers))
    for key in ("hit_rate", "hits_total", "prefetches_issued", "h2d_bytes_total"):
        assert eng[key] == sim[key], key
