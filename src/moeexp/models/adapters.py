"""Concrete adapters over the transformers 5.x decoder MoE families, and :func:`adapter_for`.

Verified against the installed transformers 5.24 sources (``models/<arch>/modeling_*.py``):

==============  ===========  =============  =================================  ===========
model_type      router       J key          expert tensors (one expert)        shared
==============  ===========  =============  =================================  ===========
mixtral         mlp.gate     num_local_     gate_up (2I,H), down (H,I)          -
                             experts
qwen2_moe       mlp.gate     num_experts    same, I = moe_intermediate_size     shared_expert
                                                                                (+ sigmoid
                                                                                shared_expert_gate)
qwen3_moe       mlp.gate     num_experts    same, I = moe_intermediate_size     -
olmoe           mlp.gate     num_experts    same, I = intermediate_size         -
deepseek_v2     mlp.gate     n_routed_      same, I = moe_intermediate_size     shared_experts
                             experts                                            (n_shared fused)
deepseek_v3     mlp.gate     n_routed_      same                                shared_experts
                             experts
phimoe          mlp.router   num_local_     gate_up (2I,H), down (H,I)          -
                             experts
gpt_oss         mlp.router   num_local_     gate_up (H,2I) interleaved + bias   -
                             experts        (2I); down (I,H) + bias (H)
==============  ===========  =============  =================================  ===========

Every router's forward returns ``(logits[T,J], weights[T,K], indices[T,K])``; the indices
are what the experts module then uses, so a forward hook reading element 2 sees the real
choice. Per family, how indices and weights come from the logits:

- mixtral: softmax → top-k → renormalise. qwen2_moe / qwen3_moe / olmoe: softmax → top-k →
  renormalise only if ``norm_topk_prob``.
- deepseek_v2: softmax → top-k (``greedy``) or group-limited top-k (``group_limited_greedy``:
  keep the ``topk_group`` groups with the highest max score) → ×``routed_scaling_factor``.
- deepseek_v3: **sigmoid** scores; selection on ``sigmoid + e_score_correction_bias`` with
  group-limited top-k (group score = sum of its top-2); weights are the un-biased sigmoid
  scores of the selected experts, renormalised if ``norm_topk_prob``, ×scaling factor.
- phimoe: sparsemixer (eval mode): the two largest logits, each weighted by a softmax over
  a jitter-masked logit vector.
- gpt_oss: top-k of the raw logits (router has a bias), softmax over those K values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from moeexp.errors import ModelLoadError
from moeexp.models.base import ADAPTERS, ExpertLayout, MoEAdapter, MoELayer, RouterOutput
from moeexp.models.capture import LayerCapture, RoutingCapture, capture_routing

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ADAPTERS",
    "DeepseekV2Adapter",
    "DeepseekV3Adapter",
    "GptOssAdapter",
    "LayerCapture",
    "MixtralAdapter",
    "MoEAdapter",
    "MoELayer",
    "OlmoeAdapter",
    "PhimoeAdapter",
    "Qwen2MoeAdapter",
    "Qwen3MoeAdapter",
    "RouterOutput",
    "RoutingCapture",
    "adapter_for",
    "capture_routing",
    "supported_model_types",
]


@ADAPTERS.register("mixtral")
class MixtralAdapter(MoEAdapter):
    """Mixtral: ``mlp.gate`` router, fused experts, I = ``intermediate_size``."""

    num_experts_keys = ("num_local_experts",)
    intermediate_keys = ("intermediate_size",)


@ADAPTERS.register("qwen2_moe")
class Qwen2MoeAdapter(MoEAdapter):
    """Qwen2-MoE / Qwen1.5-MoE: one shared expert per layer (``mlp.shared_expert``).

    The shared expert is one MLP of width ``shared_expert_intermediate_size`` (Qwen1.5-MoE
    built it from 4 fine-grained experts fused into one), scaled by a sigmoid gate; it counts
    as 1 shared expert here and its bytes are in :meth:`dense_bytes`.
    """

    num_experts_keys = ("num_experts",)
    intermediate_keys = ("moe_intermediate_size",)
    shared_attr = "shared_expert"

    @property
    def num_shared_experts(self) -> int:
        return 1 if int(getattr(self.config, "shared_expert_intermediate_size", 0) or 0) else 0


@ADAPTERS.register("qwen3_moe")
class Qwen3MoeAdapter(MoEAdapter):
    """Qwen3-MoE: like Qwen2-MoE without shared experts."""

    num_experts_keys = ("num_experts",)
    intermediate_keys = ("moe_intermediate_size",)


@ADAPTERS.register("olmoe")
class OlmoeAdapter(MoEAdapter):
    """OLMoE: ``mlp.gate`` router, I = ``intermediate_size``."""

    num_experts_keys = ("num_experts",)
    intermediate_keys = ("intermediate_size",)


@ADAPTERS.register("deepseek_v2")
class DeepseekV2Adapter(MoEAdapter):
    """DeepSeek-V2 (and -Lite): first ``first_k_dense_replace`` layers dense (skipped).

    ``n_shared_experts`` shared experts are fused into one MLP ``mlp.shared_experts`` of
    width ``n_shared_experts * moe_intermediate_size``. Router probabilities are the
    softmax of the logits; with ``group_limited_greedy`` the chosen experts need not be the
    top-K of that vector (always read the captured indices).
    """

    num_experts_keys = ("n_routed_experts",)
    intermediate_keys = ("moe_intermediate_size",)
    shared_attr = "shared_experts"

    @property
    def num_shared_experts(self) -> int:
        return int(getattr(self.config, "n_shared_experts", 0) or 0)


@ADAPTERS.register("deepseek_v3")
class DeepseekV3Adapter(DeepseekV2Adapter):
    """DeepSeek-V3: sigmoid scoring with a selection bias and group-limited top-k.

    :meth:`router_probs` returns the sigmoid scores normalised to sum 1 per token (a
    probability vector over J, as the trace schema needs); the correction bias is *not*
    included (it only steers selection). The top-K of that vector can differ from the
    experts really chosen: read the router's own indices (the capture does).
    """

    scoring = "sigmoid"

    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32[T, J]: sigmoid(logits) / sum_j sigmoid(logits)."""
        s = logits.float().sigmoid()
        return s / s.sum(dim=-1, keepdim=True)


@ADAPTERS.register("phimoe")
class PhimoeAdapter(MoEAdapter):
    """PhiMoE (Phi-3.5-MoE): ``mlp.router`` (an ``nn.Linear`` subclass), sparsemixer top-2."""

    router_attr = "router"
    num_experts_keys = ("num_local_experts",)
    intermediate_keys = ("intermediate_size",)


@ADAPTERS.register("gpt_oss")
class GptOssAdapter(MoEAdapter):
    """GPT-OSS: ``mlp.router`` with bias; experts transposed, gate/up interleaved, biased.

    The MoE block (``GptOssMLP``) returns ``(hidden, router_scores)`` rather than a tensor.
    One expert: ``gate_up_proj`` [H, 2I] (gate = even columns, up = odd columns),
    ``gate_up_proj_bias`` [2I], ``down_proj`` [I, H], ``down_proj_bias`` [H].
    """

    layout: ClassVar[ExpertLayout] = "fused_interleaved_bias"
    router_attr = "router"
    num_experts_keys = ("num_local_experts",)
    intermediate_keys = ("intermediate_size",)
    expert_tensor_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def supported_model_types() -> list[str]:
    """HF ``model_type`` names that have an adapter (sorted)."""
    return ADAPTERS.names()


def adapter_for(model: nn.Module) -> MoEAdapter:
    """The adapter for ``model`` chosen by ``model.config.model_type``.

    Raises:
        ModelLoadError: the model_type has no adapter (the message lists the supported
            ones), or the model has no MoE layer.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} ({type(model).__name__}); moeexp has "
            f"adapters for: {', '.join(supported_model_types())}"
        )
    adapter = ADAPTERS.get(str(model_type))(model)
    if not adapter.moe_layers():
        raise ModelLoadError(
            f"{type(model).__name__} (model_type {model_type!r}) has no MoE layers: no decoder "
            f"layer has `.{adapter.block_attr}.{adapter.router_attr}` and "
            f"`.{adapter.block_attr}.{adapter.experts_attr}`; expert offloading needs an MoE model"
        )
    return adapter
