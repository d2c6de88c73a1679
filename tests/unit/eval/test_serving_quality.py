"""eMoE's quality at a serving operating point (moeexp.eval.serving_quality): the logits the
serving engine produces are scored against the plain model at the right positions (an
exact system agrees everywhere, perplexity ratio 1), eMoE's restricted routing substitutes
and disagrees, the greedy comparison counts first divergences, bad settings fail."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.backends.base import BackendContext
from moeexp.cache import build_cache
from moeexp.costmodel import CostModel, load_profile
from moeexp.data.prompts import Prompt
from moeexp.errors import ConfigError
from moeexp.eval.serving_quality import (
    ServingQualitySettings,
    greedy_metrics,
    serving_quality,
)
from moeexp.models.adapters import adapter_for
from moeexp.models.loading import LoadedModel
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import build_predictor
from moeexp.registry import GroupChoice
from moeexp.systems import resolve_system

OUT_LENS = (6, 3, 5, 4)


@pytest.fixture(scope="module")
def setup(store_of):  # type: ignore[no-untyped-def]
    from moeexp.traces.recorder import record_trace

    model = toy_model("mixtral")
    loaded = LoadedModel(model=model, tokenizer=None, adapter=adapter_for(model), name="tiny",
                         source="test")
    prompts = [Prompt(request_id=200 + i, text=f"q{i}",
                      input_ids=tuple(prompt_ids(6 + i, seed=40 + i)[0].tolist()),
                      prompt_len=6 + i, output_len=OUT_LENS[i], split="test",
                      dataset="synthetic") for i in range(len(OUT_LENS))]
    ns = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                               name="tiny")
    trace = record_trace(ns, prompts, sampling="greedy", spec_depth=2, record_hidden=False,
                         prompt_embedder=None, progress=False)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), trace.dims)
    return loaded, prompts, trace, store_of("mixtral"), cost


def _ctx(setup, system: str, capacity: float):  # type: ignore[no-untyped-def]
    loaded, prompts, trace, store, cost = setup
    pcfg, ccfg, settings = resolve_system(system, None, {"capacity": capacity},
                                          model={"prefetch_distance": 1})
    pred, pol = build_predictor(pcfg, store.dims), build_cache(ccfg, store.dims)
    pred.fit(store)
    pol.fit(store)
    ctx = BackendContext(loaded=loaded, prompts=prompts, trace=trace, predictor=pred,
                         cache=pol, cost=cost, seed=0, store=store,
                         scheduler=GroupChoice("fcfs", {}))
    return ctx, bool(settings.get("restricted_routing", False))


def _settings(restricted: bool = True, **kw) -> ServingQualitySettings:  # type: ignore[no-untyped-def]
    base = {"arrival_rate": 2000.0, "num_requests": None, "time_scale": 1.0,
            "modes": ("teacher_forced", "greedy"), "restricted_routing": restricted,
            "serving": {"max_batch_tokens": 64, "max_running": 3},
            "engine": {"device": "cpu", "warmup": 0, "predictor_async": False,
                       "restricted_wait": True}}
    return ServingQualitySettings(**{**base, **kw})


def test_exact_system_agrees_everywhere(setup) -> None:
    """deepspeed (exact) served with continuous batching: every generated position's argmax
    is the plain model's (agreement 1, KL ~0, perplexity ratio 1), the free-running greedy
    tokens are the plain model's for every request; positions = sum(output_len - 1)."""
    ctx, restricted = _ctx(setup, "deepspeed", 0.25)
    assert not restricted
    res = serving_quality(ctx, _settings(restricted))
    m = res.metrics
    assert m["tf_positions"] == sum(n - 1 for n in OUT_LENS)
    assert m["tf_token_agreement"] == 1.0
    assert m["tf_recorded_is_argmax"] == 1.0  # a greedy trace: the recorded token is the argmax
    assert abs(m["tf_perplexity_ratio"] - 1.0) < 1e-4 and m["tf_kl_mean"] < 1e-6
    assert m["greedy_agreement"] == 1.0 and m["greedy_identical_requests"] == 1.0
    assert m["greedy_first_divergence_mean"] == pytest.approx(sum(OUT_LENS) / len(OUT_LENS))
    assert math.isnan(m["engine_substitution_rate"]) or m["engine_substitution_rate"] == 0.0
    assert m["sim_batch_requests_mean"] >= 1.0 and m["requests_served"] == len(OUT_LENS)
    # on the simulator's clock the engine runs the simulator's very passes
    assert m["passes_match"] == 1.0 and m["greedy_passes_match"] == 1.0
    assert m["engine_batch_requests_mean"] == m["sim_batch_requests_mean"] > 1.0
    assert len(res.series["request_id"]) == len(OUT_LENS)


def test_emoe_substitutes_and_loses_agreement(setup) -> None:
    """eMoE at 2 of 8 experts per layer with restricted routing: the simulator and the
    engine substitute, and the eMoE model's next-token distributions differ from the plain
    model's (KL > 0, perplexity ratio != 1; a random toy model's argmax rarely flips);
    num_requests serves the first n requests only."""
    ctx, restricted = _ctx(setup, "emoe", 0.25)
    assert restricted
    m = serving_quality(ctx, _settings(restricted, num_requests=3)).metrics
    assert m["requests_served"] == 3 and m["tf_positions"] == sum(n - 1 for n in OUT_LENS[:3])
    assert m["sim_substitution_rate"] > 0 and m["engine_substitution_rate"] > 0
    assert m["tf_token_agreement"] <= 1.0 and m["tf_kl_mean"] > 1e-6
    assert abs(m["tf_perplexity_ratio"] - 1.0) > 1e-6
    assert m["substitution_rate"] == m["sim_substitution_rate"] and m["passes_match"] == 1.0


def test_greedy_metrics_hand_worked() -> None:
    """ref [1,2,3,4] vs [1,2,9,4]: 3 of 4 agree, first divergence at 2; [5,6] vs [7,6]:
    1 of 2, divergence 0; identical requests none -> pooled 4/6, mean divergence 1."""
    m, per = greedy_metrics({1: [1, 2, 3, 4], 2: [5, 6]}, {1: [1, 2, 9, 4], 2: [7, 6]})
    assert m["greedy_agreement"] == pytest.approx(4 / 6)
    assert per["greedy_first_divergence"] == [2.0, 0.0]
    assert m["greedy_first_divergence_mean"] == 1.0 and m["greedy_identical_requests"] == 0.0
    m2, _ = greedy_metrics({1: [1, 2]}, {1: [1, 2]})
    assert m2["greedy_identical_requests"] == 1.0 and m2["greedy_first_divergence_mean"] == 2.0


def test_emoe_quality_uses_the_simulated_residency(setup) -> None:
    """residency=simulator (default): the engine's lossy layers use the simulator's ready
    sets of the same pass and layer, so the measured quality no longer depends on the
    engine's own copies (a zero-time link under restricted_wait, or thread timing without
    it): every teacher-forced and greedy number is the same either way."""
    ctx, restricted = _ctx(setup, "emoe", 0.25)
    eng = {"device": "cpu", "warmup": 0, "predictor_async": True}
    keys = ("tf_token_agreement", "tf_kl_mean", "tf_perplexity", "engine_substitution_rate",
            "engine_routing_dropped_rate", "greedy_agreement", "greedy_first_divergence_mean")
    runs = [serving_quality(ctx, _settings(restricted, engine={**eng, "restricted_wait": w}))
            for w in (True, False)]
    assert runs[0].metrics["residency"] == "simulator"
    assert [runs[0].metrics[k] for k in keys] == [runs[1].metrics[k] for k in keys]
    own = serving_quality(ctx, _settings(restricted, residency="engine")).metrics
    assert own["residency"] == "engine" and own["passes_match"] == 1.0
    # a link so slow that no simulated copy ever lands: the simulated point drops every
    # routed choice, and so does the engine computing under its residency; the engine's
    # own zero-time copies (residency=engine, restricted_wait) keep most choices
    loaded, prompts, trace, store, cost = setup
    slow = CostModel.from_profile(dataclasses.replace(load_profile("rtx3090_pcie4"),
                                                      h2d_gbps=1e-9), trace.dims)
    sctx = BackendContext(**{**ctx.__dict__, "cost": slow})
    tf = {"modes": ("teacher_forced",)}
    sim_res = serving_quality(sctx, _settings(restricted, **tf)).metrics
    assert sim_res["sim_routing_dropped_rate"] == 1.0
    assert sim_res["engine_routing_dropped_rate"] == 1.0
    eng_res = serving_quality(sctx, _settings(restricted, residency="engine", **tf)).metrics
    assert eng_res["engine_routing_dropped_rate"] < 0.5
    exact, _ = _ctx(setup, "deepspeed", 0.25)
    assert serving_quality(exact, _settings(False, modes=("teacher_forced",))
                           ).metrics["residency"] == "exact"


@pytest.mark.parametrize("bad", [{"arrival_rate": 0}, {"time_scale": -1.0}, {"clock": "gpu"},
                                 {"modes": ("bleu",)}, {"modes": ()}, {"num_requests": 0},
                                 {"residency": "gpu"}, {"clock": "wall"}])
def test_bad_settings_fail(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="serving_quality"):
        ServingQualitySettings(**bad)


def test_static_scheduler_refused(setup) -> None:
    ctx, restricted = _ctx(setup, "deepspeed", 0.25)
    static = BackendContext(**{**ctx.__dict__, "scheduler": GroupChoice("static", {})})
    with pytest.raises(ConfigError, match="continuous scheduler"):
        serving_quality(static, _settings(restricted))


def test_plain_reference_is_the_model_untouched(setup) -> None:
    """The plain model after a serve is the plain model before (the engine restores it)."""
    loaded, prompts, *_ = setup
    ids = torch.tensor([list(prompts[0].input_ids)])
    with torch.no_grad():
        before = loaded.model(input_ids=ids).logits
    ctx, restricted = _ctx(setup, "emoe", 0.25)
    serving_quality(ctx, _settings(restricted, modes=("teacher_forced",), num_requests=1))
    with torch.no_grad():
        after = loaded.model(input_ids=ids).logits
    assert torch.equal(before, after)


@pytest.fixture(scope="module")
def tiny_point(loaded, prompts):  # type: ignore[no-untyped-def]
    """The shipped tiny model (it has a tokenizer: lm-eval's documents need one) with its
    ShareGPT sample's trace: ``make(system, capacity, cost=None)`` -> (ctx, restricted)."""
    from moeexp.traces.recorder import record_trace

    trace = record_trace(loaded, prompts, sampling="greedy", spec_depth=2, record_hidden=False,
                         prompt_embedder=None, progress=False)
    store, test = trace.split("store"), trace.split("test")
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), trace.dims)

    def make(system: str, capacity: float, cost_model=None):  # type: ignore[no-untyped-def]
        pcfg, ccfg, st = resolve_system(system, {"experts_per_layer": 2, "period": 1}
                                        if system == "emoe" else None,
                                        {"capacity": capacity}, model={"prefetch_distance": 1})
        pred, pol = build_predictor(pcfg, store.dims), build_cache(ccfg, store.dims)
        pred.fit(store)
        pol.fit(store)
        ctx = BackendContext(loaded=loaded, prompts=[p for p in prompts if p.split == "test"],
                             trace=test, predictor=pred, cache=pol, cost=cost_model or cost,
                             seed=0, store=store, scheduler=GroupChoice("fcfs", {}))
        return ctx, bool(st.get("restricted_routing", False))

    return make, trace


LM_TASKS = ("moeexp_sharegpt_ppl", "moeexp_sharegpt_reply")


def test_lm_eval_at_the_operating_point(tiny_point, dataset_cfg, tmp_path, monkeypatch) -> None:
    """lm_eval_tasks: lm-eval's local tasks scored by a static engine cycling the simulated
    point's residency (``lm_eval_residency`` = simulator_cycle, one cycle entry per
    simulated pass): eMoE at 2 of 16 experts substitutes while scoring; on a link so slow
    that no simulated copy ever lands every cycled set is empty, so every routed choice of
    lm-eval's passes drops (the residency is the simulator's, not this engine's copies)."""
    monkeypatch.setenv("MOEEXP_RESULTS", str(tmp_path))  # the local tasks' cache
    make, trace = tiny_point
    ctx, restricted = make("emoe", 0.125)
    assert restricted
    st = _settings(restricted, modes=("teacher_forced",), lm_eval_tasks=list(LM_TASKS),
                   lm_eval_limit=2, lm_eval_dataset=dataset_cfg)
    m = serving_quality(ctx, st).metrics
    assert m["lm_eval_residency"] == "simulator_cycle" and m["lm_eval_cycle_passes"] >= 1
    assert m["lm_eval/moeexp_sharegpt_ppl/bits_per_byte"] > 0
    assert 0.0 <= m["lm_eval/moeexp_sharegpt_reply/acc"] <= 1.0
    assert m["lm_eval/engine/substitution_rate"] > 0
    assert m["lm_eval/engine/dropped_rate"] < 1.0
    assert list((tmp_path / "eval_task_cache").iterdir())
    slow = CostModel.from_profile(dataclasses.replace(load_profile("rtx3090_pcie4"),
                                                      h2d_gbps=1e-9), trace.dims)
    sctx, _ = make("emoe", 0.125, slow)
    s = serving_quality(sctx, st).metrics
    assert s["sim_routing_dropped_rate"] == 1.0 and s["lm_eval/engine/dropped_rate"] == 1.0


@pytest.mark.parametrize("bad, match", [
    ({"restricted_routing": False}, "exact system"),
    ({"residency": "engine"}, "residency=engine"),
    ({"lm_eval_tasks": ["moeexp_sharegpt_nope"]}, "unknown local task"),
    ({"lm_eval_limit": 0}, "lm_eval_limit=0")])
def test_lm_eval_settings_refused(bad, match) -> None:  # type: ignore[no-untyped-def]
    """lm-eval at an operating point needs a lossy system under the simulator's residency
    (an exact system's numbers are the plain model's: eval=lm_eval); unknown local task
    names and a non-positive limit fail when the settings are built (before any work)."""
    kw = {"restricted_routing": True, "lm_eval_tasks": ["moeexp_sharegpt_ppl"], **bad}
    with pytest.raises(ConfigError, match=match):
        _settings(**kw)
    assert _settings(True).lm_eval_tasks == ()  # off by default


def test_lm_eval_unknown_task_refused_before_the_simulator(tiny_point, dataset_cfg, tmp_path,
                                                           monkeypatch) -> None:
    """A task name neither local nor lm-eval's fails in lm_eval_plan, which
    serving_quality runs before its simulator step (lm-eval's own index is searched)."""
    from moeexp.eval.serving_quality import lm_eval_plan

    monkeypatch.setenv("MOEEXP_RESULTS", str(tmp_path))
    make, _ = tiny_point
    ctx, restricted = make("emoe", 0.125)
    st = _settings(restricted, lm_eval_tasks=["moeexp_sharegpt_ppl", "no_such_task_xyz"],
                   lm_eval_dataset=dataset_cfg)
    with pytest.raises(ConfigError, match="no_such_task_xyz"):
        lm_eval_plan(ctx, st)
