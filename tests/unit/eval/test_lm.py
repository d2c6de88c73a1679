"""The lm-eval model: exact systems match lm-eval's own HF model; lossy ones differ."""

from __future__ import annotations

import math

import pytest

from moeexp.eval.lm import MoeexpLM, _split_overrides, _usable_device
from moeexp.eval.run import evaluate
from moeexp.eval.tasks import MC_TASK, PPL_TASK

PPL_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


@pytest.fixture(scope="module")
def hf_reference(model_dir, tasks_dir, one_thread) -> dict[str, float]:
    """lm-eval's own `--model hf` on the checkpoint (float32, the tiny preset's dtype)."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=1)
    return evaluate(hf, [PPL_TASK, MC_TASK], include_path=tasks_dir, limit=3)


def test_exact_system_matches_lm_eval_hf(loaded, tasks_dir, hf_reference):
    """deepspeed at capacity 0.5 through the engine (8 of 16 experts per layer resident,
    misses loaded on demand: exact): every perplexity metric and the multiple-choice
    accuracy equal HFLM's within a relative 1e-4; the engine really ran (misses > 0)."""
    lm = MoeexpLM(loaded=loaded, system="deepspeed", capacity=0.5, store=None)
    try:
        got = evaluate(lm, [PPL_TASK, MC_TASK], include_path=tasks_dir, limit=3)
        m = lm.engine_metrics()
    finally:
        lm.close()
    for k in PPL_METRICS:
        ref = hf_reference[f"lm_eval/{PPL_TASK}/{k}"]
        assert math.isfinite(ref) and abs(got[f"lm_eval/{PPL_TASK}/{k}"] / ref - 1) <= 1e-4, k
    assert got[f"lm_eval/{MC_TASK}/acc"] == hf_reference[f"lm_eval/{MC_TASK}/acc"]
    assert m["hit_rate"] < 1.0 and m["accesses_total"] > 0
    assert lm.offloaded is None and not str(loaded.model.config._experts_implementation
                                            ).startswith("moeexp_offload")


def test_lossy_emoe_changes_perplexity(loaded, tasks_dir, hf_reference, prompts):
    """eMoE keeping 2 of 16 experts per layer with restricted routing (store: the sample's
    store split): tokens are substituted (rate > 0) and the perplexity differs from the
    exact one; the model is plain again after close()."""
    from moeexp.traces.store import get_or_record

    store = get_or_record(loaded, prompts, {"prompt_embedder": None, "spec_depth": 0,
                                            "progress": False,
                                            "cache_dir": str(tasks_dir / "traces")})
    lm = MoeexpLM(loaded=loaded, system="emoe", capacity=0.125, store=store.split("store"),
                  **{"predictor.experts_per_layer": 2, "predictor.period": 1})
    try:
        got = evaluate(lm, [PPL_TASK], include_path=tasks_dir, limit=3)
        m = lm.engine_metrics()
    finally:
        lm.close()
    assert m["substitution_rate"] > 0
    ref = hf_reference[f"lm_eval/{PPL_TASK}/byte_perplexity"]
    assert abs(got[f"lm_eval/{PPL_TASK}/byte_perplexity"] / ref - 1) > 1e-3


def test_model_args_helpers():
    """lm-eval's CLI default device cuda:0 falls back to the CPU without CUDA;
    predictor./cache./dataset./trace. keys are split from engine settings and typed."""
    import torch

    assert _usable_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert _usable_device("cuda:0") == "cpu"
    groups, settings = _split_overrides({"predictor.period": "20", "cache.capacity": "0.5",
                                         "dataset.num_prompts": 16, "restricted_routing": True})
    assert groups == {"predictor": {"period": 20}, "cache": {"capacity": 0.5},
                      "dataset": {"num_prompts": 16}, "trace": {}}
    assert settings == {"restricted_routing": True}
