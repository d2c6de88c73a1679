"""arch_dims: a preset's expert bytes in every expert format (meta device, no download)."""

from __future__ import annotations

import pytest

from moeexp.errors import ConfigError
from moeexp.models.arch import arch_dims
from moeexp.paths import load_group_yaml


def test_expert_bytes_follow_the_format() -> None:
    """Mixtral-8x7B: matrices (28672, 4096) and (4096, 14336), 176,160,768 weights.
    bf16 352,321,536 B; int4 and MXFP4 4.25 bits -> 93,585,408 B; hqq2 3.03125 bits ->
    66,748,416 B; int8 one byte per weight + 2 B per stored row (28672 + 4096 rows).
    gpt-oss-20b MXFP4 stays 13,236,480 B (the number before formats grew), int4 refused
    (2880 is no multiple of 128)."""
    mix = load_group_yaml("model", "mixtral_8x7b")["arch"]
    w = 176_160_768
    assert arch_dims(mix).expert_bytes == 2 * w == 352_321_536
    assert arch_dims(mix, expert_format="int4").expert_bytes == 93_585_408 == w * 4.25 / 8
    assert arch_dims(mix, expert_format="mxfp4").expert_bytes == 93_585_408
    assert arch_dims(mix, expert_format="hqq2").expert_bytes == round(w * 3.03125 / 8)
    assert arch_dims(mix, expert_format="int8").expert_bytes == w + 2 * (28672 + 4096)
    oss = load_group_yaml("model", "gpt_oss_20b")["arch"]
    assert arch_dims(oss, expert_format="mxfp4").expert_bytes == 13_236_480
    with pytest.raises(ConfigError, match="model=gpt_oss_20b: expert_format=int4 needs groups"):
        arch_dims(oss, expert_format="int4", where="model=gpt_oss_20b")
    with pytest.raises(ConfigError, match="valid: dense"):
        arch_dims(oss, expert_format="q4_k")


def test_held_dims_count_a_byte_capacity_in_the_format_s_bytes() -> None:
    """A quantised model's byte capacity buys slots of its int8 experts, not the dense
    ones: two dense experts' bytes are 2 dense slots but more int8 ones; dense dims pass
    unchanged."""
    from moeexp.cache.capacity import capacity_slots
    from moeexp.models.adapters import adapter_for
    from moeexp.models.arch import format_expert_bytes, held_dims
    from moeexp.models.toy_configs import toy_model
    from moeexp.traces.recorder import trace_dims

    adapter = adapter_for(toy_model("mixtral"))
    dims = trace_dims(adapter, 0)
    held = held_dims(adapter, dims, "int8", "test")
    assert held_dims(adapter, dims, "dense", "test") is dims
    assert held.expert_bytes == format_expert_bytes(adapter, "int8", 32, "test") < dims.expert_bytes
    two = 2 * dims.expert_bytes
    assert capacity_slots(two, held) == min(two // held.expert_bytes,
                                            dims.num_layers * dims.num_experts) > 2
    assert capacity_slots(two, dims) == 2
