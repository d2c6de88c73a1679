"""Benchmark: every system preset replaying FineMoE's offline protocol on a *recorded* trace
of Mixtral's routing shape.

Protocol (algorithms.md §9): 64 prompts of 43 tokens, 122 output tokens each, 70/30
store/test split (45 store, 19 test requests); batch size 1; a 25 % expert cache; the
``rtx3090_pcie4`` profile. The trace is recorded (:func:`moeexp.traces.recorder.record_trace`,
seeded top-k sampling, speculative gates to depth 4, hidden states for ``learned_mlp``)
from a **random-weight** ``MixtralConfig`` model with Mixtral-8x7B's routing shape (32 MoE
layers, 8 experts, top-2) but a small hidden size (32), so the recording costs minutes, not
hours; prompts are random token ids (the model has no tokenizer). The recording is cached
by content hash in ``results/traces`` (:func:`moeexp.traces.store.get_or_record`), so only
the first run pays for it (``record_s``, ``trace_reused``). The cost model uses
Mixtral-8x7B's real sizes (:func:`moeexp.bench.simulator.mixtral_dims`), since the
recorded model's own experts are tiny.

Each preset of ``conf/system`` is composed with Hydra (``model=mixtral_8x7b`` for its
prefetch distance 3, ``cache.capacity=0.25``), fitted on the store split (``fit_s``, apart)
and replayed once on the test split with BLAS limited to one thread (threadpoolctl: an
oversubscribed BLAS is 15-30x slower on a shared CPU). Reported per system: ``wall_s``,
``accesses_per_s``, hit rate, prediction recall, normalised TPOT. Target: each replay at
most ~10 s (``within_target``). A preset that fails is reported with its error, not fatal.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TARGET_S = 10.0
#: The recorded model: Mixtral-8x7B's routing shape, a small hidden size.
SHAPE: dict[str, int] = {"num_layers": 32, "num_experts": 8, "top_k": 2, "hidden_size": 32,
                         "intermediate_size": 64, "vocab_size": 512}


def random_mixtral(seed: int = 0) -> Any:
    """A random-weight ``MixtralForCausalLM`` of :data:`SHAPE` wrapped as a ``LoadedModel``."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moeexp.models.adapters import adapter_for
    from moeexp.models.loading import LoadedModel

    cfg = MixtralConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"], num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=2, num_key_value_heads=2, head_dim=SHAPE["hidden_size"] // 2,
        max_position_embeddings=256, num_local_experts=SHAPE["num_experts"],
        num_experts_per_tok=SHAPE["top_k"], tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, output_router_logits=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    torch.random.set_rng_state(state)
    return LoadedModel(model=model, tokenizer=None, adapter=adapter_for(model),
                       name="mixtral-shape-random", source="random")


def protocol_prompts(num_prompts: int, prompt_len: int, output_len: int,
                     store_fraction: float = 0.7, seed: int = 0) -> list[Any]:
    """Seeded random-token prompts (bos first); the first ``round(0.7 n)`` form the store."""
    import numpy as np

    from moeexp.data.prompts import Prompt

    rng = np.random.default_rng(seed)
    n_store = round(store_fraction * num_prompts)
    return [Prompt(request_id=i, text=f"bench prompt {i}",
                   input_ids=(1, *(int(x) for x in rng.integers(3, SHAPE["vocab_size"],
                                                                  prompt_len - 1))),
                   prompt_len=prompt_len, output_len=output_len,
                   split="store" if i < n_store else "test", dataset="bench")
            for i in range(num_prompts)]


def _presets(capacity: float) -> dict[str, Any]:
    """system name -> composed config of every preset in ``conf/system``."""
    from hydra import compose, initialize_config_dir

    from moeexp.paths import CONF_DIR

    names = sorted(p.stem for p in Path(CONF_DIR, "system").glob("*.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return {n: compose(config_name="config", overrides=[
            f"system={n}", "model=mixtral_8x7b", "logger=none", f"cache.capacity={capacity}"])
            for n in names}


def _replay_one(cfg: Any, trace: Any, dims: Any, cost: Any) -> dict[str, Any]:
    from threadpoolctl import threadpool_limits

    from moeexp.cache import build_cache
    from moeexp.predictors import build_predictor
    from moeexp.simulator import simulate

    store, test = trace.split("store"), trace.split("test")
    pred = build_predictor(cfg.predictor, trace.dims)
    if hasattr(pred, "progress"):
        pred.progress = False
    cache = build_cache(cfg.cache, dims)
    with threadpool_limits(limits=1):
        f0 = time.perf_counter()
        pred.fit(store)
        cache.fit(store)
        fit_s = time.perf_counter() - f0
        w0 = time.perf_counter()
        m = simulate(test, pred, cache, cost, batch_size=1, progress=False,
                     restricted_routing=bool(cfg.backend.get("restricted_routing", False))
                     ).metrics
        wall = time.perf_counter() - w0
    return {"wall_s": round(wall, 3), "accesses_per_s": round(m["accesses_total"] / wall, 1),
            "fit_s": round(fit_s, 3), "accesses_total": m["accesses_total"],
            "hit_rate": round(m["hit_rate"], 4),
            "prediction_recall": round(m["prediction_recall"], 4),
            "tpot_norm_mean": round(m["tpot_norm_mean"], 4), "within_target": wall <= TARGET_S}


def run(num_prompts: int = 64, prompt_len: int = 43, output_len: int = 122,
        capacity: float = 0.25, hardware: str = "rtx3090_pcie4",
        cache_dir: str | None = None) -> dict[str, Any]:
    """Record (or reuse) the trace, then fit and replay every preset; numbers per system."""
    import torch

    from moeexp.bench.simulator import mixtral_dims
    from moeexp.costmodel import CostModel, load_profile
    from moeexp.paths import results_dir
    from moeexp.traces.store import content_hash, get_or_record

    loaded = random_mixtral()
    prompts = protocol_prompts(num_prompts, prompt_len, output_len)
    settings = {"spec_depth": 4, "record_hidden": True, "prompt_embedder": None, "seed": 0,
                "cache_dir": cache_dir, "progress": False}
    root = Path(cache_dir) if cache_dir else results_dir() / "traces"
    reused = (root / f"{content_hash(loaded, prompts, settings)}.npz").is_file()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        trace = get_or_record(loaded, prompts, settings)
    finally:
        torch.set_num_threads(threads)
    record_s = time.perf_counter() - t0
    dims = mixtral_dims(trace.dims)
    cost = CostModel.from_profile(load_profile(hardware), dims, dtype_bytes=2)
    systems: dict[str, Any] = {}
    for name, cfg in _presets(capacity).items():
        try:
            systems[name] = _replay_one(cfg, trace, dims, cost)
        except Exception as e:  # noqa: BLE001 - one broken preset must not hide the others
            log.warning("system %s: %s: %s", name, type(e).__name__, e)
            systems[name] = {"error": f"{type(e).__name__}: {e}"}
        log.info("%s: %s", name, systems[name])
    walls = [s["wall_s"] for s in systems.values() if "wall_s" in s]
    return {
        "protocol": {"prompts": num_prompts, "test_requests": len(trace.split("test").requests),
                     "prompt_len": prompt_len, "output_len": output_len, "capacity": capacity,
                     "hardware": hardware, "target_s": TARGET_S, "blas_threads": 1,
                     "trace": "recorded from a random-weight MixtralConfig "
                              f"(L={SHAPE['num_layers']} J={SHAPE['num_experts']} "
                              f"K={SHAPE['top_k']} H={SHAPE['hidden_size']}); cost model: "
                              "Mixtral-8x7B dims",
                     "record_s": round(record_s, 2), "trace_reused": reused,
                     "trace_file": str(trace.meta.get("cache_path", ""))},
        "max_wall_s": max(walls) if walls else float("nan"),
        "all_within_target": bool(walls) and all(w <= TARGET_S for w in walls),
        "systems": systems,
    }


if __name__ == "__main__":  # pragma: no cover
    import json

    logging.basicConfig(level=logging.INFO)
    print(json.dumps(run(), indent=2))  # noqa: T201 - a CLI entry point
