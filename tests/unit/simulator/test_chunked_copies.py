"""Chunked copies (``hardware.copy_chunk_mb``, :mod:`moeexp.costmodel.copies`): a demand load
overtakes the prefetch on the link at its next chunk boundary, the prefetch resumes after
it, every chunk pays the per-copy latency; whole-expert copies (the default) and chunks at
least an expert large replay every system exactly as before.

Hand-built timelines use :func:`simhelpers.unit_cost` (a copy 1.0 s, an expert FFN 0.1 s, a
layer's dense part 0.1 s, no latency); ``copy_chunk_mb=250`` cuts the 1 GB expert into four
0.25 s chunks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.fixtures import replay_cases
from tests.unit.simulator.simhelpers import ScriptedPredictor, hand_trace, unit_profile

from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel, load_profile
from moeexp.costmodel.copies import CopyPlan
from moeexp.errors import ConfigError
from moeexp.metrics import PARTS_OF
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.synthetic import random_trace

GB = 10**9


def _cost(dims, chunk_mb: float, latency_us: float = 0.0) -> CostModel:
    prof = dataclasses.replace(unit_profile(), copy_chunk_mb=chunk_mb, copy_latency_us=latency_us)
    return CostModel.from_profile(prof, dims, dtype_bytes=2)


def _run(trace, predictor, cache, chunk_mb: float, **kw):
    return simulate(trace, predictor, cache, _cost(trace.dims, chunk_mb), progress=False,
                    **kw).metrics


class _WarmLRU(LRUCache):
    """LRU that starts with expert (0, 1) resident."""

    def initial_residents(self):  # type: ignore[no-untyped-def]
        return [(0, 1)]


def test_plan_charges_one_latency_per_chunk() -> None:
    """1 GB at 1 GB/s with 10 ms per copy: whole 1.01 s; four 250 MB chunks 4 x 0.01 + 1.0 =
    1.04 s (one full chunk 0.26 s); 300 MB chunks: 300, 300, 300, 100 MB, the rest last."""
    plan = CopyPlan.build(GB, 250.0, 0.01, 1e9)
    assert (plan.num_chunks, plan.chunked) == (4, True)
    assert plan.copy_s == pytest.approx(1.04) and plan.chunk_s == pytest.approx(0.26)
    whole = CopyPlan.build(GB, 0.0, 0.01, 1e9)
    assert (whole.num_chunks, whole.copy_s) == (1, 0.01 + 1.0)
    assert CopyPlan.build(GB, 300.0, 0.0, 1e9).bounds() == [
        (0, 3 * 10**8), (3 * 10**8, 6 * 10**8), (6 * 10**8, 9 * 10**8), (9 * 10**8, GB)]
    with pytest.raises(ConfigError, match="copy_chunk_mb"):
        CopyPlan.build(GB, -1.0, 0.0, 1e9)


def test_demand_stall_pays_every_chunk_latency() -> None:
    """On demand only (one expert, one layer): the stall is the whole copy, 1.04 s with four
    chunks at 10 ms each against 1.01 s whole: small chunks cost link time."""
    tr = hand_trace([[[[[0]]]]], 2)
    got = {}
    for mb in (0.0, 250.0):
        cost = _cost(tr.dims, mb, latency_us=1e4)
        cache = LRUCache(capacity_slots=1, num_layers=1, num_experts=2)
        got[mb] = simulate(tr, ScriptedPredictor(dims=tr.dims), cache, cost,
                           progress=False).metrics
    assert got[0.0]["stall_demand_ms_total"] == pytest.approx(1010)
    assert got[250.0]["stall_demand_ms_total"] == pytest.approx(1040)
    assert got[250.0]["h2d_bytes_total"] == GB


def test_demand_overtakes_the_prefetch_at_the_next_chunk_boundary() -> None:
    """Layer 0 -> 3, layers 1 and 2 -> 0; three prefetches for layer 2 queued at t=0
    (whole-expert copies: stalls 1.7 s link + 2.0 s demand, test_traffic).

    Four chunks: (2,0) starts at 0. Layer 0 needs (0,3) at 0.1: it waits for the chunk
    ending at 0.25 (0.15 s link), copies 0.25 -> 1.25 (1.0 s demand); (2,0) resumes
    1.25 -> 2.0. Layer 1 needs (1,0) at 1.45: the chunk run that began at 1.25 has a
    boundary at 1.5 (0.05 s link), copy 1.5 -> 2.5 (1.0 s demand); (2,0) resumes
    2.5 -> 3.0. Layer 2 needs (2,0) at 2.7: 0.3 s late prefetch. Stall 2.5 s in all, and
    (2,0), overtaken twice, is still a used prefetch."""
    tr = hand_trace([[[[[3], [0], [0]]]]], 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 2, 0), (1.0, 2, 1), (1.0, 2, 2)])
    m = _run(tr, pred, LRUCache(capacity_slots=5, num_layers=3, num_experts=4), 250.0)
    assert m["stall_link_ms_total"] == pytest.approx(200, abs=1e-3)
    assert m["stall_demand_ms_total"] == pytest.approx(2000, abs=1e-3)
    assert m["stall_late_prefetch_ms_total"] == pytest.approx(300, abs=1e-3)
    assert m["stall_ms_total"] == pytest.approx(2500, abs=1e-3)
    assert m["demand_loads_total"] == 2 and m["prefetches_used"] >= 1
    for total, parts in PARTS_OF.items():
        assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-12, abs=1e-9), total


def test_demand_waits_only_for_the_chunk_in_flight() -> None:
    """Chunks of 0.125 s (125 MB): layer 0's demand at 0.1 waits for the chunk of (1,0)
    ending at 0.125 (25 ms link), copies 0.125 -> 1.125 (1.0 s demand); (1,0)'s other
    0.875 s run 1.125 -> 2.0, and layer 1, needing it at 1.325, waits 0.675 s for it."""
    tr = hand_trace([[[[[3], [0]]]]], 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 1, 0)])
    m = _run(tr, pred, LRUCache(capacity_slots=5, num_layers=2, num_experts=4), 125.0)
    assert m["stall_link_ms_total"] == pytest.approx(25, abs=1e-3)
    assert m["stall_demand_ms_total"] == pytest.approx(1000, abs=1e-3)
    assert m["stall_late_prefetch_ms_total"] == pytest.approx(675, abs=1e-3)
    assert (m["prefetches_issued"], m["prefetches_used"]) == (1, 1)


def test_a_prefetch_for_the_running_layer_is_not_overtaken() -> None:
    """Layer 0 -> {1} (resident), layer 1 -> {0, 1}; (1,0) prefetched at 0 (0 -> 1.0). Layer
    1 starts at 0.3: it waits for (1,0) (0.7 s late prefetch) and its demand for (1,1) goes
    after it, 1.0 -> 2.0 (0.9 s demand from 1.1), chunks or not: overtaking one of the
    layer's own experts would gain the layer nothing."""
    tr = hand_trace([[[[[1], [0]], [[1], [1]]]]], 2)
    out = []
    for mb in (0.0, 250.0):
        pred = ScriptedPredictor(dims=tr.dims, at_start=[(5.0, 1, 0)])
        out.append(_run(tr, pred, _WarmLRU(capacity_slots=4, num_layers=2, num_experts=2), mb))
    for m in out:
        assert m["stall_late_prefetch_ms_total"] == pytest.approx(700, abs=1e-3)
        assert m["stall_demand_ms_total"] == pytest.approx(900, abs=1e-3)
        assert m["stall_link_ms_total"] == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("case", sorted(replay_cases.CASES))
def test_chunks_an_expert_large_change_nothing(case: str, monkeypatch) -> None:
    """A chunk at least one expert large is one copy: every pinned replay (every system and
    mode of the golden file) comes out to the bit as with whole-expert copies."""
    want = json.loads(replay_cases.GOLDEN.read_text())[case]
    big = dataclasses.replace(load_profile("rtx3090_pcie4"), copy_chunk_mb=1e6)
    monkeypatch.setattr(replay_cases, "load_profile", lambda name: big)
    got = json.loads(json.dumps(replay_cases.run_case(case)))
    bad = [k for k in want["metrics"] if not replay_cases.same(got["metrics"][k], want["metrics"][k])]
    assert not bad, bad


SYSTEMS = [("none", {}, "lru", {}), ("oracle", {}, "belady", {}),
           ("expert_map", {"prefetch_distance": 2}, "finemoe", {}),
           ("eam", {}, "moe_infinity", {}), ("speculative_gate", {"distance": 1}, "lru_per_layer", {}),
           ("promoe", {"distance": 2}, "lru", {})]


@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: f"{s[0]}+{s[2]}")
def test_chunked_parts_add_up_and_stay_above_the_bound(system) -> None:
    """Random traces on a slow link (copy-bound), four chunks per expert at 10 us each: the
    identities of PARTS_OF hold, no part is negative, and no system goes below the latency
    floor (which prices each copy at the chunked copy time)."""
    pname, pkw, cname, ckw = system
    for seed, bs in ((0, 1), (1, 2)):
        tr = random_trace(num_layers=4, num_experts=8, spec_depth=2, num_requests=10,
                          output_len=6, seed=seed)
        d = tr.dims
        pred = PREDICTORS.build(pname, dims=d, **pkw)
        cache = CACHES.build(cname, capacity_slots=capacity_slots(0.3, d), num_layers=d.num_layers,
                             num_experts=d.num_experts, **ckw)
        pred.fit(tr.split("store"))
        cache.fit(tr.split("store"))
        prof = dataclasses.replace(load_profile("rtx3090_pcie4"), h2d_gbps=0.25,
                                   copy_chunk_mb=d.expert_bytes / 4 / 1e6)
        cost = CostModel.from_profile(prof, d)
        assert cost.copy_plan.num_chunks == 4
        m = simulate(tr.split("test"), pred, cache, cost, batch_size=bs, progress=False).metrics
        for total, parts in PARTS_OF.items():
            assert all(m[p] >= 0 for p in parts), (total, {p: m[p] for p in parts})
            assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-9, abs=1e-9), total
        assert m["makespan_ms"] >= m["bound_makespan_ms"] * (1 - 1e-9)
