"""A model's cost dims from its architecture alone: no checkpoint, no download.

A ``model`` preset may carry an ``arch:`` block: the numbers of the model's hub
``config.json`` that shape it (``model_type`` plus the config keys). :func:`arch_dims`
builds that config with transformers, instantiates the model on the **meta device** (no
memory, no weights) and reads the :class:`~moeexp.traces.schema.TraceDims` the recorder
would give (expert bytes from the real tensor shapes, dense bytes from every other
parameter). This is how a trace imported from elsewhere (``trace.source``) gets the real
model's bytes and compute, e.g. gpt-oss-20b: 24 MoE layers, 32 experts, top-4, hidden
2880, expert intermediate 2880, 20.9 B parameters, 49.8 MB per expert in bf16.

``expert_format`` says how the offloaded experts are held (:mod:`moeexp.costmodel.formats`:
bits, group sizes and sources of every format):

- ``dense``: in the model's ``dtype`` (what the engine moves: MXFP4 checkpoints are
  dequantised on load);
- ``mxfp4``: as gpt-oss stores them, 4.25 bits per weight of the expert matrices (4-bit
  values plus one 8-bit scale per 32), biases in bf16: 13.2 MB per gpt-oss-20b expert;
- ``int8``, ``int4``, ``hqq3``, ``hqq2``: quantised matrices (scales and zero points
  included), vectors in the model's dtype. A format whose group does not divide the
  expert matrices is refused naming the formats the model can take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from moeexp.costmodel.formats import check_format_fits, format_spec, matrix_bytes
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims


def arch_dims(arch: Mapping[str, Any], *, dtype: str = "bfloat16",
              expert_format: str = "dense", spec_depth: int = 0,
              where: str = "model") -> TraceDims:
    """TraceDims of the model ``arch`` describes (see the module docstring).

    Raises:
        ConfigError: no ``model_type``, an unsupported one, keys transformers refuses, or
            an unknown ``expert_format``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moeexp.models.adapters import adapter_for, supported_model_types
    from moeexp.models.loading import _torch_dtype
    from moeexp.traces.recorder import trace_dims

    format_spec(expert_format, where)
    spec = dict(arch)
    model_type = spec.pop("model_type", None)
    if model_type not in supported_model_types():
        raise ConfigError(f"{where}: arch.model_type={model_type!r}; supported: "
                          f"{', '.join(supported_model_types())}")
    torch_dtype = _torch_dtype(dtype)
    if torch_dtype == "auto":
        torch_dtype = torch.bfloat16
    try:
        config = AutoConfig.for_model(model_type, **spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: arch does not build a {model_type} model: {exc}") from exc
    adapter = adapter_for(model)
    dims = trace_dims(adapter, spec_depth)
    if expert_format != "dense":
        dense_bits = 8 * torch.empty((), dtype=torch_dtype).element_size()
        dims = replace(dims, expert_bytes=format_expert_bytes(adapter, expert_format,
                                                               dense_bits, where))
    return dims


def format_expert_bytes(adapter: Any, fmt: str, dense_bits: int, where: str) -> int:
    """Bytes of one routed expert held in ``fmt``: matrices at the format's bits (scales
    included), vectors in the model's dtype. Raises ConfigError if the model cannot take it."""
    experts = adapter.moe_layers()[0].experts
    tensors = [getattr(experts, name) for name in adapter.expert_tensor_names]
    check_format_fits(fmt, [tuple(p.shape[1:]) for p in tensors if p.dim() >= 3], where)
    total = 0.0
    for p in tensors:
        n = p.numel() // p.shape[0]
        total += (matrix_bytes(fmt, tuple(p.shape[1:]), dense_bits) if p.dim() >= 3
                  else n * dense_bits / 8)
    return int(round(total))


def held_dims(adapter: Any, dims: TraceDims, fmt: str, where: str) -> TraceDims:
    """``dims`` with ``expert_bytes`` of one of ``adapter``'s experts held in ``fmt`` (at the
    expert tensors' own element size): what a cache capacity given in bytes buys slots of.
    ``dense``: ``dims`` unchanged. Raises ConfigError if the model cannot take ``fmt``."""
    if fmt == "dense":
        return dims
    experts = adapter.moe_layers()[0].experts
    bits = 8 * getattr(experts, adapter.expert_tensor_names[0]).element_size()
    return replace(dims, expert_bytes=format_expert_bytes(adapter, fmt, bits, where))
