"""Several devices, each with its own link, slots and policy (:mod:`moeexp.simulator.
device_group`): hand-built timelines and properties of random replays.

Hand-built cases use :func:`simhelpers.unit_cost`: a copy takes 1.0 s, an expert FFN 0.1 s,
a layer's dense part 0.1 s. ``PAIR``: one request, a one-token prefill, one layer, the
token picks experts 0 and 1; round robin puts (0, 0) on device 0 and (0, 1) on device 1.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from tests.fixtures.replay_cases import WALL_KEYS
from tests.unit.simulator.simhelpers import (
    CapacityWatch,
    ScriptedPredictor,
    hand_trace,
    unit_cost,
    unit_profile,
)

from moeexp.cache import CACHES
from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel
from moeexp.errors import ConfigError
from moeexp.metrics import PARTS_OF
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import Predictor
from moeexp.simulator import simulate
from moeexp.simulator.topology import Topology, build_device_caches
from moeexp.traces.synthetic import random_trace

GB = 10**9
PAIR = [[[[[0, 1]]]]]


def _lrus(n: int, slots: int, L: int, J: int) -> list[LRUCache]:
    return [LRUCache(capacity_slots=slots, num_layers=L, num_experts=J) for _ in range(n)]


def _run(tr, pred, caches, topo=None, **kw):
    return simulate(tr, pred, caches, unit_cost(tr.dims), progress=False, topology=topo,
                    **kw).metrics


def test_two_misses_on_two_devices_copy_in_parallel_with_per_device_demand() -> None:
    """Both misses load from 0.1 on their own links, ready at 1.1: the layer stalls 1.0 s
    (waiting for (0,0)), computes (0,0) to 1.2, and (0,1) is ready: TTFT 1.3. One device
    (or one demand thread) loads them one after the other: (0,1) ready at 2.1, stall
    1.0 + 0.9 = 1.9 s, TTFT 2.2."""
    tr = hand_trace(PAIR, 2)
    par = _run(tr, Predictor(dims=tr.dims), _lrus(2, 1, 1, 2),
               Topology(devices=2, demand_concurrency="per_device"))
    assert par["stall_ms_total"] == pytest.approx(1000, abs=1e-3)
    assert par["ttft_ms_mean"] == pytest.approx(1300, abs=1e-3)
    assert par["dev0_h2d_bytes_total"] == par["dev1_h2d_bytes_total"] == GB
    single = _run(tr, Predictor(dims=tr.dims), _lrus(2, 1, 1, 2), Topology(devices=2))
    one = _run(tr, Predictor(dims=tr.dims), _lrus(1, 2, 1, 2))
    for m in (single, one):
        assert m["stall_ms_total"] == pytest.approx(1900, abs=1e-3)
        assert m["ttft_ms_mean"] == pytest.approx(2200, abs=1e-3)
    assert single["stall_demand_ms_total"] == pytest.approx(1900, abs=1e-3)


def test_prefetches_drain_over_every_link_at_once_whatever_the_demand_thread() -> None:
    """Both experts prefetched at t=0: on two links both are ready at 1.0; the layer (at
    0.1) waits 0.9 s for them and ends at 1.2. One link copies them 0-1.0 and 1.0-2.0:
    stall 0.9 + 0.9 s, TTFT 2.1. Each link was busy 1.0 s of the 1.2 s."""
    tr = hand_trace(PAIR, 2)
    at = [(1.0, 0, 0), (1.0, 0, 1)]
    two = _run(tr, ScriptedPredictor(dims=tr.dims, at_start=at), _lrus(2, 1, 1, 2),
               Topology(devices=2))
    assert two["stall_ms_total"] == pytest.approx(900, abs=1e-3)
    assert two["ttft_ms_mean"] == pytest.approx(1200, abs=1e-3)
    assert two["stall_late_prefetch_ms_total"] == pytest.approx(900, abs=1e-3)
    assert two["dev0_link_utilization"] == pytest.approx(1.0 / 1.2)
    assert two["link_busy_ms_total"] == pytest.approx(2000)
    one = _run(tr, ScriptedPredictor(dims=tr.dims, at_start=at), _lrus(1, 2, 1, 2))
    assert one["stall_ms_total"] == pytest.approx(1800, abs=1e-3)
    assert one["ttft_ms_mean"] == pytest.approx(2100, abs=1e-3)


def test_a_host_limit_caps_the_links_together() -> None:
    """``host_gbps``: both prefetches at t=0 behind one 1 GB/s host limit cross it one
    after the other (ready 1.0 and 2.0) as on one link: stall 1.8 s, TTFT 2.1, link 1 busy
    2.0 s; at 2 GB/s (the two links' sum) nothing changes against no limit; a limit above
    a single link's rate leaves one device bit-identical and the floor is NaN under one."""
    tr = hand_trace(PAIR, 2)
    at = [(1.0, 0, 0), (1.0, 0, 1)]

    def go(gbps, devices=2):
        return _run(tr, ScriptedPredictor(dims=tr.dims, at_start=at),
                    _lrus(devices, 2 // devices, 1, 2), Topology(devices=devices, host_gbps=gbps))

    capped, free, wide = go(1.0), go(None), go(2.0)
    assert capped["stall_ms_total"] == pytest.approx(1800, abs=1e-3)
    assert capped["ttft_ms_mean"] == pytest.approx(2100, abs=1e-3)
    assert capped["dev1_link_busy_ms_total"] == pytest.approx(2000)
    assert capped["host_gbps"] == 1.0 and "host_gbps" not in free
    for k in ("stall_ms_total", "ttft_ms_mean", "link_busy_ms_total"):
        assert wide[k] == free[k], k
    one, one_wide = go(None, 1), go(5.0, 1)
    assert one_wide["ttft_ms_mean"] == one["ttft_ms_mean"]
    assert math.isnan(one_wide["bound_ttft_ms_mean"]) and not math.isnan(one["bound_ttft_ms_mean"])
    slow = go(0.5, 1)  # below the link: each copy 2.0 s
    assert slow["ttft_ms_mean"] == pytest.approx(4100, abs=1e-3)


def test_a_host_limit_is_checked() -> None:
    with pytest.raises(ConfigError, match="host_gbps must be a number of GB/s > 0"):
        Topology(devices=2, host_gbps=0.0)
    tr = hand_trace(PAIR, 2)
    prof = dataclasses.replace(unit_profile(), copy_chunk_mb=250.0)
    with pytest.raises(ConfigError, match="whole-expert copies only"):
        simulate(tr, Predictor(dims=tr.dims), _lrus(2, 1, 1, 2),
                 CostModel.from_profile(prof, tr.dims, dtype_bytes=2), progress=False,
                 topology=Topology(devices=2, host_gbps=1.0))


class _WatchedLRU(CapacityWatch, LRUCache):
    pass


def test_contiguous_layers_load_over_their_own_device_within_its_budget() -> None:
    """Two layers on two devices, contiguous: layer 0's experts only cross link 0 and
    layer 1's only link 1. Device 0 has one slot for layer 0's two experts: they stream
    through it (the policy never holds two): pass 1 copies both, pass 2 hits (0,1), left
    from pass 1, and copies (0,0) again once (0,1) has computed: 3 copies on link 0."""
    tr = hand_trace([[[[[0, 1], [0, 1]]], [[[0, 1], [0, 1]]]]], 2)
    caches = [_WatchedLRU(capacity_slots=1, num_layers=2, num_experts=2),
              _WatchedLRU(capacity_slots=2, num_layers=2, num_experts=2)]
    topo = Topology.build(devices=2, placement={"name": "contiguous"})
    m = _run(tr, Predictor(dims=tr.dims), caches, topo)
    assert caches[0].peak == 1 and caches[1].peak == 2
    assert m["dev0_h2d_bytes_total"] == 3 * GB
    assert m["dev1_h2d_bytes_total"] == 2 * GB  # layer 1 stays resident
    assert m["h2d_bytes_total"] == 5 * GB and m["devices"] == 2
    assert (m["hits_total"], m["misses_total"]) == (3, 5)
    assert m["dev0_expert_cache_bytes"] == GB and m["expert_cache_bytes"] == 3 * GB


def test_a_topology_of_one_device_changes_nothing() -> None:
    """``Topology(devices=1)`` is the plain one-device replay: every metric and series
    (wall clocks aside) equal to the replay without a topology."""
    tr = random_trace(num_layers=4, num_experts=8, num_requests=8, seed=3)
    store, test = tr.split("store"), tr.split("test")
    cost = unit_cost(tr.dims)

    def go(topo):
        pred = PREDICTORS.build("expert_map", dims=tr.dims, prefetch_distance=2)
        cache = CACHES.build("finemoe", capacity_slots=8, num_layers=4, num_experts=8)
        pred.fit(store)
        cache.fit(store)
        return simulate(test, pred, cache, cost, progress=False, topology=topo)

    a, b = go(None), go(Topology(devices=1, budget="per_device"))
    strip = {k: v for k, v in a.metrics.items() if k not in WALL_KEYS and k != "cache_budget_scope"}
    assert all(strip[k] == b.metrics[k] or (math.isnan(strip[k]) and math.isnan(b.metrics[k]))
               for k in strip if isinstance(strip[k], float))
    assert a.series == b.series


def test_restricted_routing_on_several_devices_is_refused() -> None:
    tr = hand_trace(PAIR, 2)
    with pytest.raises(ConfigError, match="modelled on one device"):
        _run(tr, Predictor(dims=tr.dims), _lrus(2, 1, 1, 2), Topology(devices=2),
             restricted_routing=True)


def test_one_policy_per_device_is_required() -> None:
    tr = hand_trace(PAIR, 2)
    with pytest.raises(ConfigError, match="one per device"):
        _run(tr, Predictor(dims=tr.dims), _lrus(1, 1, 1, 2), Topology(devices=2))
    same = LRUCache(capacity_slots=1, num_layers=1, num_experts=2)
    with pytest.raises(ConfigError, match="own cache policy"):
        _run(tr, Predictor(dims=tr.dims), [same, same], Topology(devices=2))


@pytest.mark.parametrize("system", [("expert_map", {"prefetch_distance": 2}, "finemoe"),
                                    ("oracle", {}, "belady"), ("none", {}, "lru")])
@pytest.mark.parametrize("chunk_mb", [0.0, 250.0])
def test_random_replays_on_three_devices_keep_the_books(system, chunk_mb) -> None:
    """Three devices, round robin, total budget, per-device demand, copy-bound: the
    traffic and stall identities hold, the devices' bytes add up to the total, every link
    is busy copies x copy time (within the makespan, but for the last copy), and the one-link latency floor is not claimed (NaN)."""
    pname, pkw, cname = system
    tr = random_trace(num_layers=4, num_experts=8, num_requests=10, seed=1)
    store, test = tr.split("store"), tr.split("test")
    topo = Topology(devices=3, demand_concurrency="per_device")
    pred = PREDICTORS.build(pname, dims=tr.dims, **pkw)
    caches = build_device_caches({"name": cname, "capacity": 0.5}, tr.dims, topo)
    pred.fit(store)
    for c in caches:
        c.fit(store)
    prof = dataclasses.replace(unit_profile(), copy_chunk_mb=chunk_mb)
    cost = CostModel.from_profile(prof, tr.dims, dtype_bytes=2)
    m = simulate(test, pred, caches, cost, progress=False, topology=topo, batch_size=2).metrics
    for total, parts in PARTS_OF.items():
        assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-12, abs=1e-9), total
    assert sum(m[f"dev{d}_h2d_bytes_total"] for d in range(3)) == m["h2d_bytes_total"]
    copies = m["h2d_bytes_total"] / tr.dims.expert_bytes
    assert m["link_busy_ms_total"] == pytest.approx(copies * cost.copy_plan.copy_s * 1e3)
    assert m["hits_total"] + m["misses_total"] == m["accesses_total"]
    for d in range(3):  # a link may still finish one copy started before the last pass ended
        busy = m[f"dev{d}_link_busy_ms_total"]
        assert 0.0 <= busy <= m["makespan_ms"] + cost.copy_plan.copy_s * 1e3
        assert m[f"dev{d}_link_utilization"] == pytest.approx(busy / m["makespan_ms"])
    assert math.isnan(m["bound_tpot_ms_mean"])
