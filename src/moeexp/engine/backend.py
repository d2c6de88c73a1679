"""``backend=engine``: serve the test prompts through the real engine (for the app pipeline).

::

    metrics = run_engine_backend(loaded, prompts, predictor, cache, settings)

``predictor`` and ``cache`` are built and fitted by the pipeline on the store split (the same
objects it would hand to the simulator; ``cache.capacity_slots`` is the budget). Each test
prompt is one request, batch size 1, decoded with ``generate`` for exactly its
``output_len`` tokens (EOS suppressed through ``min_new_tokens``, as the recorder does):
greedy, or seeded top-k sampling (``torch.manual_seed(seed + request_id)`` around the call,
the global RNG state restored afterwards). ``settings`` is the backend config group: keys
of :class:`~moeexp.engine.runtime.EngineSettings` plus ``sampling`` (``greedy`` |
``top_k``), ``top_k``, ``temperature``, ``seed``, ``warmup`` (untimed requests served
first, through a separate engine, to warm the kernels; default 1) and ``progress``;
other keys (e.g. the simulator's ``batch_size``) are ignored with a debug message.
Returns the engine's metric dict (``moeexp.metrics.CORE_KEYS`` + extras).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moeexp.engine.budget import Budget
from moeexp.engine.build import build_offloaded, model_dims
from moeexp.engine.runtime import EngineSettings
from moeexp.errors import ConfigError
from moeexp.traces.schema import RequestMeta

log = logging.getLogger(__name__)

_DECODE_KEYS = {"sampling", "top_k", "temperature", "seed", "warmup", "progress"}


def _generate_kwargs(settings: Mapping[str, Any], output_len: int) -> dict[str, Any]:
    sampling = settings.get("sampling", "greedy")
    kw: dict[str, Any] = {"max_new_tokens": output_len, "min_new_tokens": output_len}
    if sampling == "greedy":
        kw["do_sample"] = False
    elif sampling == "top_k":
        kw.update(do_sample=True, top_k=int(settings.get("top_k", 50)),
                  temperature=float(settings.get("temperature", 1.0)))
    else:
        raise ConfigError(f"backend=engine: sampling must be 'greedy' or 'top_k', got {sampling!r}")
    return kw


def run_engine_backend(loaded: Any, prompts: Sequence[Any], predictor: Any, cache: Any,
                       settings: Mapping[str, Any]) -> dict[str, float]:
    """Serve ``prompts`` (moeexp.data.prompts.Prompt, test split) through the engine.

    Args:
        loaded: LoadedModel (model, tokenizer, adapter, name).
        prompts: the test prompts (``input_ids``, ``output_len``, ``request_id``, ...).
        predictor / cache: fitted decision objects (the simulator's classes).
        settings: the backend config group (see the module docstring).
    """
    known = {f.name for f in fields(EngineSettings)}
    ignored = sorted(set(settings) - known - _DECODE_KEYS - {"name"})
    if ignored:
        log.debug("backend=engine ignores %s", ignored)
    eng_settings = EngineSettings(**{k: settings[k] for k in known if k in settings})
    adapter = loaded.adapter
    model = loaded.model
    dims = model_dims(adapter, eng_settings.spec_depth)
    budget = Budget(slots=int(cache.capacity_slots), expert_bytes=dims.expert_bytes,
                    total_expert_bytes=dims.num_layers * dims.num_experts * dims.expert_bytes)
    embeds = None
    if "prompt_embed" in predictor.needs:
        from moeexp.data.embed import embed_prompts

        embeds = embed_prompts([p.text for p in prompts])
    seed = int(settings.get("seed", 0))
    device = next(model.parameters()).device
    _warmup(loaded, prompts, budget, eng_settings, settings)
    om = build_offloaded(model, adapter, predictor, cache, budget, eng_settings, system="engine")
    try:
        bar = tqdm(prompts, desc="engine", unit="req", disable=not settings.get("progress", True))
        for i, p in enumerate(bar):
            ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=device)
            meta = RequestMeta(request_id=int(p.request_id), prompt=p.text,
                               prompt_len=int(p.prompt_len), output_len=int(p.output_len),
                               split=p.split, dataset=p.dataset, task=getattr(p, "task", ""))
            kw = _generate_kwargs(settings, int(p.output_len))
            emb = None if embeds is None else np.asarray(embeds[i : i + 1])
            state = torch.random.get_rng_state()
            try:
                torch.manual_seed(seed + int(p.request_id))
                om.generate(ids, request_meta=[meta], prompt_embed=emb, **kw)
            finally:
                torch.random.set_rng_state(state)
        return om.metrics()
    finally:
        om.close()


def _warmup(loaded: Any, prompts: Sequence[Any], budget: Budget, settings: EngineSettings,
            raw: Mapping[str, Any]) -> None:
    """Untimed requests through a throwaway deepspeed-like engine (kernels, allocator)."""
    n = int(raw.get("warmup", 1))
    if n <= 0 or not prompts:
        return
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS

    dims = model_dims(loaded.adapter, settings.spec_depth)
    pred = PREDICTORS.build("none", dims=dims)
    pol = CACHES.build("lru", capacity_slots=budget.slots, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    device = next(loaded.model.parameters()).device
    plain = replace(settings, restricted_routing=False, predictor_async=False)
    with build_offloaded(loaded.model, loaded.adapter, pred, pol, budget, plain,
                         system="warmup") as om:
        for p in prompts[:n]:
            ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=device)
            om.generate(ids, max_new_tokens=min(4, int(p.output_len)), do_sample=False)
