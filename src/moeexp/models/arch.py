"""A model's cost dims from its architecture alone: no checkpoint, no download.

A ``model`` preset may carry an ``arch:`` block: the numbers of the model's hub
``config.json`` that shape it (``model_type`` plus the config keys). :func:`arch_dims`
builds that config with transformers, instantiates the model on the **meta device** (no
memory, no weights) and reads the :class:`~moeexp.traces.schema.TraceDims` the recorder
would give (expert bytes from the real tensor shapes, dense bytes from every other
parameter). This is how a trace imported from elsewhere (``trace.source``) gets the real
model's bytes and compute, e.g. gpt-oss-20b: 24 MoE layers, 32 experts, top-4, hidden
2880, expert intermediate 2880, 20.9 B parameters, 49.8 MB per expert in bf16.

``expert_format`` says how the offloaded experts are held:

- ``dense``: in the model's ``dtype`` (what the engine moves: MXFP4 checkpoints are
  dequantised on load);
- ``mxfp4``: as gpt-oss stores them, 4.25 bits per weight of the expert matrices (4-bit
  values plus one 8-bit scale per 32), biases in bf16: 13.2 MB per gpt-oss-20b expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

ExpertFormat = Literal["dense", "mxfp4"]
EXPERT_FORMATS: tuple[str, ...] = ("dense", "mxfp4")
#: Bits per weight of an MXFP4 block: 32 four-bit values share one 8-bit scale.
MXFP4_BITS = 4 + 8 / 32


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

    if expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"{where}: expert_format={expert_format!r}; valid: "
                          f"{', '.join(EXPERT_FORMATS)}")
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
    if expert_format == "mxfp4":
        dims = replace(dims, expert_bytes=_mxfp4_expert_bytes(adapter))
    return dims


def _mxfp4_expert_bytes(adapter: Any) -> int:
    """Bytes of one routed expert held as MXFP4: matrices at 4.25 bits, vectors in bf16."""
    experts = adapter.moe_layers()[0].experts
    total = 0.0
    for name in adapter.expert_tensor_names:
        p = getattr(experts, name)
        n = p.numel() // p.shape[0]
        total += n * MXFP4_BITS / 8 if p.dim() >= 3 else n * 2
    return int(round(total))
