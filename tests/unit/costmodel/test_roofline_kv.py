"""KV-cache bytes per token from a model's config (``kv_bytes_per_token``), by hand."""

from __future__ import annotations

import pytest

from moeexp.costmodel import CostModel, load_profile
from moeexp.costmodel.roofline import kv_bytes_per_token
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims


def test_grouped_query_attention() -> None:
    """Mixtral-8x7B: 32 layers x K and V x 8 KV heads x 128 dims x 2 bytes = 128 KiB."""
    arch = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096}
    assert kv_bytes_per_token(arch, 2) == 32 * 2 * 8 * 128 * 2 == 131072


def test_explicit_head_dim_and_mha_default() -> None:
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 8,
                               "hidden_size": 64}, 4) == 2 * 2 * 2 * 8 * 4
    # no num_key_value_heads: every attention head has its own K and V
    assert kv_bytes_per_token({"num_hidden_layers": 1, "num_attention_heads": 4,
                               "hidden_size": 64}, 2) == 2 * 4 * 16 * 2


def test_latent_attention() -> None:
    """DeepSeek-V2-Lite: 27 layers x (512 latent + 64 rope) x 2 bytes, no separate V."""
    arch = {"num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048}
    assert kv_bytes_per_token(arch, 2) == 27 * 576 * 2


@pytest.mark.parametrize(("arch", "match"), [
    ({"num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2}, "head_dim"),
])
def test_incomplete_config_says_what_is_missing(arch, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        kv_bytes_per_token(arch, 2)


def test_cost_model_fallback_is_the_mha_width_it_reads() -> None:
    """2 x L x H x dtype bytes: the K and V entries ``dense_s`` reads per context token."""
    dims = TraceDims(num_layers=4, num_experts=8, top_k=2, hidden_size=16, spec_depth=0,
                     expert_bytes=4096)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), dims, dtype_bytes=2)
    assert cost.kv_bytes_per_token() == 2 * 4 * 16 * 2
