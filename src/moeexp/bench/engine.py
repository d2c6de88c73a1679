"""Benchmark: the offloading engine against plain ``generate`` (ratios within one run).

1. **Overhead**: every expert resident (``no_offload``: the ``resident`` cache, preloaded)
   against plain ``model.generate`` of the same greedy tokens; target ratio <= 1.10.
2. **Capacity 50 %** with ``deepspeed`` and ``finemoe`` (expert maps fitted on a store of
   held-out-style random prompts): time per output token and hit rate, over the real
   memcpy and over an emulated host-to-device link (``bandwidth_bps``, an emulation that
   makes copy time visible on a CPU; see :mod:`moeexp.engine.transfer`).
3. **CUDA only**: (a) 1 and 2 again with the tiny model on the GPU (keys ``cuda_*``);
   (b) ``no_offload``/``deepspeed``/``finemoe`` at capacity 50 % on a random-weight
   Mixtral-shaped model with 21 MiB bf16 experts (keys ``cuda_big_*``), where copies cost
   real PCIe time; (c) achieved host-to-device bandwidth of the engine's copy thread (every
   expert loaded on demand, back to back, from pinned memory) against one plain pinned
   ``copy_`` of the same bytes; target >= 0.8. Skipped (reported as such) without CUDA.

Model: the embedded ``model=tiny`` when its asset exists, else a random-weight Mixtral of
the same shape. Each timed side runs ``repeats`` times after a warm-up, alternating, and
medians are compared; torch is single-threaded while measuring (as ``bench/record.py``).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

log = logging.getLogger(__name__)

TARGET_OVERHEAD = 1.10
TARGET_BANDWIDTH = 0.8


def _prompts(vocab: int, n: int, input_len: int, seed: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, input_len).tolist() for _ in range(n)]


def _store(loaded: Any, vocab: int) -> Any:
    import types

    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import record_trace

    ps = [Prompt(request_id=i, text="", input_ids=tuple(ids), prompt_len=len(ids), output_len=16,
                 split="store", dataset="bench")
          for i, ids in enumerate(_prompts(vocab, 8, 43, seed=7))]
    view = types.SimpleNamespace(model=loaded.model, tokenizer=None, adapter=loaded.adapter,
                                 name=loaded.name)
    return record_trace(view, ps, sampling="top_k", spec_depth=4, prompt_embedder=None,
                        progress=False)


def _time_generate(generate: Any, device: Any, prompts: list[list[int]], new: int) -> float:
    """Seconds for greedy ``new`` tokens after each prompt through ``generate`` (a model's
    or an offloaded model's), the device synchronised at both ends."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                 min_new_tokens=new)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _time_plain(model: Any, prompts: list[list[int]], new: int) -> float:
    return _time_generate(model.generate, next(model.parameters()).device, prompts, new)


def _time_engine(om: Any, prompts: list[list[int]], new: int) -> float:
    return _time_generate(om.generate, om.engine.device, prompts, new)


def _overhead(model: Any, prompts: list[list[int]], new: int, repeats: int) -> dict[str, Any]:
    from moeexp.engine import offload

    with offload(model, system="no_offload") as om:  # warm-up of both paths
        _time_engine(om, prompts[:1], 4)
    _time_plain(model, prompts[:1], 4)
    plain, eng = [], []
    hit = float("nan")
    for _ in range(repeats):
        with offload(model, system="no_offload") as om:
            eng.append(_time_engine(om, prompts, new))
            hit = om.metrics()["hit_rate"]
        plain.append(_time_plain(model, prompts, new))
    ratio = statistics.median(eng) / statistics.median(plain)
    return {"overhead_ratio": round(ratio, 4), "target_overhead": TARGET_OVERHEAD,
            "overhead_within_target": bool(ratio <= TARGET_OVERHEAD),
            "plain_s": round(statistics.median(plain), 4),
            "engine_resident_s": round(statistics.median(eng), 4), "resident_hit_rate": hit}


def _systems(model: Any, prompts: list[list[int]], new: int, store: Any,
             bandwidth: float | None, systems: tuple[str, ...] = ("deepspeed", "finemoe"),
             prefix: str = "") -> dict[str, Any]:
    from moeexp.engine import offload

    out: dict[str, Any] = {}
    for system in systems:
        kw: dict[str, Any] = {"bandwidth_bps": bandwidth} if bandwidth else {}
        cap = 1.0 if system == "no_offload" else 0.5  # no_offload keeps every expert
        with offload(model, system=system, capacity=cap, store=store, **kw) as om:
            _time_engine(om, prompts[:1], min(new, 16))  # warm-up (a first request too)
            om.reset_metrics()  # measure the timed requests only
            _time_engine(om, prompts, new)
            m = om.metrics()
        tag = f"{prefix}{system}_{'emulated' if bandwidth else 'memcpy'}"
        out[f"{tag}_tpot_ms"] = round(m["tpot_ms_mean"], 3)
        out[f"{tag}_ttft_ms"] = round(m["ttft_ms_mean"], 3)
        out[f"{tag}_hit_rate"] = round(m["hit_rate"], 4)
        out[f"{tag}_stall_ms"] = round(m["stall_ms_total"], 2)
        out[f"{tag}_recall"] = round(m["prediction_recall"], 4)
        out[f"{tag}_prefetches"] = m["prefetches_issued"]
        out[f"{tag}_predictor_query_us"] = round(m["predictor_query_us_mean"], 1)
    return out


def _cuda_tiny(loaded: Any, prompts: list[list[int]], new: int, repeats: int,
               device: str = "cuda") -> dict[str, Any]:
    """The tiny model on CUDA: the same overhead and capacity-50 % measurements as on the
    CPU (keys prefixed ``cuda_``). Its experts are 96 KiB, so a copy costs microseconds and
    what remains is the engine's per-layer host work against very short kernels."""
    model = loaded.model.to(device)
    try:
        out = {f"cuda_{k}": v for k, v in _overhead(model, prompts, new, repeats).items()}
        store = _store(loaded, int(model.config.vocab_size))
        out.update(_systems(model, prompts, new, store, None, prefix="cuda_"))
    finally:
        loaded.model.to("cpu")
    return out


def _cuda_big_experts(new: int = 32, num_prompts: int = 3, device: str = "cuda") -> dict[str, Any]:
    """A random-weight Mixtral-shaped model with big experts (bf16, hidden 1024,
    intermediate 3584: 21 MiB per expert, 4 layers x 8 experts) on CUDA at capacity 50 %:
    TPOT of ``no_offload``, ``deepspeed`` and ``finemoe`` (store recorded from the same
    model on other random prompts), where expert copies cost real PCIe time."""
    import types

    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moeexp.models.adapters import adapter_for

    cfg = MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                        num_experts_per_tok=2, vocab_size=1024)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().to(device)
    torch.random.set_rng_state(state)
    loaded = types.SimpleNamespace(model=model, adapter=adapter_for(model), name="mixtral-big-random")
    prompts = _prompts(1024, num_prompts, 43, seed=0)
    store = _store(loaded, 1024)
    _time_plain(model, prompts[:1], new)  # warm-up: kernels, allocator, clocks
    plain = _time_plain(model, prompts, new)
    out = {"cuda_big_plain_ms_per_token": round(plain / (num_prompts * new) * 1e3, 3)}
    out |= _systems(model, prompts, new, store, None, systems=("no_offload", "deepspeed", "finemoe"),
                   prefix="cuda_big_")
    out["cuda_big_expert_mib"] = round(loaded.adapter.expert_bytes() / 2**20, 2)
    return out


def _cuda_bandwidth(repeats: int = 3) -> dict[str, Any]:
    """Engine copy thread vs one plain pinned copy, on a Mixtral-like layer of big experts."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moeexp.engine import offload

    cfg = MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                        num_experts_per_tok=2, vocab_size=1024)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().to("cuda")
    with offload(model, system="deepspeed", capacity=1.0) as om:
        eng = om.engine
        keys = [(layer, e) for layer in range(eng.L) for e in range(eng.J)]
        nbytes = len(keys) * eng.spec.nbytes
        engine_s = []
        for _ in range(repeats + 1):  # the first round warms the copy stream up
            with eng.lock:
                for k in list(eng.pool.slot_of):
                    eng._evict(k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.preload(keys)  # every expert as a demand copy, back to back, then drain
            torch.cuda.synchronize()
            engine_s.append(time.perf_counter() - t0)
        engine_s = engine_s[1:]
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    plain_s = []
    dst.copy_(src, non_blocking=True)  # warm-up
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        plain_s.append(time.perf_counter() - t0)
    e_bw, p_bw = nbytes / min(engine_s), nbytes / min(plain_s)
    return {"h2d_engine_gbps": round(e_bw / 1e9, 2), "h2d_plain_gbps": round(p_bw / 1e9, 2),
            "h2d_ratio": round(e_bw / p_bw, 3), "target_h2d_ratio": TARGET_BANDWIDTH,
            "h2d_within_target": bool(e_bw / p_bw >= TARGET_BANDWIDTH), "h2d_bytes": nbytes}


def run(num_prompts: int = 3, input_len: int = 43, output_len: int = 32, repeats: int = 5,
        threads: int = 1, emulated_gbps: float = 0.5) -> dict[str, Any]:
    """All three measurements; returns a flat dict of numbers (see the module docstring)."""
    import torch

    from moeexp.bench.record import _load

    loaded, which = _load()
    model = loaded.model
    vocab = int(model.config.vocab_size)
    prompts = _prompts(vocab, num_prompts, input_len, seed=0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, Any] = {"model": which, "prompts": num_prompts, "input_len": input_len,
                              "output_len": output_len, "repeats": repeats, "threads": threads}
    try:
        with torch.inference_mode():
            result.update(_overhead(model, prompts, output_len, repeats))
            store = _store(loaded, vocab)
            result.update(_systems(model, prompts, output_len, store, None))
            result.update(_systems(model, prompts, output_len, store, emulated_gbps * 1e9))
            result["emulated_link_gbps"] = emulated_gbps
    finally:
        torch.set_num_threads(old)
    if torch.cuda.is_available():
        with torch.inference_mode():
            result.update(_cuda_tiny(loaded, prompts, output_len, repeats))
            result.update(_cuda_big_experts(output_len))
        result.update(_cuda_bandwidth())
    else:
        result["h2d_ratio"] = "skipped: no CUDA device"
    log.info("engine bench: %s", result)
    return result


if __name__ == "__main__":  # pragma: no cover
    import json

    logging.basicConfig(level=logging.INFO)
    print(json.dumps(run(), indent=2))  # noqa: T201 - a CLI entry point
