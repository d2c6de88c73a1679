"""The two equalities the eviction landscape rests on (issue 16).

1. libCacheSim's Belady and moeexp's demand-only Belady (``cache=belady``, ``predictor=none``,
   through the simulator) are the same algorithm: on random traces their hit counts agree
   exactly; a disagreement is a defect on one side.
2. moeexp's ``lru`` is LRU with the running layer protected: it equals an LRU written here
   from that definition alone (and libCacheSim's LRU fed with the ``protected`` semantics).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from moeexp.cache import build_cache
from moeexp.cache.capacity import capacity_slots
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.landscape.stream import AccessStream, access_stream
from moeexp.predictors import build_predictor
from moeexp.simulator import simulate
from moeexp.traces.schema import Trace
from moeexp.traces.synthetic import random_trace

INSTALL = "libcachesim is optional: pip install -e '.[cachesim]'"

#: Four random traces: tiny-shaped, Mixtral-shaped, small, gpt-oss-shaped (top-4).
TRACES = {
    "tiny": dict(num_layers=8, num_experts=16, top_k=2, num_requests=12, prompt_len=10,
                 output_len=24, seed=0),
    "mixtral": dict(num_layers=32, num_experts=8, top_k=2, num_requests=10, prompt_len=8,
                    output_len=20, seed=1),
    "small": dict(num_layers=4, num_experts=8, top_k=2, num_requests=16, prompt_len=3,
                  output_len=12, seed=2),
    "gpt_oss": dict(num_layers=24, num_experts=32, top_k=4, num_requests=8, prompt_len=6,
                    output_len=16, seed=3),
}
CAPACITIES = (0.05, 0.1, 0.25, 0.5, 0.75)


def _slots(cap: float, tr: Trace) -> int:
    """Slots of ``cap``, 0 where it holds fewer than top_k experts (refused by moeexp)."""
    try:
        return capacity_slots(cap, tr.dims)
    except ConfigError:
        return 0


def _test_split(name: str) -> Trace:
    return random_trace(spec_depth=0, **TRACES[name]).split("test")  # type: ignore[arg-type]


def _moeexp_hits(trace: Trace, cache_name: str, capacity: float) -> int:
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), trace.dims)
    cache = build_cache({"name": cache_name, "capacity": capacity}, trace.dims)
    res = simulate(trace, build_predictor({"name": "none"}, trace.dims), cache, cost,
                   progress=False)
    return int(res.metrics["hits_total"])


def _stream(trace: Trace) -> AccessStream:
    return access_stream(trace, CostModel.from_profile(load_profile("rtx3090_pcie4"),
                                                       trace.dims))


def protected_lru_hits(stream: AccessStream, slots: int) -> int:
    """LRU over all layers where a miss never evicts an expert of the running layer.

    Written from the definition only: a layer's resident experts are hits and become the
    most recent (in expert order), then each missing expert evicts the least recently
    used resident that the layer does not use, is loaded and becomes the most recent.
    """
    recency: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = 0
    for run in stream.runs():
        layer_keys = set(run)
        present = [k for k in run if k in recency]
        hits += len(present)
        for k in present:
            recency.move_to_end(k)
        for k in run:
            if k in recency:
                continue
            if len(recency) >= slots:
                victim = next(v for v in recency if v not in layer_keys)
                del recency[victim]
            recency[k] = None
    return hits


@pytest.mark.parametrize("name", sorted(TRACES))
def test_libcachesim_belady_equals_moeexp_demand_only_belady(name: str) -> None:
    """Same hits at every capacity (5-75 %) on each of four random traces."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    from moeexp.landscape.cachesim import POLICIES, run_policy

    tr = _test_split(name)
    stream = _stream(tr)
    for cap in CAPACITIES:
        slots = _slots(cap, tr)
        if not slots:
            continue
        lcs = run_policy(stream, POLICIES["Belady"], slots, "native")
        assert round(lcs.hit_rate * stream.num_accesses) == _moeexp_hits(tr, "belady", cap), \
            (name, cap)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_moeexp_lru_equals_lru_with_the_running_layer_protected(name: str) -> None:
    """moeexp's ``lru`` through the simulator gives the reference's hits exactly, at every
    capacity that holds a whole layer's experts (smaller ones stream a prefill through the
    budget, where the simulator also releases experts once computed: a timing rule)."""
    tr = _test_split(name)
    stream = _stream(tr)
    widest = max(len(r) for r in stream.runs())
    checked = 0
    for cap in CAPACITIES:
        slots = _slots(cap, tr)
        if slots < widest:
            continue
        assert _moeexp_hits(tr, "lru", cap) == protected_lru_hits(stream, slots), (name, cap)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("name", sorted(TRACES))
def test_libcachesim_lru_protected_equals_moeexp_lru(name: str) -> None:
    """libCacheSim's LRU under the ``protected`` semantics is moeexp's ``lru``."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    from moeexp.landscape.cachesim import POLICIES, run_policy

    tr = _test_split(name)
    stream = _stream(tr)
    widest = max(len(r) for r in stream.runs())
    for cap in CAPACITIES:
        slots = _slots(cap, tr)
        if slots < widest:
            continue
        lcs = run_policy(stream, POLICIES["LRU"], slots, "protected")
        assert round(lcs.hit_rate * stream.num_accesses) == _moeexp_hits(tr, "lru", cap)
