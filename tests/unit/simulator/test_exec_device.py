"""The replay with an execution policy (ExecDevice): CPU misses, streamed copies, pinned
experts, host-memory sharing, and ``copy`` bit-identical to the replay without one."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tests.unit.simulator.cpuhelpers import cpu_cost
from tests.unit.simulator.simhelpers import EXPERT_BYTES, ScriptedPredictor, hand_trace, unit_cost

from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel, load_profile
from moeexp.costmodel.hybrid import merge_s
from moeexp.errors import ConfigError
from moeexp.execution import ExecutionPolicy, LayerMisses, Placement, build_execution
from moeexp.metrics import PARTS_OF
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.simulator.exec_device import ExecDevice
from moeexp.traces.synthetic import random_trace

WALL = {"sim_wall_s", "accesses_per_s", "predictor_query_us_mean"}


def _lru(dims, slots: int) -> LRUCache:  # type: ignore[no-untyped-def]
    return LRUCache(capacity_slots=slots, num_layers=dims.num_layers, num_experts=dims.num_experts)


def _alternating():  # type: ignore[no-untyped-def]
    """One request, L=1, J=2, K=1: a 1-token prefill on expert 0, decodes on 1, 0, 1."""
    return hand_trace([[[[[0]]], [[[1]]], [[[0]]], [[[1]]]]], num_experts=2)


def test_cpu_on_miss_computes_every_miss_on_the_cpu_when_it_beats_the_copy() -> None:
    """CPU 0.5 s + hidden states < copy 1.0 s + FFN 0.1 s: every pass runs its expert on
    the CPU, nothing is copied or cached; each pass is the copy run's minus (copy + FFN)
    plus (hidden states both ways + CPU read + merge)."""
    tr = _alternating()
    cost = cpu_cost(tr.dims)
    plain = simulate(tr, PREDICTORS.build("none", dims=tr.dims), _lru(tr.dims, 1), cost,
                     progress=False)
    pol = build_execution({"name": "cpu_on_miss"}, cost)
    got = simulate(tr, PREDICTORS.build("none", dims=tr.dims), _lru(tr.dims, 1), cost,
                   progress=False, execution=pol)
    m = got.metrics
    assert plain.metrics["misses_total"] == 4 and plain.metrics["h2d_bytes_total"] == 4 * EXPERT_BYTES
    assert m["h2d_bytes_total"] == 0 and m["hit_rate"] == 0 and m["misses_total"] == 4
    assert (m["cpu_expert_calls"], m["cpu_tokens_total"], m["cpu_hidden_tokens_total"]) == (4, 4, 4)
    cpu_pass = cost.hidden_transfer_s(1) + cost.cpu_expert_s(1)
    assert m["cpu_ms_total"] == pytest.approx(4 * cpu_pass * 1e3)
    delta = cpu_pass + merge_s(cost, 1) - (cost.copy_s + cost.expert_s(1))
    for a, b in zip(got.series["iter_ms"], plain.series["iter_ms"], strict=True):
        assert a == pytest.approx(b + delta * 1e3)
    assert m["cpu_wait_ms_total"] == pytest.approx(4 * (cpu_pass + merge_s(cost, 1)) * 1e3)
    assert m["stall_ms_total"] == 0 and math.isnan(m["bound_tpot_ms_mean"])
    assert m["gpu_pinned_experts"] == 0 and m["stream_h2d_bytes_total"] == 0


def test_copy_is_bit_identical_to_the_replay_without_an_execution_policy() -> None:
    """``copy`` is plain: the replay runs the plain Device, every metric and series equal."""
    tr = random_trace(num_layers=4, num_experts=8, num_requests=8, prompt_len=5, output_len=6,
                      seed=3).split("test")
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4_epyc7532"), tr.dims)

    def run(execution):  # type: ignore[no-untyped-def]
        return simulate(tr, PREDICTORS.build("oracle", dims=tr.dims), _lru(tr.dims, 9), cost,
                        progress=False, execution=execution)

    a, b = run(None), run(build_execution({"name": "copy"}, cost))
    assert a.metrics.keys() == b.metrics.keys() and "cpu_expert_calls" not in a.metrics
    assert {k: v for k, v in a.metrics.items() if k not in WALL} == \
        {k: v for k, v in b.metrics.items() if k not in WALL}
    assert a.series == b.series


def test_layer_split_pins_the_gpu_layers_streams_a_large_pass_and_runs_decode_on_the_cpu() -> None:
    """L=2, J=2, n_cpu_layers=1, min_batch=2, 2 slots: layer 1's experts pinned (the whole
    budget). The 2-token prefill streams layer 0's two experts (bytes on the link, no
    slot); the decode runs layer 0's expert on the CPU; layer 1 always hits."""
    tr = hand_trace([[[[[0], [0]], [[1], [1]]], [[[0], [1]]]]], num_experts=2)
    cost = cpu_cost(tr.dims)
    pol = build_execution({"name": "layer_split", "n_cpu_layers": 1, "min_batch": 2}, cost)
    pol.bind_budget(2)
    cache = _lru(tr.dims, 2)
    m = simulate(tr, PREDICTORS.build("none", dims=tr.dims), cache, cost, progress=False,
                 execution=pol).metrics
    assert m["gpu_pinned_experts"] == 2 and cache.resident == {(1, 0), (1, 1)}
    assert m["stream_h2d_bytes_total"] == 2 * EXPERT_BYTES == m["h2d_bytes_total"] \
        == m["h2d_demand_bytes_total"]
    assert (m["hits_total"], m["misses_total"], m["cpu_expert_calls"]) == (3, 3, 1)
    for total, parts in PARTS_OF.items():
        assert m[total] == pytest.approx(sum(m[p] for p in parts))


class _EvictLog(LRUCache):
    evicted: list

    def on_evict(self, key):  # type: ignore[no-untyped-def]
        self.evicted.append(key)
        super().on_evict(key)


def test_pinned_experts_are_never_evicted_by_prefetches_or_demand_loads() -> None:
    """hot_pinned with 3 of 5 slots pinned and a predictor prefetching every expert of the
    next layer: the pinned experts stay resident all run long (none is ever a victim)."""
    tr = random_trace(num_layers=3, num_experts=6, num_requests=8, prompt_len=4, output_len=5,
                      seed=1)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4_epyc7532"), tr.dims)
    pol = build_execution({"name": "hot_pinned", "gpu_experts": 3}, cost)
    pol.bind_budget(5)
    pol.fit(tr.split("store"))
    cache = _EvictLog(capacity_slots=5, num_layers=3, num_experts=6)
    cache.evicted = []
    pred = ScriptedPredictor(dims=tr.dims, at_layer={n: [(1.0, n + 1, e) for e in range(6)]
                                                     for n in range(2)})
    m = simulate(tr.split("test"), pred, cache, cost, progress=False, execution=pol).metrics
    pinned = set(pol.gpu_resident())
    assert len(pinned) == 3 and pinned <= cache.resident
    assert cache.evicted and not pinned & set(cache.evicted)
    assert m["prefetches_issued"] > 0 and m["cpu_expert_calls"] > 0


class _CopyFirst(ExecutionPolicy):
    """Test policy: the first missed expert is copied, the others run on the CPU."""

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        return Placement(copy=misses.experts[:1], cpu=misses.experts[1:])


def test_shared_host_memory_slows_both_sides_of_a_mixed_layer() -> None:
    """A layer copying expert 0 while the CPU computes expert 1, host memory 2 GB/s: demand
    3 GB/s (CPU 2 + link 1) is cut by 2/3, the copy takes 1.5 s instead of 1.0 and the CPU
    read 0.75 s instead of 0.5; the GPU chain decides (copy + FFN): 0.5 s more."""
    tr = hand_trace([[[[[0, 1]]]]], num_experts=4)
    cost = cpu_cost(tr.dims, host_memory_gbps=2.0)
    runs = []
    for share in (False, True):
        pol = _CopyFirst(num_layers=1, num_experts=4)
        pol.share_host_memory = share
        runs.append(simulate(tr, PREDICTORS.build("none", dims=tr.dims), _lru(tr.dims, 2), cost,
                             progress=False, execution=pol))
    (a, b) = runs
    assert b.series["iter_ms"][0] == pytest.approx(a.series["iter_ms"][0] + 500.0)
    assert b.metrics["link_shared_extra_ms_total"] == pytest.approx(500.0)
    assert b.metrics["link_busy_ms_total"] == pytest.approx(1500.0)
    assert b.metrics["cpu_ms_total"] == pytest.approx(a.metrics["cpu_ms_total"] + 250.0)
    assert (a.metrics["share_host_memory"], b.metrics["share_host_memory"]) == (0.0, 1.0)


def test_a_cpu_policy_is_refused_where_the_cpu_is_not_modelled() -> None:
    tr = _alternating()
    cost = cpu_cost(tr.dims)
    pol = build_execution({"name": "cpu_on_miss"}, cost)
    with pytest.raises(ConfigError, match="restricted_routing=True"):
        simulate(tr, PREDICTORS.build("none", dims=tr.dims), _lru(tr.dims, 1), cost,
                 progress=False, execution=pol, restricted_routing=True)
    with pytest.raises(ConfigError, match="no cpu: block"):
        build_execution({"name": "cpu_on_miss"}, unit_cost(tr.dims))


def test_hidden_on_link_queues_a_cpu_expert_behind_a_copy_in_flight() -> None:
    """L=2, one token, every miss on the CPU (cpu_on_miss). A wrong prefetch of (1, 2),
    made at layer 0, starts on the link when layer 0's output transfer leaves it (0.6 s +
    two transfers) and holds it for the 1.0 s copy. Off: the pass ends at 1.2 s + 4
    transfers + 2 merges. ``up``: layer 1's outputs wait for that copy (1.6 s + 3 transfers
    + 1 merge); ``both``: its hidden state waits to go down too (2.1 s + 4 transfers + 1
    merge). The booked ways count on the link."""
    tr = hand_trace([[[[[0], [1]]]]], num_experts=4)
    cost = cpu_cost(tr.dims)
    runs = {}
    for mode in (False, "up", "both"):
        pol = build_execution({"name": "cpu_on_miss", "hidden_on_link": mode}, cost)
        pred = ScriptedPredictor(dims=tr.dims, at_layer={0: [(1.0, 1, 2)]})
        runs[mode] = simulate(tr, pred, _lru(tr.dims, 4), cost, progress=False, execution=pol)
    off = runs[False]
    h, m = 0.5 * cost.hidden_transfer_s(1), merge_s(cost, 1)
    base = off.series["iter_ms"][0]
    assert base == pytest.approx(1e3 * (1.2 + 4 * h + 2 * m))
    for mode, later_s, ways in (("up", 0.4 - h - m, 2), ("both", 0.9 - m, 4)):
        got = runs[mode].metrics
        assert runs[mode].series["iter_ms"][0] == pytest.approx(base + later_s * 1e3)
        assert got["cpu_expert_calls"] == 2
        assert got["hidden_link_ms_total"] == pytest.approx(ways * h * 1e3)
        assert got["link_busy_ms_total"] == pytest.approx(1e3 * (1.0 + ways * h))
        assert got["cpu_ms_total"] == pytest.approx(off.metrics["cpu_ms_total"])
    assert "hidden_link_ms_total" not in off.metrics
    with pytest.raises(ConfigError, match="hidden_on_link=True; valid: false, up, both"):
        build_execution({"name": "cpu_on_miss", "hidden_on_link": True}, cost)


def test_hidden_tokens_counts_each_token_once_per_layer() -> None:
    """A token routed to two of the CPU's experts crosses the link once; a token routed to
    none of them not at all (the mask over J agrees with a set test on every token)."""
    tr = _alternating()
    cost = cpu_cost(tr.dims)
    dev = ExecDevice(_lru(tr.dims, 1), cost, 1, 4, build_execution({"name": "cpu_on_miss"}, cost))
    topk = np.array([[[0, 1]], [[1, 2]], [[3, 0]], [[2, 3]]])  # int[T=4, L=1, K=2]
    dev.begin_pass(np.zeros((1, 4), dtype=np.int64), topk)
    for experts in [(0,), (1,), (0, 1), (2, 3), (0, 1, 2, 3), (3,)]:
        want = sum(bool(set(row[0]) & set(experts)) for row in topk.tolist())
        assert dev._hidden_tokens(0, experts) == want, experts


class _MissSpy(LRUCache):
    """LRU that records what the replay tells it a miss costs."""

    def __init__(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self.told: list[float] = []

    def set_miss_cost(self, seconds: float, *, late_to_cpu: bool = False,
                      relief_s: float = 0.0) -> None:
        self.told.append(seconds)
        self.late, self.relief = late_to_cpu, relief_s


@pytest.mark.parametrize("name", ["copy", "cpu_on_miss", "balanced"])
def test_the_replay_tells_the_cache_what_a_miss_costs_where_the_cpu_may_run_it(name: str) -> None:
    """A CPU execution tells the cache, once before serving, the cheaper of a copy and the
    CPU's computing a one-token miss (the ``next_use`` gate's m) and the GPU time such a
    miss takes off the GPU's chain (the expert's one-token GPU compute, as the CPU beats
    the copy here; 0 where the copy is cheaper); ``copy`` tells nothing (a miss is a copy,
    the replay as before)."""
    tr = _alternating()
    cost = cpu_cost(tr.dims)
    pol = build_execution({"name": name}, cost)
    spy = _MissSpy(capacity_slots=1, num_layers=tr.dims.num_layers, num_experts=tr.dims.num_experts)
    simulate(tr, PREDICTORS.build("none", dims=tr.dims), spy, cost, progress=False, execution=pol)
    if name == "copy":
        assert spy.told == [] and pol.miss_s(cost) is None  # a miss is a copy
    else:
        assert spy.told == [min(cost.copy_s, cost.cpu_miss_s(1))] and spy.late is False
        assert pol.miss_s(cost) == spy.told[0] < cost.copy_s  # this CPU beats the copy
        assert spy.relief == pol.miss_relief_s(cost) == cost.expert_s(1) > 0
        slow = cpu_cost(tr.dims, dram_gbps=1.0)  # a CPU slower than the copy: no relief
        assert build_execution({"name": name}, slow).miss_relief_s(slow) == 0.0
        late = _MissSpy(capacity_slots=1, num_layers=tr.dims.num_layers,
                        num_experts=tr.dims.num_experts)
        simulate(tr, PREDICTORS.build("none", dims=tr.dims), late, cost, progress=False,
                 execution=build_execution({"name": name, "late_to_cpu": True}, cost))
        assert late.told == spy.told and late.late is True


def _late_prefetch_runs(dram_gbps: float) -> dict[bool, object]:
    """L=2, J=4, three one-token passes on (0, 0) then (1, 2); every miss on the CPU
    (cpu_on_miss); a prefetch of (1, 2) at every layer 0 (copied once: 1.0 s), so the first
    pass's layer 1 finds its copy in flight. Runs with ``late_to_cpu`` off and on."""
    tr = hand_trace([[[[[0], [2]]], [[[0], [2]]], [[[0], [2]]]]], num_experts=4)
    cost = cpu_cost(tr.dims, dram_gbps=dram_gbps)
    out = {}
    for late in (False, True):
        pol = build_execution({"name": "cpu_on_miss", "late_to_cpu": late}, cost)
        pred = ScriptedPredictor(dims=tr.dims, at_layer={0: [(1.0, 1, 2)]})
        out[late] = simulate(tr, pred, _lru(tr.dims, 4), cost, progress=False, execution=pol)
    return out


def test_late_to_cpu_computes_a_copy_in_flight_on_the_cpu_when_that_ends_sooner() -> None:
    """A 0.25 s CPU expert (4 GB/s): layer 1 of the first pass starts ~0.45 s, the copy
    lands ~1.1 s. Off, the GPU waits for it; on, the CPU computes (1, 2) and the pass is
    two all-CPU layers. The copy still lands once and stays (the same bytes, one
    prefetch); the access is a miss either way, so the hit rate is unchanged."""
    runs = _late_prefetch_runs(4.0)
    off, on = runs[False].metrics, runs[True].metrics
    tr = hand_trace([[[[[0], [2]]]]], num_experts=4)
    cost = cpu_cost(tr.dims, dram_gbps=4.0)
    cpu_layer = 0.1 + cost.hidden_transfer_s(1) + cost.cpu_expert_s(1) + merge_s(cost, 1)
    assert runs[True].series["iter_ms"][0] == pytest.approx(2e3 * cpu_layer)
    assert runs[False].series["iter_ms"][0] > runs[True].series["iter_ms"][0] + 400
    assert on["cpu_late_experts_total"] >= 1 and "cpu_late_experts_total" not in off
    assert on["cpu_expert_calls"] == off["cpu_expert_calls"] + on["cpu_late_experts_total"]
    assert on["h2d_bytes_total"] == off["h2d_bytes_total"] == EXPERT_BYTES
    assert on["prefetches_issued"] == off["prefetches_issued"] == 1
    assert on["misses_total"] == off["misses_total"] and on["hits_total"] >= 1
    assert on["stall_late_prefetch_ms_total"] < off["stall_late_prefetch_ms_total"]


def test_late_to_cpu_keeps_the_wait_where_the_copy_ends_sooner() -> None:
    """A 1.0 s CPU expert (1 GB/s): waiting for the copy ends first, so nothing moves and
    the run is the one without the key, bit for bit."""
    runs = _late_prefetch_runs(1.0)
    on, off = runs[True].metrics, runs[False].metrics
    assert on["cpu_late_experts_total"] == 0
    assert {k: v for k, v in on.items() if k not in WALL | {"cpu_late_experts_total"}} == \
        {k: v for k, v in off.items() if k not in WALL}
    assert runs[True].series["iter_ms"] == runs[False].series["iter_ms"]


def test_late_to_cpu_is_refused_where_nothing_runs_on_the_cpu() -> None:
    """``copy`` and a layer split without CPU layers compute nothing on the CPU: the key
    is refused there, as is a value that is not a boolean."""
    tr = _alternating()
    cost = cpu_cost(tr.dims)
    for choice in ({"name": "copy", "late_to_cpu": True},
                   {"name": "layer_split", "n_cpu_layers": 0, "late_to_cpu": True}):
        with pytest.raises(ConfigError, match="late_to_cpu=true needs a policy"):
            build_execution(choice, cost)
    with pytest.raises(ConfigError, match="late_to_cpu='yes' must be true or false"):
        build_execution({"name": "balanced", "late_to_cpu": "yes"}, cost)
