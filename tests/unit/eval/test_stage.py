"""The app's eval stage on a small config: plain vs lossy, metrics names, config errors."""

from __future__ import annotations

import pytest

from moeexp.errors import ConfigError
from moeexp.eval.stage import EvalInputs, EvalSpec, eval_spec, run_eval


def _cfg(model_dir, tmp, *overrides):
    from hydra import compose, initialize_config_dir

    from moeexp.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", [
            f"model.path={model_dir}", "dataset.num_prompts=16", "dataset.input_len=16",
            "dataset.output_len=8", "trace.prompt_embedder=null", "trace.spec_depth=0",
            "trace.progress=false", f"trace.cache_dir={tmp}/traces", "logger=none",
            "eval=lm_eval", "eval.tasks=[moeexp_sharegpt_ppl]", "eval.limit=2",
            "eval.quality=true", "eval.quality_prompts=3", "eval.quality_max_tokens=48",
            "eval.quality_new_tokens=6", f"eval.tasks_dir={tmp}/tasks", *overrides])


def _inputs(cfg, loaded, prompts) -> EvalInputs:
    """What the pipeline hands the stage: typed groups, policies fitted on the store split."""
    import dataclasses

    from moeexp.cache import build_cache
    from moeexp.config import validate
    from moeexp.predictors import build_predictor
    from moeexp.traces.store import get_or_record

    spec = validate(cfg)
    store = get_or_record(loaded, prompts, dataclasses.asdict(spec.trace)).split("store")
    pred, pol = build_predictor(spec.predictor, store.dims), build_cache(spec.cache, store.dims)
    pred.fit(store)
    pol.fit(store)
    return EvalInputs(loaded=loaded, prompts=prompts, system=spec.system.name,
                      backend=spec.backend.kwargs, dataset=spec.dataset.to_mapping(),
                      predictor=pred, cache=pol)


def test_eval_spec_checks_keys_and_values():
    """A misspelled key names the accepted ones; bad values say what is valid; eval=none
    (and an absent group) is disabled."""
    with pytest.raises(ConfigError, match="limt.*did you mean 'limit'"):
        eval_spec({"name": "lm_eval", "limt": 3})
    with pytest.raises(ConfigError, match="limit=0"):
        eval_spec({"name": "lm_eval", "limit": 0})
    with pytest.raises(ConfigError, match="'none' or 'lm_eval'"):
        EvalSpec(name="lmeval")
    assert not eval_spec(None).enabled and not eval_spec({"name": "none"}).enabled
    assert eval_spec({"name": "lm_eval", "tasks": ["a"]}).tasks == ("a",)


def test_plain_system_quality_is_perfect(model_dir, loaded, prompts, tmp_path):
    """no_offload evaluates the plain model: perplexity == perplexity_ref, token and greedy
    agreement 1, KL 0; the local task is built from the run's test split and scored."""
    cfg = _cfg(model_dir, tmp_path, "system=no_offload")
    m = run_eval(eval_spec(cfg.eval), _inputs(cfg, loaded, prompts))
    assert m["eval_model"] == "plain"
    assert m["perplexity"] == m["perplexity_ref"] and m["perplexity_ratio"] == 1.0
    assert m["token_agreement"] == 1.0 and m["greedy_agreement"] == 1.0
    assert m["kl_mean"] == 0.0
    assert m["lm_eval/moeexp_sharegpt_ppl/word_perplexity"] > 1.0
    assert list((tmp_path / "tasks").iterdir())  # the hashed task directory


def test_emoe_is_lossy_and_exact_system_is_not(model_dir, loaded, prompts, tmp_path):
    """emoe keeping 2 of 16 experts per layer (restricted routing from the system bundle):
    the engine substitutes experts, the perplexity moves away from the plain model's and
    agreement drops below 1; deepspeed at the same budget (exact) keeps perplexity within
    1e-4 and KL ~ 0. The model is plain afterwards."""
    lossy = _cfg(model_dir, tmp_path, "system=emoe", "cache.capacity=0.125",
                 "predictor.experts_per_layer=2", "predictor.period=1", "eval.tasks=[]")
    m = run_eval(eval_spec(lossy.eval), _inputs(lossy, loaded, prompts))
    assert m["eval_model"] == "engine" and m["experts_per_layer"] == 2
    assert m["quality_substitution_rate"] > 0
    assert abs(m["perplexity_ratio"] - 1) > 1e-3 and m["token_agreement"] < 1.0
    assert m["kl_mean"] > 0 and not any(k.startswith("lm_eval/") for k in m)
    exact = _cfg(model_dir, tmp_path, "system=deepspeed", "cache.capacity=0.125",
                 "eval.tasks=[]")
    e = run_eval(eval_spec(exact.eval), _inputs(exact, loaded, prompts))
    assert e["eval_model"] == "engine" and e["quality_hit_rate"] < 1.0
    assert abs(e["perplexity_ratio"] - 1) <= 1e-4 and e["kl_mean"] < 1e-6
    assert e["greedy_agreement"] == 1.0
    assert not str(loaded.model.config._experts_implementation).startswith("moeexp_offload")
