"""The engine's N emulated devices (:mod:`moeexp.engine.devices`): under routing replay and
``prefetch_wait`` it takes the simulator's decisions on the same topology (placement,
per-device budgets, demand concurrency), device by device."""

from __future__ import annotations

import pytest
import torch
from tests.unit.engine.test_routing_replay import KEYS, _instant_link, _recorded

from moeexp.cache import CACHES
from moeexp.engine import build_offloaded
from moeexp.engine.budget import budget_of
from moeexp.engine.devices import DeviceCaches
from moeexp.engine.predict import PredictorRunner
from moeexp.engine.routing_replay import RoutingReplay, replay_requests
from moeexp.engine.runtime import Engine, EngineSettings
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.simulator.mechanics import Mechanics
from moeexp.simulator.topology import Topology, build_device_caches

SYSTEMS = {"deepspeed": ("none", "lru"), "oracle": ("oracle", "belady"),
           "hit_count": ("hit_count", "lfu"), "prefetch_if_pays": ("reuse_prob", "next_use")}


def _policies(system: str, dims, topo: Topology, capacity: float, store):
    pred_name, cache_name = SYSTEMS[system]
    kw = {"hit_count": {"prefetch_distance": 1},
          "prefetch_if_pays": {"spec": "off"}}.get(system, {})  # replayed: no spec gates
    pred = PREDICTORS.build(pred_name, dims=dims, **kw)
    caches = build_device_caches({"name": cache_name, "capacity": capacity}, dims, topo)
    if store is not None:
        pred.fit(store)
        for c in caches:
            c.fit(store)
    return pred, caches


@pytest.mark.parametrize(("system", "devices", "placement", "budget", "demand", "capacity"), [
    ("deepspeed", 3, "round_robin", "per_device", "single", 0.2),
    ("deepspeed", 2, "contiguous", "total", "per_device", 0.4),
    ("oracle", 3, "round_robin", "total", "single", 0.4),
    ("hit_count", 2, "round_robin", "per_device", "per_device", 0.25),
])
def test_engine_takes_the_simulators_decisions_on_n_devices(
        system, devices, placement, budget, demand, capacity, store_of) -> None:
    """Routing forced to the seed-0 model's trace, ``prefetch_wait`` on N emulated links
    against a zero-time simulated link on the same topology: hit rate, bytes, loads,
    prefetches and every device's bytes equal the simulator's."""
    trace = _recorded()
    d = trace.dims
    topo = Topology.build(devices=devices, placement={"name": placement},
                          demand_concurrency=demand, budget=budget)
    store = store_of("mixtral") if system == "hit_count" else None
    pred, caches = _policies(system, d, topo, capacity, store)
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    replay = RoutingReplay(trace, ad)
    settings = EngineSettings(predictor_async=False, prefetch_wait=True)
    with build_offloaded(model, ad, pred, caches, settings, routing=replay, topology=topo) as om:
        replay_requests(om, replay)
        m = om.metrics()
    pred, caches = _policies(system, d, topo, capacity, store)
    sim = simulate(trace, pred, caches, _instant_link(d), progress=False, topology=topo).metrics
    keys = [*KEYS, "devices", "demand_concurrency", "cache_budget_scope",
            *(f"dev{i}_{k}" for i in range(devices)
              for k in ("h2d_bytes_total", "expert_cache_bytes"))]
    for key in keys:
        assert m[key] == sim[key], key
    assert m["h2d_bytes_total"] > 0 and m["devices"] == devices
    assert sum(m[f"dev{i}_h2d_bytes_total"] for i in range(devices)) == m["h2d_bytes_total"]


@pytest.mark.parametrize(("system", "devices", "demand_load", "flush"), [
    ("deepspeed", 3, "all_experts", True),
    ("hit_count", 2, "all_experts", False),
    ("hit_count", 1, "activated", True),
    ("prefetch_if_pays", 1, "all_experts", True),  # the engine tells next_use the mode too
    # several devices: experts without tokens are released once loaded (engine.zero_time)
    ("prefetch_if_pays", 2, "all_experts", True),
    ("prefetch_if_pays", 3, "all_experts", False),
])
def test_engine_takes_the_simulators_decisions_with_the_artifacts_mechanics(
        system, devices, demand_load, flush, store_of) -> None:
    """The artifact's mechanics in the engine (every expert of a layer touched in index
    order, the cache flushed after each forward pass), on one or several emulated devices
    with per-device budgets: the simulator's decisions, bytes and accesses (all J experts
    of a layer count), device by device; the rows say which mechanics ran."""
    trace = _recorded()
    d = trace.dims
    topo = Topology.build(devices=devices, budget="per_device")
    mech = Mechanics(demand_load=demand_load, flush_per_token=flush)
    store = store_of("mixtral") if system in ("hit_count", "prefetch_if_pays") else None
    pred, caches = _policies(system, d, topo, 0.25, store)
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    replay = RoutingReplay(trace, ad)
    settings = EngineSettings(predictor_async=False, prefetch_wait=True)
    cost = _instant_link(d) if system == "prefetch_if_pays" else None  # as simulate binds
    with build_offloaded(model, ad, pred, caches, settings, routing=replay, topology=topo,
                         mechanics=mech, cost=cost) as om:
        replay_requests(om, replay)
        m = om.metrics()
    pred, caches = _policies(system, d, topo, 0.25, store)
    sim = simulate(trace, pred, caches, _instant_link(d), progress=False, topology=topo,
                   mechanics=mech).metrics
    keys = [*KEYS, "misses_total", "prefetches_wasted", "demand_load", "flush_per_token",
            *(f"dev{i}_h2d_bytes_total" for i in range(devices))]
    for key in keys:
        assert m[key] == sim[key], key
    if demand_load == "all_experts":  # every expert of every layer, every pass
        assert m["accesses_total"] % (d.num_layers * d.num_experts) == 0


def test_several_devices_need_one_policy_each() -> None:
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    pol = CACHES.build("lru", capacity_slots=4, num_layers=2, num_experts=8)
    pred = PREDICTORS.build("none", dims=_recorded(n=1, new=1).dims)
    with pytest.raises(ConfigError, match="needs 2 cache policies"):
        build_offloaded(model, ad, pred, pol, EngineSettings(), topology=Topology(devices=2))
    with pytest.raises(ConfigError, match="its own cache policy"):
        DeviceCaches([pol, pol], [[0, 1] * 4] * 2)


def test_several_devices_on_cuda_are_refused() -> None:
    """No multi-GPU path yet: a clear ConfigError before any slot is allocated."""
    model = toy_model("mixtral", seed=1)
    ad = adapter_for(model)
    topo = Topology(devices=2)
    caches = [CACHES.build("lru", capacity_slots=2, num_layers=2, num_experts=8) for _ in range(2)]
    runner = PredictorRunner(PREDICTORS.build("none", dims=_recorded(n=1, new=1).dims),
                             asynchronous=False)
    where = topo.device_map(2, 8).tolist()
    try:
        with pytest.raises(ConfigError, match="CPU only"):
            Engine(ad, runner, DeviceCaches(caches, where), budget_of(4, _recorded(n=1, new=1).dims),
                   torch.device("cuda"), EngineSettings(), topology=topo)
    finally:
        runner.close()
