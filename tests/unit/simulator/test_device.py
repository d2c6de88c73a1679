"""Hand-built timelines of the simulated device (copy engine, prefetch queue, streaming).

Every case uses :func:`simhelpers.unit_cost`: a copy takes 1.0 s, an expert FFN 0.1 s and
a layer's dense part 0.1 s, so the expected times can be worked out by hand.
"""

from __future__ import annotations

import pytest
from tests.unit.simulator.simhelpers import CapacityWatch, ScriptedPredictor, hand_trace, unit_cost

from moeexp.cache.belady import BeladyCache
from moeexp.cache.lru import LRUCache
from moeexp.predictors.base import Predictor
from moeexp.simulator import simulate

# one request, prefill of one token: layer 0 -> expert 3, layers 1 and 2 -> expert 0
ROUTE_300 = [[[[[3], [0], [0]]]]]


def _run(trace, predictor, cache, **kw):
    return simulate(trace, predictor, cache, unit_cost(trace.dims), progress=False, **kw).metrics


def test_demand_load_preempts_queued_prefetches() -> None:
    """Three prefetches for layer 2 are queued at t=0; layer 0 then misses on expert 3.

    t=0.1: the first prefetch (2,0) is in flight (0 -> 1.0); the demand load of (0,3) goes
    next (1.0 -> 2.0), ahead of the two queued prefetches: layer 0 stalls 1.9 s and ends
    at 2.1. Layer 1 (dense ends 2.2): prefetch (2,1) started at 2.0 (-> 3.0), so the demand
    load of (1,0) runs 3.0 -> 4.0: stall 1.8, end 4.1. Layer 2 at 4.2 finds (2,0) ready:
    a hit; ends 4.3. FIFO copies would have stalled layer 0 until 4.0 instead.
    """
    tr = hand_trace(ROUTE_300, 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 2, 0), (1.0, 2, 1), (1.0, 2, 2)])
    m = _run(tr, pred, LRUCache(capacity_slots=5, num_layers=3, num_experts=4))
    assert m["stall_ms_total"] == pytest.approx(3700, abs=1e-3)
    assert m["ttft_ms_mean"] == pytest.approx(4300, abs=1e-3)
    assert (m["hits_total"], m["misses_total"]) == (1, 2)
    assert m["prefetches_issued"] == 3 and m["prefetches_dropped"] == 0
    assert m["h2d_bytes_total"] == 5 * tr.dims.expert_bytes
    # (2,1) and (2,2) were prefetched and never used
    assert m["prefetch_waste_bytes"] == 2 * tr.dims.expert_bytes


class _WarmLRU(LRUCache):
    """LRU that starts with expert (0, 1) resident."""

    def initial_residents(self):  # type: ignore[no-untyped-def]
        return [(0, 1)]


def test_higher_priority_prefetch_goes_first() -> None:
    """Queued at t=0 in one call: (1,1) with priority 1, then (1,0) with priority 5.

    Layer 0 uses the pre-loaded (0,1): a hit, its experts end at 0.2. The engine started
    (1,0) first (0 -> 1.0), so layer 1 (experts at 0.3) finds it in flight: a miss that
    stalls 0.7 s, TTFT 1.1. (1,1) never got to start before layer 1 ran: dropped at the
    end of the iteration. In FIFO order layer 1 would have waited for a demand load
    (1.0 -> 2.0) instead: stall 1.7 s.
    """
    tr = hand_trace([[[[[1], [0]]]]], 2)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 1, 1), (5.0, 1, 0)])
    m = _run(tr, pred, _WarmLRU(capacity_slots=4, num_layers=2, num_experts=2))
    assert (m["hits_total"], m["misses_total"]) == (1, 1)
    assert m["stall_ms_total"] == pytest.approx(700, abs=1e-3)
    assert m["ttft_ms_mean"] == pytest.approx(1100, abs=1e-3)
    assert m["prefetches_issued"] == 1 and m["prefetches_dropped"] == 1


def test_prefetches_for_passed_layers_are_dropped() -> None:
    """After layer 1's router, prefetches for layers 0 and 1 are useless: dropped at once.

    Nothing is copied for them: the three misses are the only traffic.
    """
    tr = hand_trace(ROUTE_300, 4)
    pred = ScriptedPredictor(dims=tr.dims, at_layer={1: [(5.0, 0, 1), (5.0, 1, 2)]})
    m = _run(tr, pred, LRUCache(capacity_slots=5, num_layers=3, num_experts=4))
    assert m["prefetches_dropped"] == 2 and m["prefetches_issued"] == 0
    assert m["h2d_bytes_total"] == 3 * tr.dims.expert_bytes
    assert m["prediction_recall"] == 0.0  # predictions made after the router do not count


def test_queued_prefetch_dropped_when_its_layer_runs_first() -> None:
    """Queued at t=0: (2,0) p3, (2,1) p2, (1,1) p1; every layer uses expert 0.

    (2,0) copies 0 -> 1.0; layer 0's demand 1.0 -> 2.0; (2,1) starts 2.0 (before layer 1's
    experts at 2.2) -> 3.0; (1,1) could only start at 3.0, after layer 1 began at 2.2, so
    it is dropped: 2 issued, 1 dropped; layer 2 hits on (2,0).
    """
    tr = hand_trace([[[[[0], [0], [0]]]]], 4)
    pred = ScriptedPredictor(dims=tr.dims, at_start=[(3.0, 2, 0), (2.0, 2, 1), (1.0, 1, 1)])
    m = _run(tr, pred, LRUCache(capacity_slots=6, num_layers=3, num_experts=4))
    assert m["prefetches_issued"] == 2 and m["prefetches_dropped"] == 1
    assert m["hits_total"] == 1


class _PausingLRU(LRUCache):
    pause_prefetch_on_miss = True


def test_pause_prefetch_on_miss_delays_queued_prefetches_to_the_end_of_the_layer() -> None:
    """Layer 0's router asks for (2,0); layer 0 misses on (0,3), loaded 0.1 -> 1.1.

    Without pausing, (2,0) starts when the engine frees (1.1 -> 2.1); layer 1's demand
    follows (2.1 -> 3.1), TTFT 3.4. With pausing, (2,0) waits until layer 0's experts are
    done (1.2 -> 2.2): everything after shifts by 0.1 s, TTFT 3.5.
    """
    tr = hand_trace(ROUTE_300, 4)
    ttft = {}
    for cls in (LRUCache, _PausingLRU):
        pred = ScriptedPredictor(dims=tr.dims, at_layer={0: [(1.0, 2, 0)]})
        m = _run(tr, pred, cls(capacity_slots=5, num_layers=3, num_experts=4))
        ttft[cls.__name__] = m["ttft_ms_mean"]
        assert m["hits_total"] == 1
    assert ttft["LRUCache"] == pytest.approx(3400, abs=1e-3)
    assert ttft["_PausingLRU"] == pytest.approx(3500, abs=1e-3)


class _WatchedLRU(CapacityWatch, LRUCache):
    pass


class _WatchedBelady(CapacityWatch, BeladyCache):
    pass


@pytest.mark.parametrize("cls", [_WatchedLRU, _WatchedBelady])
def test_prefill_streams_through_a_budget_smaller_than_the_layer(cls) -> None:
    """Prefill of 4 tokens on experts 0..3 of the only layer, with 1 slot.

    Each expert is loaded, computed, released: loads 0.1->1.1, 1.2->2.2, 2.3->3.3,
    3.4->4.4 (each waits for the previous expert's FFN to free the slot), TTFT 4.5 s;
    4 misses, 4 copies, never more than 1 resident. The decode token then uses expert 3,
    the last one streamed: a hit.
    """
    tr = hand_trace([[[[[0]], [[1]], [[2]], [[3]]], [[[3]]]]], 4)
    cache = cls(capacity_slots=1, num_layers=1, num_experts=4)
    m = _run(tr, Predictor(dims=tr.dims), cache)
    assert cache.peak == 1
    assert m["ttft_ms_mean"] == pytest.approx(4500, abs=1e-3)
    assert (m["misses_total"], m["hits_total"]) == (4, 1)
    assert m["h2d_bytes_total"] == 4 * tr.dims.expert_bytes


def test_inflight_expert_is_a_miss_that_waits() -> None:
    """Layer 0's router prefetches (1,0) at 0.1 (0.1 -> 1.1; (0,1) was pre-loaded).

    Layer 1 starts its experts at 0.3 with (1,0) still in flight: a miss (hit_rate needs
    the copy finished), stalling 0.8 s, without a second copy.
    """
    tr = hand_trace([[[[[1], [0]]]]], 2)
    cache = _WarmLRU(capacity_slots=4, num_layers=2, num_experts=2)
    pred = ScriptedPredictor(dims=tr.dims, at_layer={0: [(1.0, 1, 0)]})
    m = _run(tr, pred, cache)
    assert (m["hits_total"], m["misses_total"]) == (1, 1)
    assert m["stall_ms_total"] == pytest.approx(800, abs=1e-3)
    assert m["h2d_bytes_total"] == tr.dims.expert_bytes
    assert m["prefetch_waste_bytes"] == 0
