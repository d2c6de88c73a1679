"""The FineMoE artifact's behaviours as options (:mod:`moeexp.simulator.mechanics`).

Hand-built timelines use :func:`simhelpers.unit_cost`: a copy 1.0 s, an expert FFN 0.1 s,
a layer's dense part 0.1 s."""

from __future__ import annotations

import math

import pytest
from tests.unit.simulator.simhelpers import hand_trace, unit_cost

from moeexp.cache.belady import BeladyCache
from moeexp.cache.lru import LRUCache
from moeexp.errors import ConfigError
from moeexp.predictors.base import Predictor
from moeexp.simulator import simulate
from moeexp.simulator.mechanics import Mechanics
from moeexp.simulator.topology import Topology

GB = 10**9
# one request: a one-token prefill and one decode step, one layer, expert 1 both times
TWICE = [[[[[1]]], [[[1]]]]]


def _run(tr, cache, mech=None, **kw):
    return simulate(tr, Predictor(dims=tr.dims), cache, unit_cost(tr.dims), progress=False,
                    mechanics=mech, **kw).metrics


def test_bad_options_are_refused_naming_the_valid_values() -> None:
    with pytest.raises(ConfigError, match="valid: activated, all_experts"):
        Mechanics(demand_load="whole_layer")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="true or false"):
        Mechanics(flush_per_token="yes")  # type: ignore[arg-type]


def test_all_experts_loads_every_expert_of_the_layer_in_index_order() -> None:
    """J=3, the token uses expert 1; all_experts touches 0, 1, 2 (three copies 0.1 -> 3.1
    back to back; 0 and 2 compute nothing): the layer waits for expert 1 (ready 2.1) and
    for expert 2 (ready 3.1): TTFT 3.1. Activated-only: one copy, TTFT 1.2. The decode
    step then hits all three (a 3-slot cache keeps them)."""
    tr = hand_trace(TWICE, 3)
    act = _run(tr, LRUCache(capacity_slots=3, num_layers=1, num_experts=3))
    every = _run(tr, LRUCache(capacity_slots=3, num_layers=1, num_experts=3),
                 Mechanics(demand_load="all_experts"))
    assert act["ttft_ms_mean"] == pytest.approx(1200, abs=1e-3)
    assert every["ttft_ms_mean"] == pytest.approx(3100, abs=1e-3)
    assert (act["h2d_bytes_total"], every["h2d_bytes_total"]) == (GB, 3 * GB)
    assert (every["hits_total"], every["misses_total"], every["accesses_total"]) == (3, 3, 6)
    assert every["demand_load"] == "all_experts" and act["demand_load"] == "activated"
    assert math.isnan(every["bound_tpot_ms_mean"]) and not math.isnan(act["bound_tpot_ms_mean"])


def test_flush_per_token_forgets_every_expert_between_passes() -> None:
    """Expert 1 is loaded for the prefill; kept, the decode step hits it (1 copy). With the
    flush the decode step loads it again: 2 copies, no hit."""
    tr = hand_trace(TWICE, 3)
    kept = _run(tr, LRUCache(capacity_slots=3, num_layers=1, num_experts=3))
    flushed = _run(tr, LRUCache(capacity_slots=3, num_layers=1, num_experts=3),
                   Mechanics(flush_per_token=True))
    assert (kept["hits_total"], kept["h2d_bytes_total"]) == (1, GB)
    assert (flushed["hits_total"], flushed["h2d_bytes_total"]) == (0, 2 * GB)
    assert flushed["flush_per_token"] == 1.0 and kept["flush_per_token"] == 0.0


def test_flush_on_several_devices_and_all_experts_over_their_links() -> None:
    """Two devices, round robin, per-device demand, all_experts with J=2: both experts load
    in parallel at 0.1 (ready 1.1), the flush empties both devices, and the decode step
    loads both again: 4 copies, 2 per link."""
    tr = hand_trace(TWICE, 2)
    caches = [LRUCache(capacity_slots=1, num_layers=1, num_experts=2) for _ in range(2)]
    m = _run(tr, caches, Mechanics(demand_load="all_experts", flush_per_token=True),
             topology=Topology(devices=2, demand_concurrency="per_device"))
    assert m["ttft_ms_mean"] == pytest.approx(1200, abs=1e-3)
    assert m["dev0_h2d_bytes_total"] == m["dev1_h2d_bytes_total"] == 2 * GB
    assert m["hits_total"] == 0


def test_the_replay_tells_each_cache_its_demand_loading() -> None:
    """simulate hands every policy the run's demand_load (next_use reads it), the
    default's as well as the artifact's."""
    from moeexp.cache.next_use import NextUseCache
    tr = hand_trace(TWICE, 3)
    seen = []
    for mech in (None, Mechanics(demand_load="all_experts")):
        c = NextUseCache(capacity_slots=3, num_layers=1, num_experts=3)
        c.touch_all = mech is None  # the wrong way round: simulate must overwrite it
        _run(tr, c, mech)
        seen.append(c.touch_all)
    assert seen == [False, True]


def test_all_experts_refuses_a_policy_that_reads_the_future() -> None:
    tr = hand_trace(TWICE, 3)
    with pytest.raises(ConfigError, match="belady"):
        _run(tr, BeladyCache(capacity_slots=3, num_layers=1, num_experts=3),
             Mechanics(demand_load="all_experts"))


def test_restricted_routing_refuses_the_artifact_options() -> None:
    tr = hand_trace(TWICE, 3)
    with pytest.raises(ConfigError, match="default mechanics only"):
        _run(tr, LRUCache(capacity_slots=3, num_layers=1, num_experts=3),
             Mechanics(flush_per_token=True), restricted_routing=True)
