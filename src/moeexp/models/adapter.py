"""The model-adapter interface: what moeexp needs to know about an HF MoE architecture.

An adapter wraps a loaded ``transformers`` model (never modifies its classes) and answers:
where the MoE layers are, which module is the router and which the experts, how the
experts are laid out, how many bytes one routed expert takes, and where the embedding
layer is. Recorders attach forward hooks through it; the engine plugs its experts kernel
in through it. One concrete adapter per architecture family, registered under the HF
``config.model_type`` (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
``deepseek_v2``, ``deepseek_v3``, ``phimoe``, ``gpt_oss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from moeexp.registry import Registry

if TYPE_CHECKING:
    import torch
    from torch import nn

ExpertLayout = Literal["fused", "fused_interleaved_bias", "per_expert"]


@dataclass(frozen=True)
class MoELayer:
    """One MoE block of the model.

    Attributes:
        index: MoE layer index l (0..L-1, dense layers not counted).
        decoder_index: index of the decoder layer holding it.
        block: the MoE block module (``model.layers[i].mlp``).
        router: the router module; its forward returns ``(logits[T,J], weights[T,K],
            indices[T,K])``.
        experts: the routed-experts module (fused tensors, or per-expert modules).
        shared: the shared-experts module, or None.
    """

    index: int
    decoder_index: int
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None


class MoEAdapter:
    """Architecture-specific knowledge about an HF MoE causal LM (base class)."""

    layout: ExpertLayout = "fused"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # --- structure -------------------------------------------------------------------
    def moe_layers(self) -> list[MoELayer]:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers())

    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def embedding(self) -> nn.Module:
        return self.model.get_input_embeddings()

    # --- experts ---------------------------------------------------------------------
    def expert_tensors(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Views of one routed expert's tensors (name -> tensor), e.g. gate_up, down, bias."""
        raise NotImplementedError

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all of its tensors, in the model's dtype)."""
        t = self.expert_tensors(0, 0)
        return int(sum(v.numel() * v.element_size() for v in t.values()))

    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float[T, J] probabilities from router logits (softmax unless the arch differs)."""
        import torch

        return torch.softmax(logits.float(), dim=-1)

    def apply_router(self, layer: int, hidden: torch.Tensor) -> Any:
        """Run layer ``layer``'s router on ``hidden`` [T, H] (speculative gate)."""
        return self.moe_layers()[layer].router(hidden)


ADAPTERS: Registry[MoEAdapter] = Registry("model_type")
