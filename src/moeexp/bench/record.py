"""Benchmark: trace recording time against plain ``model.generate`` of the same tokens.

Both sides run the same prompts (FineMoE's ShareGPT lengths: 43 prompt tokens, 122 output
tokens), the same sampling (seeded top-k 50, temperature 1, EOS suppressed so every request
generates exactly ``output_len`` tokens) and a KV cache, batch size 1. Recording uses the
default trace settings (spec_depth 4, no hidden states); the one-off MiniLM prompt
embedding is excluded (it is per trace, not per token). Each side runs ``repeats`` times
after a warm-up, alternating; the ratio compares the best (minimum) times, as ``timeit``
does, because on a shared machine the other runs mostly measure other processes' load; the
ratio of medians is reported too. Torch runs single-threaded
during the measurement: on a shared CPU, multi-threaded kernels of a tiny model mostly
measure contention (10x swings), and both sides get the same setting.

Model: the embedded ``model=tiny`` when its asset exists, else a random-weight Mixtral of
the same shape (8 layers, 16 experts, top-2, hidden 64; ``moeexp.models.tiny.train.build_config``).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

log = logging.getLogger(__name__)

TARGET_RATIO = 1.25


def _load() -> tuple[Any, str]:
    from moeexp.models.loading import LoadedModel, load_model, tiny_asset_dir

    if (tiny_asset_dir() / "config.json").is_file():
        return load_model({"name": "tiny"}), "tiny (embedded, trained)"
    import torch
    from transformers import AutoModelForCausalLM

    from moeexp.models.adapters import adapter_for
    from moeexp.models.tiny.train import TrainConfig, build_config

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(TrainConfig()), dtype=torch.float32)
    torch.random.set_rng_state(state)
    model.eval()
    loaded = LoadedModel(model=model, tokenizer=None, adapter=adapter_for(model),
                         name="tiny-shape-random", source="random")
    return loaded, "random weights, tiny shape (asset missing)"


def run(num_prompts: int = 3, input_len: int = 43, output_len: int = 122,
        repeats: int = 3, threads: int = 1) -> dict[str, Any]:
    """Measure recording vs ``generate``; returns the numbers (seconds, ratio, tokens/s)."""
    import numpy as np
    import torch

    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    loaded, which = _load()
    model = loaded.model
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    prompts = [Prompt(request_id=i, text=f"bench {i}",
                      input_ids=tuple(int(x) for x in rng.integers(3, vocab, input_len)),
                      prompt_len=input_len, output_len=output_len, split="test",
                      dataset="bench") for i in range(num_prompts)]

    def generate() -> None:
        for p in prompts:
            ids = torch.tensor([p.input_ids])
            torch.manual_seed(p.request_id)
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=50,
                           temperature=1.0, max_new_tokens=output_len,
                           min_new_tokens=output_len)

    def record() -> None:
        record_trace(loaded, prompts, sampling="top_k", top_k=50, temperature=1.0,
                     spec_depth=4, record_hidden=False, seed=0, prompt_embedder=None,
                     progress=False)

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {"generate": [], "record": []}
    try:
        with torch.inference_mode():
            generate()  # warm-up
            record()
            for _ in range(repeats):
                for name, fn in (("generate", generate), ("record", record)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old_threads)
    gen_s, rec_s = min(times["generate"]), min(times["record"])
    tokens = num_prompts * output_len
    ratio = rec_s / gen_s
    result = {
        "record_over_generate_ratio": round(ratio, 3),
        "record_over_generate_ratio_median": round(
            statistics.median(times["record"]) / statistics.median(times["generate"]), 3),
        "target_ratio": TARGET_RATIO,
        "within_target": bool(ratio <= TARGET_RATIO),
        "record_s": round(rec_s, 4),
        "generate_s": round(gen_s, 4),
        "record_s_all": [round(t, 4) for t in times["record"]],
        "generate_s_all": [round(t, 4) for t in times["generate"]],
        "record_tokens_per_s": round(tokens / rec_s, 1),
        "generate_tokens_per_s": round(tokens / gen_s, 1),
        "generated_tokens": tokens,
        "iterations": num_prompts * output_len,
        "prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "threads": threads,
        "model": which,
        "num_moe_layers": loaded.adapter.num_layers,
        "num_experts": loaded.adapter.num_experts,
    }
    log.info("record vs generate: %s", result)
    return result


if __name__ == "__main__":  # pragma: no cover
    import json

    logging.basicConfig(level=logging.INFO)
    print(json.dumps(run(), indent=2))  # noqa: T201 - a CLI entry point
