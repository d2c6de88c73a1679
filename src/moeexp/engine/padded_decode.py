"""A decode pass of several requests as ONE padded forward (``PassModel(batch_decode=True)``).

The default pass (:mod:`moeexp.engine.batch_pass`) runs each request's forward on its own
thread, so the dense part (attention, norms, shared experts, LM head) runs once per
request. A decode-only pass can instead stack the requests' KV caches into one batch::

    caches r = 1..B, lengths S_r     ->  keys/values [B, H, S_max, D], left-padded with 0
    attention_mask [B, S_max + 1]     0 on the padding, 1 on each row's context + new token
    position_ids [B, 1] = S_r         each row's own position (RoPE)
    one forward of input_ids [B, 1]   ->  logits [B, 1, V]; the new cache row r is
                                          keys[r, :, S_max - S_r:, :] (padding dropped)

Only the padded context positions differ from a request served alone; they are masked
out, so the result equals it up to floating-point rounding of the longer reductions (not
bit for bit: the tests check the tokens). Only caches whose every layer is a plain
``DynamicLayer`` are stacked (sliding-window or indexed layers: :func:`stackable` is
False and the pass runs per request). Stacking and unstacking copy every running
request's KV cache once each per pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _layers(cache: Any) -> list[Any] | None:
    return getattr(cache, "layers", None)


def stackable(caches: Sequence[Any]) -> bool:
    """Whether every cache is a DynamicCache of initialised plain ``DynamicLayer`` layers,
    all with the same number of layers."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    n = None
    for c in caches:
        layers = _layers(c)
        if type(c) is not DynamicCache or not layers:
            return False
        if any(type(layer) is not DynamicLayer or not isinstance(layer.keys, torch.Tensor)
               or layer.keys.dim() != 4 for layer in layers):
            return False
        if n is not None and len(layers) != n:
            return False
        n = len(layers)
    return n is not None


def stack(caches: Sequence[Any], config: Any) -> tuple[Any, list[int], torch.Tensor,
                                                       torch.Tensor]:
    """(batched DynamicCache, lengths S_r, attention_mask int64[B, S_max + 1], position_ids
    int64[B, 1]) of ``caches`` (each [1, H, S_r, D] per layer; :func:`stackable`)."""
    from transformers.cache_utils import DynamicCache

    lengths = [int(_layers(c)[0].keys.shape[-2]) for c in caches]  # type: ignore[index]
    s_max = max(lengths)
    batched = DynamicCache(config=config)
    n_layers = len(_layers(caches[0]))  # type: ignore[arg-type]
    for i in range(n_layers):
        ks, vs = [], []
        for c, s in zip(caches, lengths, strict=True):
            layer = _layers(c)[i]  # type: ignore[index]
            ks.append(torch.nn.functional.pad(layer.keys, (0, 0, s_max - s, 0)))
            vs.append(torch.nn.functional.pad(layer.values, (0, 0, s_max - s, 0)))
        batched.update(torch.cat(ks), torch.cat(vs), i)
    dev = _layers(caches[0])[0].keys.device  # type: ignore[index]
    mask = torch.zeros(len(caches), s_max + 1, dtype=torch.long, device=dev)
    for r, s in enumerate(lengths):
        mask[r, s_max - s:] = 1
    pos = torch.tensor([[s] for s in lengths], dtype=torch.long, device=dev)
    return batched, lengths, mask, pos


def unstack(batched: Any, lengths: Sequence[int], config: Any) -> list[Any]:
    """Per-row DynamicCaches of ``batched`` after one new token: row r keeps its last
    ``lengths[r] + 1`` positions (copies: the batched cache is freed)."""
    from transformers.cache_utils import DynamicCache

    out = [DynamicCache(config=config) for _ in lengths]
    for i, layer in enumerate(_layers(batched)):  # type: ignore[arg-type]
        total = int(layer.keys.shape[-2])
        for r, s in enumerate(lengths):
            a = total - (s + 1)
            out[r].update(layer.keys[r:r + 1, :, a:, :].clone(),
                          layer.values[r:r + 1, :, a:, :].clone(), i)
    return out
