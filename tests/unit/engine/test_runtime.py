"""The engine against the simulator on the very accesses it served, and its mechanisms."""

from __future__ import annotations

import types

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.cache import CACHES
from moeexp.costmodel import CostModel, load_profile
from moeexp.engine import build_offloaded, offload
from moeexp.engine.runtime import EngineSettings
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.recorder import trace_dims

PROMPTS = [(10, 0), (7, 1), (12, 2)]


def _serve(om, new: int = 5) -> list[torch.Tensor]:
    return [om.generate(prompt_ids(n, seed=s), max_new_tokens=new, do_sample=False)
            for n, s in PROMPTS]


def _simulate(trace, slots: int, cache: str, store=None) -> dict[str, float]:
    d = trace.dims
    pred = PREDICTORS.build("none", dims=d)
    pol = CACHES.build(cache, capacity_slots=slots, num_layers=d.num_layers, num_experts=d.num_experts)
    if store is not None:
        pol.fit(store)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    return simulate(trace, pred, pol, cost, progress=False).metrics


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v2"])
@pytest.mark.parametrize("capacity", [0.5, "top_k"])
def test_deepspeed_equals_simulator_on_served_accesses(model_type: str, capacity) -> None:
    """deepspeed takes no timing-dependent decision: replaying the engine's own recorded
    accesses in the simulator (predictor none + lru, same slots) gives the same hit_rate,
    h2d_bytes_total and accesses_total."""
    model = toy_model(model_type)
    ad = adapter_for(model)
    cap = ad.top_k * ad.expert_bytes() if capacity == "top_k" else capacity
    with offload(model, system="deepspeed", capacity=cap, record=True) as om:
        _serve(om)
        m = om.metrics()
        trace, slots = om.trace(), om.engine.pool.num_slots
    sim = _simulate(trace, slots, "lru")
    for key in ("hit_rate", "h2d_bytes_total", "accesses_total", "requests_total"):
        assert m[key] == sim[key], key
    assert m["requests_total"] == 3 and m["h2d_bytes_total"] > 0


def test_static_equals_simulator(store_of) -> None:
    """static pins the store's most used experts (preloaded, no traffic) and serves the
    rest through LRU scratch slots: equal to the simulator access for access."""
    model = toy_model("mixtral")
    store = store_of("mixtral")
    with offload(model, system="deepspeed", cache="static", capacity=0.5, store=store,
                 record=True) as om:
        _serve(om)
        m = om.metrics()
        trace, slots = om.trace(), om.engine.pool.num_slots
    sim = _simulate(trace, slots, "static", store=store)
    for key in ("hit_rate", "h2d_bytes_total", "accesses_total"):
        assert m[key] == sim[key], key
    assert m["preload_bytes"] > 0


def test_prediction_accounting_equals_simulator(store_of) -> None:
    """promoe (speculative gate, inline predictor): the engine's prediction recall and
    precision equal the simulator's on the recorder's greedy trace of the same prompts
    (the same routing: the engine is exact)."""
    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    model = toy_model("mixtral")
    new = 5
    prompts = [Prompt(request_id=i, text="", input_ids=tuple(prompt_ids(n, seed=s)[0].tolist()),
                      prompt_len=n, output_len=new, split="test", dataset="synthetic")
               for i, (n, s) in enumerate(PROMPTS)]
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model), name="t")
    trace = record_trace(loaded, prompts, sampling="greedy", spec_depth=2, prompt_embedder=None,
                         progress=False)
    with offload(model, system="promoe", capacity=0.5, predictor_async=False,
                 prefetch_distance=2, spec_depth=2) as om:
        for p in prompts:
            om.generate(torch.tensor([p.input_ids]), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False)
        m = om.metrics()
        slots = om.engine.pool.num_slots
    d = trace.dims
    pred = PREDICTORS.build("promoe", dims=d, distance=2)
    pol = CACHES.build("lru", capacity_slots=slots, num_layers=d.num_layers, num_experts=d.num_experts)
    sim = simulate(trace, pred, pol, CostModel.from_profile(load_profile("rtx3090_pcie4"), d),
                   progress=False).metrics
    assert m["accesses_total"] == sim["accesses_total"]
    assert m["prediction_recall"] == pytest.approx(sim["prediction_recall"])
    assert m["prediction_precision"] == pytest.approx(sim["prediction_precision"])
    assert m["prefetches_issued"] > 0


def test_oracle_with_future_trace() -> None:
    """oracle + belady from the recorded future of the same passes: exact tokens, recall 1
    (inline predictor: an asynchronous one may answer after layer 0 ran), and at least
    deepspeed's hit rate; a run that diverges from the future is refused."""
    model = toy_model("mixtral")
    with offload(model, system="deepspeed", capacity=0.25, record=True) as om:
        ref = _serve(om)
        base, future = om.metrics(), om.trace()
    with offload(model, system="oracle", capacity=0.25, future=future,
                 predictor_async=False) as om:
        outs = _serve(om)
        m = om.metrics()
    assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
    assert m["prediction_recall"] == 1.0 and m["hit_rate"] >= base["hit_rate"]
    with offload(model, system="oracle", capacity=0.25, future=future) as om:
        with pytest.raises(RuntimeError, match="future trace"):
            om.generate(prompt_ids(9, seed=42), max_new_tokens=3, do_sample=False)


def test_emulated_link_stalls_are_measured() -> None:
    """Each demand copy of one expert over a 2 ms emulated link stalls compute: the stall
    is at least ~2 ms per demand load, and every miss moved one expert's bytes."""
    model = toy_model("mixtral")
    eb = adapter_for(model).expert_bytes()
    with offload(model, system="deepspeed", capacity=0.25, bandwidth_bps=eb / 0.002) as om:
        om.generate(prompt_ids(6), max_new_tokens=3, do_sample=False)
        m = om.metrics()
    loads = m["demand_loads_total"]
    assert loads > 0 and m["h2d_bytes_total"] == loads * eb
    assert m["stall_ms_total"] >= 0.8 * 2.0 * loads
    assert m["misses_total"] == loads  # no prefetch: every miss was a demand load


def test_restricted_routing_is_lossy_but_counted(store_of) -> None:
    """Lossy mode with half the experts pinned (static) and nothing loaded on demand: no
    traffic after the preload, a substitution rate in (0, 1), every expert access a hit or
    a substituted miss; with every expert resident it is exact (substitution rate 0)."""
    model = toy_model("mixtral")
    ids = prompt_ids(10)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    with offload(model, system="deepspeed", cache={"name": "static", "scratch_slots": 1},
                 capacity=0.5, store=store_of("mixtral"), restricted_routing=True) as om:
        om.generate(ids, max_new_tokens=5, do_sample=False)
        m = om.metrics()
    assert m["h2d_bytes_total"] == 0 and m["demand_loads_total"] == 0
    assert 0 < m["substitution_rate"] < 1
    ad = adapter_for(model)
    dims = trace_dims(ad, 0)
    pol = CACHES.build("resident", capacity_slots=dims.num_layers * dims.num_experts,
                       num_layers=dims.num_layers, num_experts=dims.num_experts)
    pred = PREDICTORS.build("none", dims=dims)
    with build_offloaded(model, ad, pred, pol, EngineSettings(restricted_routing=True)) as om:
        out = om.generate(ids, max_new_tokens=5, do_sample=False)
        m = om.metrics()
    assert torch.equal(out, ref) and m["substitution_rate"] == 0 and m["hit_rate"] == 1.0


def test_recorded_trace_is_valid(mixtral) -> None:
    """record=True: one iteration per forward pass (prefill + decode steps), valid schema."""
    with offload(mixtral, capacity=0.5, record=True) as om:
        om.generate(prompt_ids(6), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        tr = om.trace()
    assert tr.num_iterations == 4 and tr.iter_step.tolist() == [0, 1, 2, 3]
    assert tr.num_tokens == 6 + 3


@pytest.mark.parametrize("system", ["mixtral_offloading", "finemoe"])
def test_demand_load_waits_for_prefetches_in_flight(system: str, store_of) -> None:
    """At K experts of capacity over a slow emulated link a layer's only free slots can be
    held by prefetches still copying: the demand load waits for them to land and evicts
    them instead of failing ("cannot make room"; seen on CUDA with oracle + belady, where
    the copy thread collects finished copies lazily). Tokens stay exact."""
    model = toy_model("mixtral")
    ad = adapter_for(model)
    eb = ad.expert_bytes()
    ids = [prompt_ids(10, seed=s) for s in range(3)]
    with torch.no_grad():
        ref = [model.generate(x, max_new_tokens=6, do_sample=False) for x in ids]
    with offload(model, system=system, capacity=ad.top_k * eb, store=store_of("mixtral"),
                 bandwidth_bps=eb / 0.003) as om:
        outs = [om.generate(x, max_new_tokens=6, do_sample=False) for x in ids]
        m = om.metrics()
    assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
    assert m["resident_expert_bytes_peak"] <= m["expert_cache_bytes"]


def test_restricted_wait_makes_lossy_runs_deterministic(store_of) -> None:
    """eMoE over a slow emulated link: with restricted_wait (copies in flight count as
    usable, the layer waits) and the inline predictor, two runs substitute the same
    choices and produce the same tokens and logits."""
    model = toy_model("mixtral")
    eb = adapter_for(model).expert_bytes()
    ids = [prompt_ids(10, seed=s) for s in range(2)]

    def run() -> tuple[list[torch.Tensor], dict]:
        with offload(model, system="emoe", capacity=0.5, store=store_of("mixtral"),
                     predictor_async=False, restricted_wait=True,
                     bandwidth_bps=eb / 0.002) as om:
            outs = [om.generate(x, max_new_tokens=5, do_sample=False, output_scores=True,
                                return_dict_in_generate=True) for x in ids]
            return outs, om.metrics()

    (a, ma), (b, mb) = run(), run()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.sequences, y.sequences)
        assert all(torch.equal(s, t) for s, t in zip(x.scores, y.scores, strict=True))
    assert ma["substitution_rate"] == mb["substitution_rate"]
    assert ma["hit_rate"] == mb["hit_rate"]


def test_residency_cycle_sets_each_pass_residency(store_of) -> None:
    """``Engine.residency_cycle``: forward pass k of a static offloaded eMoE engine
    (restricted routing) computes under ``cycle[k % len(cycle)]``. Every expert usable in
    every layer: nothing substituted or dropped, the plain model's logits; expert 0 only
    (top-2 routing): each token keeps or gets expert 0 once and drops its other choice, so
    exactly half the routed choices drop (as the continuous path's residency replay); a
    two-pass cycle [all, one] alternates (passes 0 and 2 exact, 1 and 3 lossy)."""
    from moeexp.cache import build_cache
    from moeexp.engine.build import engine_settings
    from moeexp.predictors import build_predictor
    from moeexp.systems import resolve_system

    model = toy_model("mixtral")
    store = store_of("mixtral")
    d = store.dims
    pcfg, ccfg, _ = resolve_system("emoe", None, {"capacity": 0.5},
                                   model={"prefetch_distance": 1})
    ids = prompt_ids(10)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    every = [list(range(d.num_experts))] * d.num_layers
    one = [[0]] * d.num_layers

    def run(cycle, passes: int = 1) -> tuple[list[torch.Tensor], dict[str, float]]:
        pred, pol = build_predictor(pcfg, d), build_cache(ccfg, d)
        pred.fit(store)
        pol.fit(store)
        with build_offloaded(model, adapter_for(model), pred, pol,
                             engine_settings({"restricted_routing": True,
                                              "restricted_wait": True}), system="emoe") as om:
            assert om.engine.residency_cycle is None
            om.engine.residency_cycle = cycle
            with torch.no_grad():
                out = [om(input_ids=ids).logits for _ in range(passes)]
            return out, om.metrics()

    out, m = run([every])
    assert m["substitution_rate"] == 0 and m["routing_dropped_rate"] == 0
    assert torch.allclose(out[0], ref, atol=1e-5)
    _, m = run([one])
    assert m["routing_dropped_rate"] == pytest.approx(0.5)
    out, m = run([every, one], passes=4)
    assert m["routing_dropped_rate"] == pytest.approx(0.25)  # half of the passes lose half
    assert torch.allclose(out[0], ref, atol=1e-5) and torch.allclose(out[2], ref, atol=1e-5)
    assert not torch.allclose(out[1], ref, atol=1e-3) and torch.equal(out[1], out[3])


@pytest.mark.parametrize("rest_prefetch", [False, True])
def test_a_resting_predictor_is_not_fed_and_the_tokens_stay_exact(store_of,
                                                                   rest_prefetch: bool) -> None:
    """prefetch_if_pays told a feed cost no miss can pay for (10 s a layer): the engine asks
    ``Predictor.feeding`` as each pass begins and submits none of a resting pass's hooks, so
    the predictor never sees a layer; greedy tokens equal the plain model's. With
    ``rest_prefetch`` off every eviction is on-demand LRU's: the same hits, misses and bytes
    as ``deepspeed`` (recency in the order of events, not the engine's access clock, which
    ranks a layer's hits and demand loads by expert); with it on (the default) the engine
    hands each rested layer's routing to ``rest_layer`` and the cache weighs its offers."""
    model = toy_model("mixtral")
    new = 48
    with torch.no_grad():
        refs = [model.generate(prompt_ids(n, seed=s), max_new_tokens=new, do_sample=False)
                for n, s in PROMPTS]
    with offload(model, system="prefetch_if_pays", capacity=0.5, store=store_of("mixtral"),
                 predictor={"spec": "off"}, hardware="rtx3090_pcie4",
                 cache={"rest_prefetch": rest_prefetch}, predictor_async=False) as om:
        runner = om.engine.runner
        runner.predictor.set_feed_cost(10.0)
        gate = om.engine.cache.feed_gate
        assert gate is not None
        told: list[int] = []  # each pass's token rows, as the gate is told them
        begins = gate.pass_begins
        gate.pass_begins = lambda tokens=1: (told.append(tokens), begins(tokens))[1]
        outs = [om.generate(prompt_ids(n, seed=s), max_new_tokens=new, do_sample=False)
                for n, s in PROMPTS]
        gated = om.metrics()
    assert runner.rested_passes == len(PROMPTS) * new
    assert told == [t for n, _ in PROMPTS for t in [n] + [1] * (new - 1)]
    assert runner.predictor._queries == 0  # observe_layer never ran (start_request did)
    assert runner.predictor.stats()["feed_rested_share"] == 1.0
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out, ref)
    if rest_prefetch:  # every rested layer's routing reached the gate's use patterns
        assert gate.history.any()
        assert gated["prefetches_issued"] + om.engine.cache.refused > 0
        return
    assert not gate.history.any()
    with offload(model, system="deepspeed", capacity=0.5, predictor_async=False) as om:
        _serve(om, new)
        lru = om.metrics()
    for key in ("hits_total", "misses_total", "h2d_bytes_total"):
        assert gated[key] == lru[key], key


def test_the_knn_feature_runs_on_the_engine_and_the_tokens_stay_exact(
        store_of, monkeypatch: pytest.MonkeyPatch) -> None:
    """``reuse_prob`` with ``knn=true`` (and ``knn_ahead``) on the engine: the index is
    queried at every layer of every decode pass (and of no prefill), and greedy tokens
    equal the plain model's."""
    from moeexp.predictors.trajectory_index import TrajectoryIndex

    layers: list[int] = []
    real = TrajectoryIndex.observe

    def spy(self, layer, experts):
        layers.append(int(layer))
        return real(self, layer, experts)

    monkeypatch.setattr(TrajectoryIndex, "observe", spy)
    model = toy_model("mixtral")
    new = 8
    with torch.no_grad():
        refs = [model.generate(prompt_ids(n, seed=s), max_new_tokens=new, do_sample=False)
                for n, s in PROMPTS]
    with offload(model, system="prefetch_if_pays", capacity=0.5, store=store_of("mixtral"),
                 predictor={"spec": "off", "knn": True, "knn_ahead": True},
                 hardware="rtx3090_pcie4",
                 predictor_async=False) as om:
        pred = om.engine.runner.predictor
        assert pred.models is not None and pred.models.knn is not None and pred.knn_ahead
        outs = [om.generate(prompt_ids(n, seed=s), max_new_tokens=new, do_sample=False)
                for n, s in PROMPTS]
    L = model.config.num_hidden_layers
    assert layers == list(range(L)) * (len(PROMPTS) * (new - 1))  # decode passes only
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out, ref)
