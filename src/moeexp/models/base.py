"""The model-adapter interface: what moeexp needs to know about an HF MoE architecture.

An adapter wraps a loaded ``transformers`` model (never modifies its classes) and answers:
where the MoE layers are, which module is the router and which the experts, how the
experts are laid out, how many bytes one routed expert takes, and where the embedding
layer is. Recorders attach forward hooks through it; the engine plugs its experts kernel
in through it. One concrete adapter per architecture family, registered under the HF
``config.model_type`` (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
``deepseek_v2``, ``deepseek_v3``, ``phimoe``, ``gpt_oss``); the concrete classes live in
:mod:`moeexp.models.adapters`.

The base class implements everything generically from a few class attributes (where the
block, router, experts and shared experts hang, which config keys hold J, K and I); a
family overrides only what differs (e.g. DeepSeek-V3's sigmoid scoring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

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


class RouterOutput(NamedTuple):
    """What a router returns (a tuple, so ``logits, weights, indices = out`` works).

    Attributes:
        logits: float[T, J] raw router scores (before softmax/sigmoid), fp32 or model dtype.
        weights: float[T, K] routing weights of the selected experts as the model uses them
            (after any renormalisation / scaling factor of the architecture).
        indices: int64[T, K] the experts the model really selected (bias and group-limited
            top-k included for DeepSeek). Order within a row is not guaranteed sorted.
    """

    logits: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor


def _param_bytes(module: nn.Module) -> int:
    return int(sum(p.numel() * p.element_size() for p in module.parameters()))


class MoEAdapter:
    """Architecture-specific knowledge about an HF MoE causal LM (base class).

    Class attributes a family sets:
        layout: expert tensor layout (see :meth:`expert_tensors`).
        block_attr: attribute of a decoder layer holding the MoE block (``"mlp"``).
        router_attr / experts_attr / shared_attr: attributes of the block.
        expert_tensor_names: parameter names of the fused experts module, each of shape
            ``(J, ...)``; ``expert_tensors`` indexes their first axis.
        num_experts_keys / top_k_keys / intermediate_keys: config attributes tried in order.
        scoring: ``"softmax"`` or ``"sigmoid"`` (how :meth:`router_probs` turns logits into a
            probability vector).
    """

    layout: ClassVar[ExpertLayout] = "fused"
    block_attr: ClassVar[str] = "mlp"
    router_attr: ClassVar[str] = "gate"
    experts_attr: ClassVar[str] = "experts"
    shared_attr: ClassVar[str | None] = None
    expert_tensor_names: ClassVar[tuple[str, ...]] = ("gate_up_proj", "down_proj")
    num_experts_keys: ClassVar[tuple[str, ...]] = ("num_local_experts", "num_experts")
    top_k_keys: ClassVar[tuple[str, ...]] = ("num_experts_per_tok",)
    intermediate_keys: ClassVar[tuple[str, ...]] = ("moe_intermediate_size", "intermediate_size")
    scoring: ClassVar[Literal["softmax", "sigmoid"]] = "softmax"

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # a transformers PreTrainedModel
        self._layers: list[MoELayer] | None = None

    # --- config ----------------------------------------------------------------------
    @property
    def config(self) -> Any:
        """The HF config of the wrapped model."""
        return self.model.config

    def _config_int(self, keys: tuple[str, ...], what: str) -> int:
        for key in keys:
            value = getattr(self.config, key, None)
            if value is not None:
                return int(value)
        raise AttributeError(
            f"{type(self).__name__}: config of model_type {self.config.model_type!r} has none "
            f"of {keys} (needed for {what})"
        )

    # --- structure -------------------------------------------------------------------
    def decoder_layers(self) -> list[nn.Module]:
        """All decoder layers, dense ones included (``model.model.layers``)."""
        base = getattr(self.model, "model", self.model)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise AttributeError(
                f"{type(self).__name__}: {type(self.model).__name__} has no `.model.layers`"
            )
        return list(layers)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE blocks in decoder order (dense decoder layers skipped); cached."""
        if self._layers is None:
            found: list[MoELayer] = []
            for i, layer in enumerate(self.decoder_layers()):
                block = getattr(layer, self.block_attr, None)
                router = getattr(block, self.router_attr, None) if block is not None else None
                experts = getattr(block, self.experts_attr, None) if block is not None else None
                if block is None or router is None or experts is None:
                    continue  # a dense MLP (DeepSeek's first layers, Qwen's mlp_only_layers)
                shared = getattr(block, self.shared_attr, None) if self.shared_attr else None
                found.append(MoELayer(len(found), i, block, router, experts, shared))
            self._layers = found
        return self._layers

    @property
    def num_layers(self) -> int:
        """L: MoE layers only."""
        return len(self.moe_layers())

    @property
    def num_experts(self) -> int:
        """J: routed experts per MoE layer."""
        return self._config_int(self.num_experts_keys, "num_experts")

    @property
    def top_k(self) -> int:
        """K: experts selected per token."""
        return self._config_int(self.top_k_keys, "top_k")

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def expert_intermediate_size(self) -> int:
        """I: the intermediate (FFN) width of one routed expert."""
        return self._config_int(self.intermediate_keys, "expert_intermediate_size")

    @property
    def num_shared_experts(self) -> int:
        """Always-resident shared experts per MoE layer (0 when the family has none)."""
        return 0

    def embedding(self) -> nn.Module:
        """The input embedding module (its output is the semantic key)."""
        return self.model.get_input_embeddings()  # type: ignore[no-any-return]

    # --- experts ---------------------------------------------------------------------
    def expert_tensors(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Views of one routed expert's tensors (name -> tensor), e.g. gate_up, down, bias.

        ``layout == "fused"``: ``gate_up_proj`` float[2I, H] (gate rows then up rows) and
        ``down_proj`` float[H, I]. ``"fused_interleaved_bias"`` (GPT-OSS):
        ``gate_up_proj`` float[H, 2I] (gate/up interleaved along the last axis),
        ``gate_up_proj_bias`` float[2I], ``down_proj`` float[I, H], ``down_proj_bias`` float[H].
        The tensors are views into the fused parameters (no copy).
        """
        layers = self.moe_layers()
        if not 0 <= layer < len(layers):
            raise IndexError(f"MoE layer {layer} out of range 0..{len(layers) - 1}")
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        experts = layers[layer].experts
        return {name: getattr(experts, name)[expert] for name in self.expert_tensor_names}

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all of its tensors, in the model's dtype)."""
        # from shapes, not by indexing: once the engine has moved a fused parameter's data
        # to the host, indexing it fails for a model built under torch.inference_mode
        experts = self.moe_layers()[0].experts
        return int(sum(p.numel() // p.shape[0] * p.element_size()
                       for p in (getattr(experts, n) for n in self.expert_tensor_names)))

    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers (what offloading manages)."""
        return int(sum(_param_bytes(m.experts) for m in self.moe_layers()))

    def dense_bytes(self) -> int:
        """Bytes of every parameter that is not a routed expert (always resident).

        Includes embeddings, attention, norms, routers, dense MLPs and shared experts; tied
        weights are counted once. Buffers (e.g. RoPE tables) are not counted.
        """
        return _param_bytes(self.model) - self.total_expert_bytes()

    # --- routing ---------------------------------------------------------------------
    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32[T, J] probabilities from router logits [T, J] (softmax unless the arch differs)."""
        import torch

        return torch.softmax(logits.float(), dim=-1)

    def apply_router(self, layer: int, hidden: torch.Tensor) -> RouterOutput:
        """Run MoE layer ``layer``'s router on ``hidden`` [..., H] (speculative gate).

        The hidden state is flattened to [T, H] and cast to the router weight's dtype.
        The router's ``forward`` is called directly, under ``torch.no_grad()``, so forward
        hooks (e.g. an active :class:`~moeexp.models.capture.RoutingCapture`) do not fire:
        speculative calls never pollute a capture. Returns a :class:`RouterOutput`.
        """
        import torch

        router = self.moe_layers()[layer].router
        ref = next(router.parameters())
        h = hidden.reshape(-1, self.hidden_size).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            out = router.forward(h)
        return RouterOutput(*out[:3])

    # --- logging ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """A flat, JSON-serialisable summary of the model for logs and run metadata."""
        params = list(self.model.parameters())
        return {
            "adapter": type(self).__name__,
            "model_type": str(self.config.model_type),
            "architecture": type(self.model).__name__,
            "num_decoder_layers": len(self.decoder_layers()),
            "num_moe_layers": self.num_layers,
            "moe_decoder_indices": [m.decoder_index for m in self.moe_layers()],
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "layout": self.layout,
            "scoring": self.scoring,
            "dtype": str(params[0].dtype).replace("torch.", "") if params else "none",
            "expert_bytes": self.expert_bytes(),
            "total_expert_bytes": self.total_expert_bytes(),
            "dense_bytes": self.dense_bytes(),
            "num_parameters": int(sum(p.numel() for p in params)),
        }


ADAPTERS: Registry[MoEAdapter] = Registry("model_type")
