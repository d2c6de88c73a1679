"""Where the bytes and the stalls go (:func:`moeexp.metrics.traffic_metrics`), on hand-built
timelines (:func:`simhelpers.unit_cost`: a copy 1.0 s, an expert FFN 0.1 s, a layer's dense
part 0.1 s) and, as identities, on random traces through every system."""

from __future__ import annotations

import pytest
from tests.unit.simulator.simhelpers import ScriptedPredictor, hand_trace, unit_cost

from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel, load_profile
from moeexp.metrics import CORE_KEYS, PARTS_OF
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.synthetic import random_trace

GB = 10**9


def _run(trace, predictor, cache, **kw):
    return simulate(trace, predictor, cache, unit_cost(trace.dims), progress=False, **kw).metrics


def test_demand_copy_behind_a_prefetch_splits_into_link_and_demand() -> None:
    """Layer 0 -> 3, layers 1 and 2 -> 0; three prefetches for layer 2 queued at t=0.

    Layer 0 needs (0,3) at 0.1 while the prefetch (2,0) holds the link until 1.0: its
    0.9 s there are link stall, its own copy (1.0 -> 2.0) demand stall. Layer 1 needs (1,0)
    at 2.2 behind the prefetch (2,1) (2.0 -> 3.0): 0.8 s link, 1.0 s demand. Layer 2 hits
    (2,0): that prefetch is used; (2,1) and (2,2) are never used: wasted. One output token.
    """
    tr = hand_trace([[[[[3], [0], [0]]]]], 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 2, 0), (1.0, 2, 1), (1.0, 2, 2)])
    m = _run(tr, pred, LRUCache(capacity_slots=5, num_layers=3, num_experts=4))
    assert m["stall_link_ms_total"] == pytest.approx(1700, abs=1e-3)
    assert m["stall_demand_ms_total"] == pytest.approx(2000, abs=1e-3)
    assert m["stall_late_prefetch_ms_total"] == 0.0
    assert m["stall_ms_total"] == pytest.approx(3700, abs=1e-3)
    assert (m["demand_loads_total"], m["prefetches_issued"]) == (2, 3)
    assert (m["prefetches_used"], m["prefetches_wasted"]) == (1, 2)
    assert m["h2d_demand_bytes_total"] == 2 * GB and m["h2d_prefetch_bytes_total"] == 3 * GB
    assert m["prefetch_used_bytes"] == GB and m["prefetch_waste_bytes"] == 2 * GB
    assert m["output_tokens_total"] == 1
    assert m["h2d_demand_bytes_per_token"] == 2 * GB
    assert m["prefetch_waste_bytes_per_token"] == 2 * GB


class _WarmLRU(LRUCache):
    """LRU that starts with expert (0, 1) resident."""

    def initial_residents(self):  # type: ignore[no-untyped-def]
        return [(0, 1)]


def test_a_prefetch_still_in_flight_is_used_and_its_wait_is_a_late_prefetch() -> None:
    """(1,0) is prefetched at 0 (copy 0 -> 1.0); layer 1 needs it at 0.3 and waits 0.7 s:
    a late-prefetch stall, and the prefetch counts as used. The lower-priority request
    (1,1) never started: dropped, no bytes, neither used nor wasted."""
    tr = hand_trace([[[[[1], [0]]]]], 2)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 1, 1), (5.0, 1, 0)])
    m = _run(tr, pred, _WarmLRU(capacity_slots=4, num_layers=2, num_experts=2))
    assert m["stall_late_prefetch_ms_total"] == pytest.approx(700, abs=1e-3)
    assert m["stall_demand_ms_total"] == 0.0 and m["stall_link_ms_total"] == 0.0
    assert (m["prefetches_issued"], m["prefetches_used"], m["prefetches_wasted"]) == (1, 1, 0)
    assert m["prefetches_dropped"] == 1
    assert m["demand_loads_total"] == 0 and m["h2d_bytes_total"] == GB


def test_a_prefetch_evicted_before_use_is_waste_not_used() -> None:
    """Two slots; (1,1) is prefetched at 0 (wrong: layer 1 uses (1,0)). Layer 0 loads
    (0,0) on demand behind it; layer 1's demand load of (1,0) evicts the LRU key, the
    unused prefetch (1,1): a wasted prefetch (evicted unused), never a used one."""
    tr = hand_trace([[[[[0], [0]]]]], 2)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 1, 1)])
    m = _run(tr, pred, LRUCache(capacity_slots=2, num_layers=2, num_experts=2))
    assert (m["prefetches_issued"], m["prefetches_used"], m["prefetches_wasted"]) == (1, 0, 1)
    assert m["prefetch_waste_bytes"] == GB and m["prefetch_used_bytes"] == 0
    assert m["demand_loads_total"] == 2 and m["h2d_bytes_total"] == 3 * GB
    # layer 0 at 0.1 waits 0.9 s behind the prefetch, then its own copy (1.0 -> 2.0)
    assert m["stall_link_ms_total"] == pytest.approx(900, abs=1e-3)


def test_bytes_per_token_count_every_output_token() -> None:
    """One request, prefill + 2 decode steps on one layer, expert 0 then 1 then 0 with one
    slot: three demand loads over three output tokens: one expert's bytes per token."""
    tr = hand_trace([[[[[0]]], [[[1]]], [[[0]]]]], 2)
    m = _run(tr, ScriptedPredictor(dims=tr.dims), LRUCache(capacity_slots=1, num_layers=1,
                                                          num_experts=2))
    assert m["output_tokens_total"] == 3
    assert m["h2d_demand_bytes_per_token"] == GB
    assert m["stall_demand_ms_total"] == pytest.approx(m["stall_ms_total"])


SYSTEMS = [("none", {}, "lru", {}), ("oracle", {}, "belady", {}),
           ("expert_map", {"prefetch_distance": 2}, "finemoe", {}),
           ("eam", {}, "moe_infinity", {}), ("speculative_gate", {"distance": 1}, "lru_per_layer", {}),
           ("promoe", {"distance": 2}, "lru", {}), ("hit_count", {"prefetch_distance": 2}, "lfu", {}),
           ("emoe", {"period": 2, "steps": 20}, "emoe", {})]


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: f"{s[0]}+{s[2]}")
def test_parts_add_up_to_the_totals(system, batch_size: int) -> None:
    """On random traces at a slow and a fast link: demand + prefetch bytes =
    ``h2d_bytes_total``, used + wasted prefetches = prefetch bytes (and counts), the three
    stall parts = ``stall_ms_total``; every part is >= 0; every CORE key is present."""
    pname, pkw, cname, ckw = system
    for seed, hw in ((0, "rtx3090_pcie4"), (1, "h100_pcie5")):
        tr = random_trace(num_layers=4, num_experts=8, spec_depth=2, num_requests=10,
                          output_len=6, seed=seed)
        d = tr.dims
        pred = PREDICTORS.build(pname, dims=d, **pkw)
        cache = CACHES.build(cname, capacity_slots=capacity_slots(0.3, d), num_layers=d.num_layers,
                             num_experts=d.num_experts, **ckw)
        pred.fit(tr.split("store"))
        cache.fit(tr.split("store"))
        profile = load_profile(hw)
        cost = CostModel.from_profile(profile, d)
        m = simulate(tr.split("test"), pred, cache, cost, batch_size=batch_size, progress=False,
                     restricted_routing=pname == "emoe").metrics
        assert set(CORE_KEYS) <= m.keys()
        for total, parts in PARTS_OF.items():
            assert all(m[p] >= 0 for p in parts), (total, {p: m[p] for p in parts})
            assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-9, abs=1e-9), total
