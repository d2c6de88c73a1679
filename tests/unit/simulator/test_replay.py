"""Invariants of ``simulate`` on synthetic traces, and its modes (batch, online, restricted)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tests.unit.simulator.simhelpers import hand_trace, unit_cost

from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.metrics import CORE_KEYS
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import Predictor
from moeexp.simulator import simulate
from moeexp.traces.synthetic import random_trace

WALL_KEYS = {"sim_wall_s", "accesses_per_s", "predictor_query_us_mean"}


def _trace(seed: int = 0, **kw):  # type: ignore[no-untyped-def]
    args = dict(num_layers=4, num_experts=8, num_requests=10, prompt_len=6, output_len=8, seed=seed)
    args.update(kw)
    return random_trace(**args)


def _system(trace, predictor: str, cache: str, capacity, **kw):  # type: ignore[no-untyped-def]
    d = trace.dims
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    pred = PREDICTORS.build(predictor, dims=d)
    pol = CACHES.build(cache, capacity_slots=capacity_slots(capacity, d), num_layers=d.num_layers,
                       num_experts=d.num_experts)
    return simulate(trace.split("test"), pred, pol, cost, progress=False, **kw)


def test_metric_keys_are_core_keys_plus_extras() -> None:
    """Every CORE_KEYS entry is present; undefined ones are NaN (no predictor -> precision)."""
    m = _system(_trace(), "none", "lru", 0.25).metrics
    assert set(CORE_KEYS) <= set(m)
    for k in ("hits_total", "misses_total", "prefetches_issued", "prefetches_dropped",
              "ttft_norm_mean", "tpot_norm_mean", "sim_wall_s", "accesses_per_s"):
        assert k in m
    assert "substitution_rate" not in m
    assert math.isnan(m["prediction_precision"]) and m["prediction_recall"] == 0.0
    assert m["hits_total"] + m["misses_total"] == m["accesses_total"]
    assert m["expert_cache_bytes"] == capacity_slots(0.25, _trace().dims) * _trace().dims.expert_bytes


def test_no_offload_hits_everything_without_stalls() -> None:
    """The resident cache pins all L*J experts: hit rate 1, no stall, no traffic, norm 1."""
    m = _system(_trace(), "none", "resident", 0.25).metrics
    assert m["hit_rate"] == 1.0 and m["stall_ms_total"] == 0.0 and m["h2d_bytes_total"] == 0.0
    assert m["ttft_norm_mean"] == pytest.approx(1.0) and m["tpot_norm_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_hit_rate_at_least_deepspeed(seed: int) -> None:
    """At equal capacity, oracle (perfect prefetch + Belady) >= deepspeed (on-demand LRU),
    and Belady without prefetch >= LRU (MIN is optimal for demand paging)."""
    tr = _trace(seed, num_requests=12, num_topics=4)
    for cap in (0.1, 0.25, 0.5):
        ds = _system(tr, "none", "lru", cap).metrics["hit_rate"]
        orc = _system(tr, "oracle", "belady", cap).metrics
        mn = _system(tr, "none", "belady", cap).metrics["hit_rate"]
        assert orc["hit_rate"] >= ds, (seed, cap)
        assert mn >= ds, (seed, cap)
        assert orc["prediction_recall"] == 1.0 and orc["prediction_precision"] == 1.0


def test_full_capacity_misses_only_first_touches() -> None:
    """With room for every expert, each (layer, expert) misses exactly once (its first use)."""
    tr = _trace(3)
    test = tr.split("test")
    distinct = {(layer, int(e)) for layer in range(4) for e in test.topk_idx[:, layer].ravel()}
    m = _system(tr, "none", "lru", 1.0).metrics
    assert m["misses_total"] == len(distinct)
    assert m["h2d_bytes_total"] == len(distinct) * tr.dims.expert_bytes


def test_same_seed_same_metrics_and_series() -> None:
    """Two identical runs (online, so the seeded arrivals matter) agree exactly."""
    tr = _trace(4)
    a = _system(tr, "oracle", "belady", 0.3, arrival_rate=200.0, num_requests=6, seed=7)
    b = _system(tr, "oracle", "belady", 0.3, arrival_rate=200.0, num_requests=6, seed=7)
    strip = lambda m: {k: v for k, v in m.items() if k not in WALL_KEYS}  # noqa: E731
    assert strip(a.metrics) == strip(b.metrics)
    assert a.series == b.series
    c = _system(tr, "oracle", "belady", 0.3, arrival_rate=200.0, num_requests=6, seed=8)
    assert c.series["arrival_ms"] != a.series["arrival_ms"]


def test_online_mode_queues_and_e2e_covers_service() -> None:
    """Poisson arrivals far faster than service: requests queue, and every request's e2e
    latency >= its service time (e2e = queueing + service); 9 requests cycle the 3 tests."""
    tr = _trace(5)
    r = _system(tr, "none", "lru", 0.25, arrival_rate=1e4, num_requests=9)
    s = r.series
    assert r.metrics["requests_total"] == 9 and len(s["e2e_ms"]) == 9
    for e2e, service, queue in zip(s["e2e_ms"], s["service_ms"], s["queue_ms"], strict=True):
        assert e2e >= service - 1e-9 and queue >= 0
        assert e2e == pytest.approx(service + queue)
    assert max(s["queue_ms"]) > 0
    assert s["arrival_ms"] == sorted(s["arrival_ms"])


def test_batch_union_of_experts() -> None:
    """batch_size=2: a layer's accesses are the union over the batch's tokens, so the
    access count equals the per-(batch step, layer) union sizes; shorter requests drop out."""
    tr = hand_trace([
        [[[[0], [1]]], [[[0], [2]]]],          # request 0: prefill + 1 decode step
        [[[[1], [1]]], [[[0], [3]]], [[[2], [3]]]],  # request 1: prefill + 2 decode steps
    ], 4)
    pol = LRUCache(capacity_slots=8, num_layers=2, num_experts=4)
    r = simulate(tr, Predictor(dims=tr.dims), pol, unit_cost(tr.dims), batch_size=2, progress=False)
    # step 0: layer0 {0,1}, layer1 {1}; step 1: {0}, {2,3}; step 2 (request 1 only): {2}, {3}
    assert r.metrics["accesses_total"] == 2 + 1 + 1 + 2 + 1 + 1
    assert len(r.series["iter_hits"]) == 3
    assert r.series["e2e_ms"][0] < r.series["e2e_ms"][1]  # request 0 finished a step earlier
    assert r.series["ttft_ms"][0] == r.series["ttft_ms"][1]


class _Preloaded(LRUCache):
    def __init__(self, *, keys, **kw):  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self.keys = keys

    def initial_residents(self):  # type: ignore[no-untyped-def]
        return list(self.keys)


def test_restricted_routing_substitutes_and_never_loads() -> None:
    """Experts 1 and 2 resident. Token A chose 0 (not resident): its gate order is 0, 1,
    2, 3, so it goes to 1 (a substitution). Token B chose 2 (resident): kept.
    substitution rate 1/2; the router's experts {0, 2}: one hit, one miss; no copy, no stall."""
    tr = hand_trace([[[[[0]], [[2]]]]], 4)
    pol = _Preloaded(keys=[(0, 1), (0, 2)], capacity_slots=2, num_layers=1, num_experts=4)
    m = simulate(tr, Predictor(dims=tr.dims), pol, unit_cost(tr.dims), restricted_routing=True,
                 progress=False).metrics
    assert m["substitution_rate"] == 0.5 and m["routing_dropped_rate"] == 0.0
    assert (m["hits_total"], m["misses_total"]) == (1, 1)
    assert m["h2d_bytes_total"] == 0 and m["stall_ms_total"] == 0
    assert m["ttft_ms_mean"] == pytest.approx(300, abs=1e-3)  # dense 0.1 + experts 1, 2


def test_restricted_routing_drops_when_no_resident_alternative() -> None:
    """K=2, only expert 1 resident; the token chose [0, 1]: 1 is kept, and 0's next resident
    alternative in gate order would be 1, already used: the assignment is dropped."""
    tr = hand_trace([[[[[0, 1]]]]], 4)
    pol = _Preloaded(keys=[(0, 1)], capacity_slots=2, num_layers=1, num_experts=4)
    m = simulate(tr, Predictor(dims=tr.dims), pol, unit_cost(tr.dims), restricted_routing=True,
                 progress=False).metrics
    assert m["substitution_rate"] == 0.0 and m["routing_dropped_rate"] == 0.5
    assert m["h2d_bytes_total"] == 0


def test_restricted_routing_on_random_trace_loads_only_prefetches() -> None:
    """Restricted routing with the oracle: all traffic is prefetches, never a demand load."""
    m = _system(_trace(6), "oracle", "lru", 0.25, restricted_routing=True).metrics
    assert m["h2d_bytes_total"] == m["prefetches_issued"] * _trace(6).dims.expert_bytes
    assert m["stall_ms_total"] == 0 and 0 <= m["substitution_rate"] <= 1


def test_bad_inputs_raise_config_errors() -> None:
    """A predictor needing data the trace lacks, mismatched dims, bad batch size/rate."""
    tr = _trace(spec_depth=0)
    d = tr.dims
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    lru = LRUCache(capacity_slots=8, num_layers=4, num_experts=8)

    class NeedsSpec(Predictor):
        needs = frozenset({"spec_probs"})

    with pytest.raises(ConfigError, match="spec_probs"):
        simulate(tr, NeedsSpec(dims=d), lru, cost, progress=False)
    with pytest.raises(ConfigError, match="L=3"):
        simulate(tr, Predictor(dims=d), LRUCache(capacity_slots=8, num_layers=3, num_experts=8),
                 cost, progress=False)
    with pytest.raises(ConfigError, match="batch_size"):
        simulate(tr, Predictor(dims=d), lru, cost, batch_size=0, progress=False)
    with pytest.raises(ConfigError, match="arrival_rate"):
        simulate(tr, Predictor(dims=d), lru, cost, arrival_rate=-1.0, progress=False)


def test_normalised_latency_at_least_one_without_restriction() -> None:
    """Offloading can only add stalls to the same compute: ttft/tpot norms >= 1."""
    m = _system(_trace(7), "none", "lru", 0.2).metrics
    assert m["ttft_norm_mean"] >= 1.0 and m["tpot_norm_mean"] >= 1.0


class _RequestStartPrefetcher(Predictor):
    """Prefetches every expert of layer L-1 at start_request, nothing else."""

    def start_request(self, ctx):  # type: ignore[no-untyped-def]
        from moeexp.predictors.base import Prediction, Prefetch

        L, J = self.dims.num_layers, self.dims.num_experts
        return Prediction(prefetch=[Prefetch(1.0, L - 1, e) for e in range(J)])


def test_start_request_prefetches_survive_for_every_request() -> None:
    """start_request predictions belong to each request's first pass, including the 2nd and
    later requests (the previous pass ended at layer L-1, which must not make them look
    'already run'). Only layer L-1 of each first pass is predicted (all J experts, recall 1
    there) and recall averages over every (pass, layer) pair, so recall = n_req / pairs."""
    tr = _trace().split("test")
    dims = tr.dims
    pred = _RequestStartPrefetcher(dims=dims)
    cache = LRUCache(capacity_slots=dims.num_layers * dims.num_experts,
                     num_layers=dims.num_layers, num_experts=dims.num_experts)
    res = simulate(tr, pred, cache, unit_cost(dims), progress=False)
    pairs = tr.num_iterations * dims.num_layers
    assert res.metrics["prediction_recall"] == pytest.approx(len(tr.requests) / pairs)


def test_predictor_feed_shifts_every_layer() -> None:
    """predictor_feed_s adds its cost on the critical path of every MoE layer of every pass:
    with on-demand loading only (nothing overlaps) TPOT grows by exactly L * feed and TTFT
    by L * feed; hits do not change. A negative cost is a ConfigError."""
    tr = random_trace(num_requests=3, num_layers=4, num_experts=8, top_k=2, output_len=5, seed=2)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims)

    def run(feed: float) -> dict[str, float]:
        pred = PREDICTORS.build("none", dims=tr.dims)
        cache = LRUCache(capacity_slots=capacity_slots(0.5, tr.dims), num_layers=4, num_experts=8)
        return simulate(tr, pred, cache, cost, progress=False, predictor_feed_s=feed).metrics

    base, fed = run(0.0), run(250e-6)
    assert fed["tpot_ms_mean"] - base["tpot_ms_mean"] == pytest.approx(4 * 0.25, abs=1e-9)
    assert fed["ttft_ms_mean"] - base["ttft_ms_mean"] == pytest.approx(4 * 0.25, abs=1e-9)
    assert fed["hit_rate"] == base["hit_rate"]
    with pytest.raises(ConfigError, match="predictor_feed_s"):
        run(-1.0)


class _Resting(Predictor):
    """Fed on the passes ``fed(i)`` says (i counts passes from 0); counts its hooks."""

    name = "resting"

    def __init__(self, *, dims, fed) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dims=dims)
        self.fed, self.i, self.feed_cost = fed, -1, None
        self.tokens: list[int] = []  # each pass's token rows, as feeding() was told
        self.calls = {"start_iteration": 0, "observe_layer": 0, "end_iteration": 0}

    def set_feed_cost(self, seconds: float) -> None:
        self.feed_cost = seconds

    def feeding(self, tokens: int = 1) -> bool:
        self.i += 1
        self.tokens.append(tokens)
        return bool(self.fed(self.i))

    def start_iteration(self, ctx):  # type: ignore[no-untyped-def]
        self.calls["start_iteration"] += 1
        return super().start_iteration(ctx)

    def observe_layer(self, obs):  # type: ignore[no-untyped-def]
        self.calls["observe_layer"] += 1
        return super().observe_layer(obs)

    def end_iteration(self) -> None:
        self.calls["end_iteration"] += 1


def test_a_resting_predictor_sees_none_of_the_pass_and_costs_no_feed() -> None:
    """Predictor.feeding False: the pass's start_iteration, observe_layer and end_iteration
    are skipped and its layers are not charged predictor_feed_s; the predictor is told the
    feed cost. Resting every pass prices as the feed-free run; every other pass, half."""
    tr = random_trace(num_requests=3, num_layers=4, num_experts=8, top_k=2, output_len=5, seed=2)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims)

    def run(feed: float, fed):  # type: ignore[no-untyped-def]
        pred = _Resting(dims=tr.dims, fed=fed)
        cache = LRUCache(capacity_slots=capacity_slots(0.5, tr.dims), num_layers=4, num_experts=8)
        m = simulate(tr, pred, cache, cost, progress=False, predictor_feed_s=feed).metrics
        return m, pred

    free, _ = run(0.0, lambda i: True)
    never, p_never = run(250e-6, lambda i: False)
    always, p_always = run(250e-6, lambda i: True)
    half, p_half = run(250e-6, lambda i: i % 2 == 0)
    assert p_never.feed_cost == 250e-6
    # each pass tells feeding() its token rows: a prefill its prompt, a decode step one
    sizes = np.diff(tr.iter_offsets).tolist()
    assert sorted(p_never.tokens) == sorted(sizes) and max(sizes) > 1 and min(sizes) == 1
    assert p_never.calls == {"start_iteration": 0, "observe_layer": 0, "end_iteration": 0}
    passes = p_always.calls["start_iteration"]
    assert passes == tr.num_iterations and p_always.calls["observe_layer"] == 4 * passes
    assert p_half.calls["start_iteration"] == (passes + 1) // 2
    assert p_half.calls["observe_layer"] == 4 * p_half.calls["start_iteration"]
    for k in ("tpot_ms_mean", "ttft_ms_mean", "hit_rate"):
        assert never[k] == free[k]
    assert always["tpot_ms_mean"] - free["tpot_ms_mean"] == pytest.approx(1.0, abs=1e-9)
    assert 0 < half["tpot_ms_mean"] - free["tpot_ms_mean"] < 1.0
