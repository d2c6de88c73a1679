"""The engine's bytes and stall decomposition (:func:`moeexp.metrics.traffic_metrics`): the
simulator's keys, the same counts on the accesses it served, and parts that add up."""

from __future__ import annotations

import pytest
from tests.unit.conftest import prompt_ids

from moeexp.cache import CACHES
from moeexp.costmodel import CostModel, load_profile
from moeexp.engine import offload
from moeexp.metrics import CORE_KEYS, PARTS_OF
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate

PROMPTS = [(10, 0), (7, 1)]
NEW = 4


def _serve(om) -> None:
    for n, s in PROMPTS:
        om.generate(prompt_ids(n, seed=s), max_new_tokens=NEW, do_sample=False)


def _check_parts(m: dict[str, float]) -> None:
    assert set(CORE_KEYS) <= m.keys()
    for total, parts in PARTS_OF.items():
        assert all(m[p] >= 0 for p in parts), (total, {p: m[p] for p in parts})
        assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-9, abs=1e-9), total


def test_deepspeed_counts_equal_the_simulator() -> None:
    """deepspeed decides nothing by timing: on the accesses the engine served, the
    simulator counts the same demand loads, bytes per token and output tokens (one per
    request and pass: 2 requests x 4 passes), and neither backend prefetches."""
    model = toy_model("mixtral")
    with offload(model, system="deepspeed", capacity=0.5, record=True) as om:
        _serve(om)
        m = om.metrics()
        trace, slots = om.trace(), om.engine.pool.num_slots
    d = trace.dims
    pol = CACHES.build("lru", capacity_slots=slots, num_layers=d.num_layers, num_experts=d.num_experts)
    sim = simulate(trace, PREDICTORS.build("none", dims=d), pol,
                   CostModel.from_profile(load_profile("rtx3090_pcie4"), d), progress=False).metrics
    for key in ("output_tokens_total", "demand_loads_total", "h2d_demand_bytes_total",
                "h2d_demand_bytes_per_token", "h2d_prefetch_bytes_total", "prefetches_used"):
        assert m[key] == sim[key], key
    assert m["output_tokens_total"] == len(PROMPTS) * NEW
    _check_parts(m)


def test_on_demand_stalls_are_demand_copies() -> None:
    """Without prefetching every stall waits for a demand copy (its own transfer, or the
    earlier demand copies of its layer ahead of it on the link); none is a late prefetch."""
    model = toy_model("mixtral")
    eb = adapter_for(model).expert_bytes()
    with offload(model, system="deepspeed", capacity=0.25, bandwidth_bps=eb / 0.002) as om:
        _serve(om)
        m = om.metrics()
    assert m["stall_late_prefetch_ms_total"] == 0.0
    waited = m["stall_demand_ms_total"] + m["stall_link_ms_total"]
    assert waited >= 0.8 * 2.0 * m["demand_loads_total"] and m["stall_demand_ms_total"] > 0
    _check_parts(m)


@pytest.mark.parametrize("system", ["mixtral_offloading", "finemoe"])
def test_prefetching_parts_add_up(system: str, store_of) -> None:
    """Prefetching systems over a slow emulated link: demand + prefetch bytes = total,
    used + wasted = prefetched, the three stall parts = ``stall_ms_total``; some
    prefetches were started."""
    model = toy_model("mixtral")
    eb = adapter_for(model).expert_bytes()
    with offload(model, system=system, capacity=0.5, store=store_of("mixtral"),
                 bandwidth_bps=eb / 0.002) as om:
        _serve(om)
        m = om.metrics()
    assert m["prefetches_issued"] > 0
    _check_parts(m)
