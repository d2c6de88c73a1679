"""Routing replay: the engine on a model with other weights, forced to a trace's routing,
takes the simulator's decisions on that trace."""

from __future__ import annotations

import dataclasses
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.cache import CACHES
from moeexp.costmodel import CostModel, load_profile
from moeexp.engine import build_offloaded
from moeexp.engine.routing_replay import (
    RoutingReplay,
    ordered,
    replay_labels,
    replay_requests,
    request_cache,
    serve_order,
)
from moeexp.engine.runtime import EngineSettings
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.kv import kv_argument
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.schema import Trace

KEYS = ("hit_rate", "h2d_bytes_total", "accesses_total", "requests_total",
        "demand_loads_total", "prefetches_issued")


def _recorded(model_type: str = "mixtral", n: int = 3, new: int = 4) -> Trace:
    """A test trace recorded from the seed-0 tiny model (prefill + decode, exact routing)."""
    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    model = toy_model(model_type, seed=0)
    prompts = [Prompt(request_id=i, text="", input_ids=tuple(prompt_ids(6 + i, seed=i)[0].tolist()),
                      prompt_len=6 + i, output_len=new, split="test", dataset="synthetic")
               for i in range(n)]
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name="t")
    return record_trace(loaded, prompts, sampling="greedy", spec_depth=0, prompt_embedder=None,
                        progress=False)


def _policies(system: str, dims, slots: int, store: Trace | None):
    pred_name, cache_name = {"deepspeed": ("none", "lru"), "static": ("none", "static"),
                             "oracle": ("oracle", "belady")}[system]
    pred = PREDICTORS.build(pred_name, dims=dims)
    pol = CACHES.build(cache_name, capacity_slots=slots, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    if store is not None:
        pred.fit(store)
        pol.fit(store)
    return pred, pol


def _instant_link(dims) -> CostModel:
    """The simulator's counterpart of ``prefetch_wait``: copies take no time, so every
    prefetch started before a layer has landed when the layer needs it."""
    prof = dataclasses.replace(load_profile("rtx3090_pcie4"), h2d_gbps=1e12, copy_latency_us=0.0)
    return CostModel.from_profile(prof, dims)


def _engine(trace: Trace, system: str, slots: int, store: Trace | None, seed: int = 1,
            model_type: str = "mixtral", device: str = "cpu", prompt_kv: bool = False
            ) -> tuple[dict[str, float], list]:
    model = toy_model(model_type, seed=seed).to(device)  # other weights: other routing
    ad = adapter_for(model)
    pred, pol = _policies(system, trace.dims, slots, store)
    replay = RoutingReplay(trace, ad)
    settings = EngineSettings(predictor_async=False, prefetch_wait=True)
    with build_offloaded(model, ad, pred, pol, settings, routing=replay) as om:
        series = replay_requests(om, replay, prompt_kv=prompt_kv)
        return om.metrics(), series.tpot_ms


@pytest.mark.parametrize("system", ["deepspeed", "static", "oracle"])
def test_replay_takes_the_simulators_decisions(system: str, store_of) -> None:
    """deepspeed, static and oracle on a model with other weights, routing forced to the
    seed-0 model's trace: hit rate, bytes, accesses, loads and prefetches equal the
    simulator's on that trace (and the model's own routing would have given other
    accesses). ``prefetch_wait`` and a zero-time simulated link take thread timing out of
    oracle's prefetch hits, so the comparison is of decisions alone."""
    trace = _recorded()
    store = store_of("mixtral") if system == "static" else None
    d = trace.dims
    slots = 6
    m, tpot = _engine(trace, system, slots, store)
    pred, pol = _policies(system, d, slots, store)
    sim = simulate(trace, pred, pol, _instant_link(d), progress=False).metrics
    for key in KEYS:
        assert m[key] == sim[key], key
    assert m["routing_replay"] == 1.0 and m["h2d_bytes_total"] > 0
    assert len(tpot) == 3 and all(np.isfinite(tpot))


def test_without_replay_the_other_model_routes_differently() -> None:
    """The check above is not vacuous: the seed-1 model's own routing differs."""
    trace = _recorded(n=1)
    other = _recorded_with(seed=1)
    assert not np.array_equal(trace.topk_idx, other.topk_idx)


def _recorded_with(seed: int) -> Trace:
    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    model = toy_model("mixtral", seed=seed)
    p = Prompt(request_id=0, text="", input_ids=tuple(prompt_ids(6, seed=0)[0].tolist()),
               prompt_len=6, output_len=4, split="test", dataset="synthetic")
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name="t")
    return record_trace(loaded, [p], sampling="greedy", spec_depth=0, prompt_embedder=None,
                        progress=False)


def _routing_only(trace: Trace) -> Trace:
    """The decode steps of ``trace`` with nothing but top-k ids and weights (imported style)."""
    keep = np.flatnonzero(trace.iter_step > 0)
    rows = np.concatenate([np.arange(trace.iter_offsets[i], trace.iter_offsets[i + 1])
                           for i in keep])
    lens = np.diff(trace.iter_offsets)[keep]
    return replace(trace, iter_request=trace.iter_request[keep], iter_step=trace.iter_step[keep],
                   iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                   probs=None, topk_idx=trace.topk_idx[rows], topk_weight=trace.topk_weight[rows],
                   embed=None, token_ids=None, spec_probs=None, hidden=None)


@pytest.mark.parametrize("model_type", ["gpt_oss", "mixtral"])
def test_routing_only_trace_replays_decode_steps(model_type: str) -> None:
    """A routing-only, decode-only trace (like the imported gpt-oss-20b one) replays: one
    pass per decode step, TTFT undefined, bytes equal the simulator's for deepspeed."""
    trace = _routing_only(_recorded(model_type))
    assert "prefill" not in trace.capabilities and "token_ids" not in trace.capabilities
    slots = 2 * trace.dims.top_k
    m, tpot = _engine(trace, "deepspeed", slots, None, model_type=model_type, prompt_kv=True)
    pred, pol = _policies("deepspeed", trace.dims, slots, None)
    sim = simulate(trace, pred, pol, _instant_link(trace.dims), progress=False).metrics
    for key in KEYS:
        assert m[key] == sim[key], key
    assert np.isnan(m["ttft_ms_mean"]) and all(np.isfinite(tpot))
    assert replay_labels(trace) == {"routing_source": "replay", "exact": False,
                                    "replay_trace": "t", "replay_prompt_in_kv": False}
    assert replay_labels(trace, prompt_kv=True)["replay_prompt_in_kv"] is True
    assert replay_labels(_recorded())["replay_prompt_in_kv"] is True  # it has prefills


@pytest.mark.parametrize("model_type", ["gpt_oss", "mixtral"])
def test_request_cache_holds_the_prompt(model_type: str) -> None:
    """request_cache(model, P): every layer starts with P positions (a sliding-window
    layer keeps its window), and a decode pass then attends over P + 1."""
    model = toy_model(model_type)
    cache = request_cache(model, 9)
    assert cache.get_seq_length() == 9
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True,
              **{kv_argument(model): cache})
    assert cache.get_seq_length() == 10
    assert request_cache(model, 0).get_seq_length() == 0
    with pytest.raises(ConfigError, match="MLA"):
        request_cache(toy_model("deepseek_v2"), 4)


def test_replay_refuses_a_trace_of_another_shape() -> None:
    """A trace whose L/J/K differ from the model's is refused, naming both shapes."""
    trace = _recorded()
    model = toy_model("phimoe")  # L=2, J=4: the trace's J is 8
    with pytest.raises(ConfigError, match="J=8.*the model has L=2, J=4"):
        RoutingReplay(trace, adapter_for(model))


def test_speculative_predictor_is_not_applicable_to_a_routing_only_trace() -> None:
    """mixtral_offloading's speculative gate needs spec_probs; a routing-only trace has
    none: refused as not applicable, before any weight moves."""
    trace = _routing_only(_recorded())
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    pred = PREDICTORS.build("speculative_gate", dims=replace(trace.dims, spec_depth=1),
                            distance=1)
    pol = CACHES.build("lru_per_layer", capacity_slots=8, num_layers=trace.dims.num_layers,
                       num_experts=trace.dims.num_experts)
    with pytest.raises(ConfigError, match="not applicable.*speculative"):
        build_offloaded(model, ad, pred, pol, EngineSettings(), routing=RoutingReplay(trace, ad))
    assert model.config._experts_implementation == "grouped_mm"


def test_serve_order_groups_requests_by_step() -> None:
    """Interleaved iterations are served request by request, steps ascending."""
    trace = _recorded(n=2, new=3)
    perm = np.array([3, 0, 4, 1, 5, 2])  # mix the two requests' passes
    shuffled = ordered(replace(trace, iter_request=trace.iter_request[perm],
                               iter_step=trace.iter_step[perm]))
    assert serve_order(trace).tolist() == list(range(6))
    assert shuffled.iter_request.tolist() == sorted(trace.iter_request.tolist())
    assert torch.equal(torch.from_numpy(ordered(trace).topk_idx), torch.from_numpy(trace.topk_idx))


@pytest.mark.gpu
@pytest.mark.parametrize("system", ["deepspeed", "oracle"])
def test_replay_on_cuda_takes_the_simulators_decisions(system: str) -> None:
    """The same on CUDA (pinned host store, copy stream, batched decode kernel)."""
    trace = _recorded()
    m, tpot = _engine(trace, system, 6, None, device="cuda")
    pred, pol = _policies(system, trace.dims, 6, None)
    sim = simulate(trace, pred, pol, _instant_link(trace.dims), progress=False).metrics
    for key in KEYS:
        assert m[key] == sim[key], key
    assert all(np.isfinite(tpot))


@pytest.mark.parametrize("capacity", [0.25, 0.5])
def test_lossy_replay_takes_the_simulators_decisions(capacity: float, store_of) -> None:
    """eMoE (restricted routing) on a model with other weights, routing forced to the trace:
    under ``restricted_wait`` (every copy lands before a lossy layer; the simulator's
    counterpart is a zero-time link) the engine keeps the very experts the simulator keeps:
    hit rate, bytes, substitutions and drops equal. A layer's own predictions (eMoE streams
    the next layer while one runs) must not evict that layer's experts before it runs: the
    simulator starts no prefetch made at a layer's time before the layer is served; and
    prefetches start only while the engine settles before a layer (at 25 % capacity, when
    the copy thread could start them whenever it found the queue non-empty, about half the
    runs ended at hit rate 0.289 instead of the simulator's 0.281)."""
    from moeexp.cache import build_cache
    from moeexp.predictors import build_predictor
    from moeexp.systems import resolve_system

    trace = _recorded(n=4, new=5)
    store = store_of("mixtral")
    pcfg, ccfg, _ = resolve_system("emoe", None, {"capacity": capacity})

    def policies():  # type: ignore[no-untyped-def]
        pred, pol = build_predictor(pcfg, trace.dims), build_cache(ccfg, trace.dims)
        pred.fit(store)
        pol.fit(store)
        return pred, pol

    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    replay = RoutingReplay(trace, ad)
    settings = EngineSettings(predictor_async=False, restricted_routing=True,
                              restricted_wait=True)
    with build_offloaded(model, ad, *policies(), settings, routing=replay) as om:
        replay_requests(om, replay)
        m = om.metrics()
    sim = simulate(trace, *policies(), _instant_link(trace.dims), restricted_routing=True,
                   progress=False).metrics
    for key in (*KEYS, "substitution_rate", "routing_dropped_rate"):
        assert m[key] == pytest.approx(sim[key], abs=1e-12), key
    assert m["substitution_rate"] > 0


def test_prefetch_if_pays_gets_the_cost_model_and_takes_the_simulators_decisions(
        store_of) -> None:
    """The engine binds the cost model it is given (``Predictor.bind``, as ``simulate``):
    ``prefetch_if_pays`` (reuse_prob + next_use) learns the copy time and each pass's
    compute window there, and on the forced routing it takes the simulator's decisions
    (hits, bytes, loads, prefetches) under the same cost model."""
    trace = _recorded()
    store = store_of("mixtral")
    d = trace.dims
    link = _instant_link(d)

    def policies():
        pred = PREDICTORS.build("reuse_prob", dims=d, depth=2, spec="off")  # trace: no gates
        pol = CACHES.build("next_use", capacity_slots=6, num_layers=d.num_layers,
                           num_experts=d.num_experts)
        pred.fit(store)
        pol.fit(store)
        return pred, pol

    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    pred, pol = policies()
    replay = RoutingReplay(trace, ad)
    settings = EngineSettings(predictor_async=False, prefetch_wait=True)
    with build_offloaded(model, ad, pred, pol, settings, routing=replay, cost=link) as om:
        replay_requests(om, replay)
        m = om.metrics()
    assert pol.copy_s == pytest.approx(link.copy_s) and pol.window_s is not None
    sim_pred, sim_pol = policies()
    sim = simulate(trace, sim_pred, sim_pol, link, progress=False).metrics
    for key in KEYS:
        assert m[key] == sim[key], key
    assert m["prefetches_issued"] > 0
