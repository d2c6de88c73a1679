"""Tiny random-weight configurations of every supported MoE architecture (tests, benchmarks).

Each config is small enough to build in well under a second on one CPU core: 2–4 decoder
layers, hidden size 32–64, 4–8 routed experts, top-2, vocabulary 256, eager attention,
fp32. Architectures with dense layers or shared experts keep them (DeepSeek's
``first_k_dense_replace = 1``; Qwen2-MoE's and DeepSeek's shared experts; a Qwen MoE with a
dense ``mlp_only_layers`` entry) so the adapters' layer bookkeeping is actually exercised.

Example::

    from moeexp.models.toy_configs import toy_model
    model = toy_model("mixtral", seed=0)       # MixtralForCausalLM, eval mode, CPU, fp32
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeexp.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "phimoe",
    "gpt_oss",
)

VOCAB = 256
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Per-architecture keyword arguments of the HF config class (on top of _COMMON).
_TINY: dict[str, dict[str, Any]] = {
    "mixtral": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "hidden_size": 32,
        "intermediate_size": 64,  # dense MLP of mlp_only_layers
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],  # decoder layer 1 is dense: 2 MoE layers (0, 2)
        "decoder_sparse_step": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "olmoe": {
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "deepseek_v2": {
        "hidden_size": 32,
        "intermediate_size": 64,  # dense first layer
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # 2 MoE layers (decoder 1, 2)
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    },
    "deepseek_v3": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
    "phimoe": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gpt_oss": {
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        # YaRN's default original length is 4096 x factor 32: keep that ratio (no warning).
        "max_position_embeddings": 131072,
    },
}


def _check(model_type: str) -> None:
    if model_type not in _TINY:
        raise ConfigError(
            f"no tiny config for model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def toy_config(model_type: str) -> PretrainedConfig:
    """A fresh tiny ``PretrainedConfig`` of ``model_type`` (eager attention, vocab 256)."""
    from transformers import AutoConfig

    _check(model_type)
    kwargs = {**_COMMON, **_TINY[model_type]}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def toy_model(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random-weight causal LM of ``model_type``: CPU, fp32, eval mode, deterministic.

    The same ``(model_type, seed)`` gives bit-identical weights (the global torch RNG is
    re-seeded around construction and restored afterwards).
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = toy_config(model_type)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation="eager"
        )
    finally:
        torch.random.set_rng_state(state)
    # transformers initialises a few routing-relevant tensors to zero (GPT-OSS router and
    # expert biases, DeepSeek-V3's score-correction bias); give them small seeded random
    # values so the adapters' bias handling is really exercised by the tests.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        for name, t in tensors.items():
            if name.endswith(
                (
                    "e_score_correction_bias",
                    "router.bias",
                    "experts.gate_up_proj_bias",
                    "experts.down_proj_bias",
                )
            ):
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.1)
    model.eval()
    return model


def toy_dense_model() -> PreTrainedModel:
    """A one-layer dense Llama (no MoE layer, no adapter): what the adapters, the loader
    and the engine must refuse with a clear error."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(cfg)
