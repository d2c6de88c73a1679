"""Continuous batching on the engine (moeexp.engine.continuous, moeexp.engine.batch_pass):
per request, the tokens of every exact system under continuous batching with staggered
joins are the plain model's greedy tokens for that request alone; budgets, refusals, the
oracle's per-pass future, and failure inside a pass."""

from __future__ import annotations

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.cache import build_cache
from moeexp.data.prompts import Prompt
from moeexp.engine.batch_pass import build_pass_model
from moeexp.engine.continuous import ContinuousRun, serve_continuous
from moeexp.engine.runtime import EngineSettings
from moeexp.errors import ConfigError
from moeexp.metrics import CORE_KEYS
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import SUPPORTED_MODEL_TYPES as ARCHS
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import build_predictor
from moeexp.schedulers import build_scheduler
from moeexp.schedulers.base import ServingProfile
from moeexp.serving.arrivals import poisson_arrivals
from moeexp.serving.settings import ServingSettings
from moeexp.systems import resolve_system, system_names

OUT_LENS = (6, 2, 5, 3, 4)
PROFILE = ServingProfile(output_len_by_task={}, output_len_mean=4.0, token_s=1e-3,
                         expert_load_s=1e-3)


def _prompts(n: int = len(OUT_LENS)) -> list[Prompt]:
    """Prompts of 5.. tokens with output lengths OUT_LENS (they finish at different passes)."""
    return [Prompt(request_id=100 + i, text=f"p{i}",
                   input_ids=tuple(prompt_ids(5 + i, seed=20 + i)[0].tolist()),
                   prompt_len=5 + i, output_len=OUT_LENS[i % len(OUT_LENS)], split="test",
                   dataset="synthetic") for i in range(n)]


def _alone(model: torch.nn.Module, p: Prompt) -> list[int]:
    """The plain model's greedy tokens for ``p`` served alone (EOS suppressed)."""
    ids = torch.tensor([list(p.input_ids)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=p.output_len, min_new_tokens=p.output_len,
                             do_sample=False)
    return out[0, len(p.input_ids):].tolist()


def _record(model: torch.nn.Module, prompts: list[Prompt]):  # type: ignore[no-untyped-def]
    """A greedy trace of ``prompts`` recorded from the plain model."""
    import types

    from moeexp.traces.recorder import record_trace

    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name="tiny")
    return record_trace(loaded, prompts, sampling="greedy", spec_depth=2, record_hidden=False,
                        prompt_embedder=None, progress=False)


def serving_case(store):  # type: ignore[no-untyped-def]
    """(loaded toy Mixtral, prompts, their greedy trace, ``store``, rtx3090_pcie4 cost model):
    the one case the engine-vs-simulator serving tests share."""
    from moeexp.costmodel import CostModel, load_profile
    from moeexp.models.loading import LoadedModel

    model = toy_model("mixtral")
    loaded = LoadedModel(model=model, tokenizer=None, adapter=adapter_for(model), name="tiny",
                         source="test")
    prompts = _prompts()
    trace = _record(model, prompts)
    return loaded, prompts, trace, store, CostModel.from_profile(load_profile("rtx3090_pcie4"),
                                                                 trace.dims)


def _policies(system: str, store, capacity):  # type: ignore[no-untyped-def]
    pcfg, ccfg, settings = resolve_system(system, None, {"capacity": capacity},
                                          model={"prefetch_distance": 1})
    pred, pol = build_predictor(pcfg, store.dims), build_cache(ccfg, store.dims)
    pred.fit(store)
    pol.fit(store)
    return pred, pol, settings


def _serve(model, pred, pol, prompts, *, settings: ServingSettings | None = None,  # type: ignore[no-untyped-def]
           scheduler: str = "fcfs", batch_decode: bool = False, **kw) -> ContinuousRun:
    eng = EngineSettings(spec_depth=2, predictor_async=False)
    pm = build_pass_model(model, adapter_for(model), pred, pol, eng, max_members=8,
                          batch_decode=batch_decode)
    try:
        return serve_continuous(pm, prompts, build_scheduler({"name": scheduler}), PROFILE,
                                settings=settings or ServingSettings(max_batch_tokens=64,
                                                                     max_running=3),
                                eos_token_ids=[2], **kw)
    finally:
        pm.close()


def _joined_mid_decode(run: ContinuousRun) -> bool:
    """Some request's first pass (its prefill) had members that were already decoding."""
    seen: set[int] = set()
    for members in run.passes:
        if any(m not in seen for m in members) and any(m in seen for m in members):
            return True
        seen.update(members)
    return False


def _exact_systems() -> list[str]:
    out = []
    for name in system_names():
        try:
            p, c, s = resolve_system(name)
        except ConfigError:
            continue
        if s.get("restricted_routing") or c["name"] == "belady":
            continue  # lossy (eMoE); Belady: not applicable under continuous batching
        out.append(name)
    return out


@pytest.mark.parametrize(("model_type", "batch_decode"), [
    ("mixtral", False), ("deepseek_v3", False), ("mixtral", True)])
def test_every_exact_system_is_token_identical_per_request(model_type: str, batch_decode: bool,
                                                           store_of) -> None:
    """Every exact conf/system bundle (fitted on a store trace; at 25 % capacity and at K
    slots on Mixtral), 5 requests, at most 3 running, fcfs: requests join while others
    decode and leave at different passes, and each request's tokens are the plain
    model's greedy tokens for it alone (one forward per request, or the decoding requests
    as one padded forward)."""
    systems = _exact_systems()
    assert {"deepspeed", "no_offload", "finemoe", "moe_infinity"} <= set(systems)
    model = toy_model(model_type)
    ad = adapter_for(model)
    store = store_of(model_type)
    prompts = _prompts()
    ref = {p.request_id: _alone(model, p) for p in prompts}
    caps = (0.25, ad.top_k * ad.expert_bytes()) if model_type == "mixtral" else (0.25,)
    ran = []
    for name in systems:
        for cap in caps:
            try:
                pred, pol, _ = _policies(name, store, cap)
            except ConfigError as exc:  # e.g. a learned predictor needing more layers
                assert "distance" in str(exc) or "needs" in str(exc), exc
                break
            run = _serve(model, pred, pol, prompts, batch_decode=batch_decode)
            assert run.tokens == ref, f"{name} at capacity {cap}: tokens differ"
            assert _joined_mid_decode(run) and run.metrics["batch_requests_peak"] == 3
            assert run.metrics["expert_slots"] <= pol.capacity_slots or name == "no_offload"
            ran.append(name)
    assert {"deepspeed", "no_offload", "finemoe", "moe_infinity"} <= set(ran), ran
    assert model.config._experts_implementation == "grouped_mm"  # plain again


def test_poisson_arrivals_stay_exact_and_conserve_requests(store_of) -> None:
    """Seeded Poisson arrivals on the wall clock (the simulator's arrival function),
    deepspeed at K slots (prefill streams): every request served once, exactly
    ``output_len`` passes each, tokens identical; the metrics hold every CORE_KEY."""
    model = toy_model("mixtral")
    ad = adapter_for(model)
    prompts = _prompts(8)
    ref = {p.request_id: _alone(model, p) for p in prompts}
    pred, pol, _ = _policies("deepspeed", store_of("mixtral"), ad.top_k * ad.expert_bytes())
    run = _serve(model, pred, pol, prompts, arrivals_s=poisson_arrivals(400.0, 8, seed=3))
    assert run.tokens == ref
    assert sorted(run.admitted) == sorted(ref)
    for p in prompts:
        assert sum(p.request_id in m for m in run.passes) == p.output_len
    m = run.metrics
    assert set(CORE_KEYS) <= set(m)
    assert m["requests_total"] == 8 and m["output_tokens_total"] == sum(p.output_len for p in prompts)
    assert len(run.series["iter_hits"]) == len(run.passes) == m["passes_total"]
    assert min(run.series["queue_ms"]) >= 0 and m["ttft_ms_mean"] > 0


def test_oracle_gets_each_pass_future_and_belady_is_refused(store_of) -> None:
    """The oracle predictor (with LRU) gets each pass's true accesses from a greedy trace
    of the same prompts (checked against what every layer uses); it is exact and its
    recall is 1. Belady (the oracle bundle) is not applicable: refused before any work."""
    model = toy_model("mixtral")
    prompts = _prompts()
    ref = {p.request_id: _alone(model, p) for p in prompts}
    trace = _record(model, prompts)
    store = store_of("mixtral")
    pred, pol, _ = _policies("deepspeed", store, 0.25)
    pred = build_predictor({"name": "oracle"}, store.dims)
    run = _serve(model, pred, pol, prompts, future=trace)
    assert run.tokens == ref
    assert run.metrics["prediction_recall"] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="needs the future"):
        _serve(model, build_predictor({"name": "oracle"}, store.dims), pol, prompts)
    opred, opol, _ = _policies("oracle", store, 0.25)
    with pytest.raises(ConfigError, match="not applicable"):
        build_pass_model(model, adapter_for(model), opred, opol, EngineSettings())
    assert model.config._experts_implementation == "grouped_mm"


def test_kv_pool_refuses_admission_and_budgets_fail_early(store_of) -> None:
    """A KV pool holding two reservations: fcfs holds the third request back (counted as
    blocked for memory), the run stays exact. A prompt over T_max, or a reservation over
    the pool, is a ConfigError before any pass."""
    model = toy_model("mixtral")
    prompts = _prompts()
    ref = {p.request_id: _alone(model, p) for p in prompts}
    store = store_of("mixtral")
    per_token = 10
    biggest = max(per_token * (p.prompt_len + 4) for p in prompts)
    pred, pol, _ = _policies("deepspeed", store, 0.25)
    run = _serve(model, pred, pol, prompts, kv_bytes_per_token=per_token,
                 kv_pool_bytes=2 * biggest + 1)
    assert run.tokens == ref
    assert run.metrics["batch_requests_peak"] == 2
    assert run.metrics["scheduler_blocked_memory"] > 0
    assert run.metrics["kv_reserved_peak_bytes"] <= 2 * biggest + 1
    assert run.metrics["kv_cache_bytes_peak"] > 0
    with pytest.raises(ConfigError, match="T_max must be >= 9"):
        _serve(model, pred, pol, prompts, settings=ServingSettings(max_batch_tokens=8))
    with pytest.raises(ConfigError, match="exceeds the KV pool"):
        _serve(model, pred, pol, prompts, kv_bytes_per_token=per_token, kv_pool_bytes=biggest - 1)


def test_failure_inside_a_pass_propagates_and_restores(store_of) -> None:
    """A router raising in one member's forward of a 3-member pass: the error reaches the
    caller (no thread waits forever), close() restores the plain model."""
    model = toy_model("mixtral")
    prompts = _prompts()
    pred, pol, _ = _policies("deepspeed", store_of("mixtral"), 0.25)
    router = adapter_for(model).moe_layers()[1].router
    calls = {"n": 0}

    def boom(*_a: object) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("boom")

    h = router.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            _serve(model, pred, pol, prompts)
    finally:
        h.remove()
    assert model.config._experts_implementation == "grouped_mm"
    ref = _alone(model, prompts[0])
    assert _serve(model, *_policies("deepspeed", store_of("mixtral"), 0.25)[:2],
                  prompts[:1]).tokens[prompts[0].request_id] == ref


def test_a_scheduler_breaking_a_budget_is_caught(store_of) -> None:
    """A scheduler admitting every waiting request whatever max_running says: the engine's
    loop (the simulator's rule, schedulers.base.check_admission) raises before the pass."""
    from moeexp.schedulers.base import Scheduler, SchedulerView

    class Greedy(Scheduler):
        name = "greedy_test"

        def admit(self, view: SchedulerView) -> list[int]:
            return [w.unit for w in view.waiting]

    model = toy_model("mixtral")
    pred, pol, _ = _policies("deepspeed", store_of("mixtral"), 0.25)
    pm = build_pass_model(model, adapter_for(model), pred, pol, EngineSettings(spec_depth=2))
    try:
        with pytest.raises(RuntimeError, match="broke max_running"):
            serve_continuous(pm, _prompts(), Greedy(), PROFILE,
                             settings=ServingSettings(max_batch_tokens=64, max_running=2))
    finally:
        pm.close()


@pytest.mark.parametrize("batch_decode", [False, True])
@pytest.mark.parametrize("model_type", ARCHS)
def test_every_architecture_is_token_identical_per_request(model_type: str,
                                                           batch_decode: bool) -> None:
    """deepspeed (LRU, on demand) at 25 % capacity on every supported architecture (dense
    layers, shared experts, MLA caches, GPT-OSS's sliding windows and sinks), 5 requests,
    at most 3 running: each request's tokens are the plain model's alone; with
    ``batch_decode`` the decoding requests of a pass ran as one padded forward (every
    architecture but GPT-OSS, whose sliding-window caches are not stacked)."""
    import moeexp.engine.batch_pass as bp
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS
    from moeexp.traces.recorder import trace_dims

    model = toy_model(model_type)
    impl = model.config._experts_implementation
    ad = adapter_for(model)
    dims = trace_dims(ad, 0)
    prompts = _prompts()
    ref = {p.request_id: _alone(model, p) for p in prompts}
    slots = max(ad.top_k, dims.num_layers * dims.num_experts // 4)
    pol = CACHES.build("lru", capacity_slots=slots, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    padded = []
    call = bp.PassModel._call

    def counting(self, members, group):  # type: ignore[no-untyped-def]
        padded.append(len(group) > 1)
        return call(self, members, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bp.PassModel, "_call", counting)
        run = _serve(model, PREDICTORS.build("none", dims=dims), pol, prompts,
                     batch_decode=batch_decode)
    assert run.tokens == ref
    assert _joined_mid_decode(run)
    assert any(padded) == (batch_decode and model_type != "gpt_oss")
    assert model.config._experts_implementation == impl  # plain again


def test_lossy_emoe_runs_under_continuous_batching(store_of) -> None:
    """eMoE (restricted routing, lossy: not held to the plain tokens) serves every request
    its output_len tokens; substitutions are counted over the pass's concatenated router
    logits."""
    model = toy_model("mixtral")
    prompts = _prompts()
    pred, pol, sys_settings = _policies("emoe", store_of("mixtral"), 0.25)
    assert sys_settings.get("restricted_routing")
    eng = EngineSettings(spec_depth=2, predictor_async=False, restricted_routing=True,
                         restricted_wait=True)
    pm = build_pass_model(model, adapter_for(model), pred, pol, eng, max_members=8)
    try:
        run = serve_continuous(pm, prompts, build_scheduler({"name": "fcfs"}), PROFILE,
                               settings=ServingSettings(max_batch_tokens=64, max_running=3),
                               eos_token_ids=[2])
    finally:
        pm.close()
    assert {rid: len(t) for rid, t in run.tokens.items()} == {p.request_id: p.output_len
                                                              for p in prompts}
    assert 0.0 <= run.metrics["substitution_rate"] <= 1.0


def _lossy_serve(store, residency, system="emoe", capacity=0.25, **kw):  # type: ignore[no-untyped-def]
    """``system``'s policies with restricted routing and threaded copies (thread timing
    decides what lands), served with continuous batching under a residency replay."""
    model = toy_model("mixtral")
    prompts = _prompts()
    pred, pol, _ = _policies(system, store, capacity)
    eng = EngineSettings(spec_depth=2, predictor_async=True, restricted_routing=True, **kw)
    pm = build_pass_model(model, adapter_for(model), pred, pol, eng, max_members=8)
    try:
        run = serve_continuous(pm, prompts, build_scheduler({"name": "fcfs"}), PROFILE,
                               settings=ServingSettings(max_batch_tokens=64, max_running=3),
                               eos_token_ids=[2], residency=residency)
    finally:
        pm.close()
    return model, prompts, run


def test_residency_replay_of_every_expert_is_exact(store_of) -> None:
    """deepspeed's policies (no prefetch: nothing is ever resident unless loaded) under
    restricted routing and a replayed residency holding every expert of every layer
    (capacity 1.0: 16 slots): no choice is substituted, every request's tokens are the
    plain model's alone, and each of the 2 x 8 experts was loaded on demand exactly once.
    At capacity 0.25 (4 slots) the same replay is refused: a layer's 8 usable experts
    cannot be held at once."""
    J, L = 8, 2  # the toy Mixtral
    every = [[list(range(J))] * L] * 64
    model, prompts, run = _lossy_serve(store_of("mixtral"), every, "deepspeed", 1.0)
    assert run.metrics["substitution_rate"] == 0.0
    assert run.metrics["routing_dropped_rate"] == 0.0
    assert run.tokens == {p.request_id: _alone(model, p) for p in prompts}
    assert run.metrics["demand_loads_total"] == J * L
    with pytest.raises(ConfigError, match="8 usable experts, more than the engine's 4 slots"):
        _lossy_serve(store_of("mixtral"), every, "deepspeed", 0.25)


def test_residency_replay_of_one_expert_hand_worked(store_of) -> None:
    """Only expert 0 usable in every layer (top-2 routing): each token keeps or gets expert
    0 once and drops its other choice, so exactly half the routed choices drop; the same
    replay gives the same tokens whatever the engine's copies do (restricted_wait on/off)."""
    one = [[[0], [0]]] * 64
    _, _, run = _lossy_serve(store_of("mixtral"), one)
    m = run.metrics
    assert m["routing_dropped_rate"] == pytest.approx(0.5)
    _, _, again = _lossy_serve(store_of("mixtral"), one, restricted_wait=True)
    assert again.tokens == run.tokens


def test_residency_replay_refused_for_exact_and_too_short(store_of) -> None:
    """A residency replay needs restricted routing; one shorter than the passes run fails."""
    model = toy_model("mixtral")
    pred, pol, _ = _policies("deepspeed", store_of("mixtral"), 0.25)
    with pytest.raises(ConfigError, match="restricted routing"):
        _serve(model, pred, pol, _prompts(), residency=[[[0], [0]]])
    with pytest.raises(ConfigError, match="residency replay holds 1 passes"):
        _lossy_serve(store_of("mixtral"), [[[0], [0]]])


def test_the_pass_model_binds_the_cost_model_it_is_given(store_of) -> None:
    """build_pass_model hands ``cost`` to the predictor (``Predictor.bind``, as the
    simulator's serve does): prefetch_if_pays's cache learns the copy time."""
    from moeexp.cache import CACHES
    from moeexp.costmodel import CostModel, load_profile
    from moeexp.predictors import PREDICTORS

    model = toy_model("mixtral")
    d = store_of("mixtral").dims
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    pred = PREDICTORS.build("reuse_prob", dims=d, depth=1)
    pol = CACHES.build("next_use", capacity_slots=6, num_layers=d.num_layers,
                       num_experts=d.num_experts)
    assert pol.copy_s is None
    build_pass_model(model, adapter_for(model), pred, pol,
                     EngineSettings(predictor_async=False), cost=cost).close()
    assert pol.copy_s == cost.copy_s
