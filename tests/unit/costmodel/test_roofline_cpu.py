"""CPU execution and expert formats in the roofline cost model, worked out by hand; copy-only
numbers unchanged by a CPU block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

# Mixtral-8x7B (bf16): H 4096, I 14336 -> 352,321,536 bytes per expert
MIXTRAL = TraceDims(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, spec_depth=0,
                    expert_bytes=3 * 4096 * 14336 * 2, dense_bytes=32 * 100_000_000,
                    intermediate_size=14336)
B = 352_321_536
FLOP_PER_TOKEN = 6 * 4096 * 14336


def _cost(profile: str = "rtx3090_pcie4_xeon_e5v4", **kw) -> CostModel:  # type: ignore[no-untyped-def]
    return CostModel.from_profile(load_profile(profile), MIXTRAL, **kw)


def test_cpu_expert_bandwidth_bound_at_one_token_compute_bound_at_512() -> None:
    """E5-2683 v4: one token reads 352 MB at 60 GB/s = 5.87 ms (compute 0.65 ms at
    0.54 TFLOPS), + 30 us per call; 512 tokens: 180 GFLOP / 0.54 TFLOPS = 334 ms."""
    c = _cost()
    assert c.cpu_expert_s(1) == pytest.approx(B / 60e9 + 30e-6)
    assert c.cpu_expert_s(512) == pytest.approx(512 * FLOP_PER_TOKEN / 0.54e12 + 30e-6)
    assert c.cpu_expert_s(0) == 0.0
    # int4 bytes at 47 % of the bandwidth
    c4 = CostModel.from_profile(load_profile("rtx3090_pcie4_xeon_e5v4"),
                                replace(MIXTRAL, expert_bytes=93_585_408), expert_format="int4")
    assert c4.cpu_expert_s(1) == pytest.approx(93_585_408 / (0.47 * 60e9) + 30e-6)


def test_hidden_state_both_ways() -> None:
    """n tokens of 4096 bf16 elements over the 25.6 GB/s achieved link, each way + 10 us:
    one token 2 * (10 us + 8192 B / 25.6 GB/s) = 20.64 us."""
    c = _cost()
    assert c.hidden_transfer_s(1) == pytest.approx(2 * (10e-6 + 8192 / 25.6e9))
    assert c.hidden_transfer_s(100) == pytest.approx(2 * (10e-6 + 100 * 8192 / 25.6e9))
    assert c.cpu_miss_s(1) == c.cpu_expert_s(1) + c.hidden_transfer_s(1)
    assert c.gpu_miss_s(1) == c.copy_s + c.expert_s(1)


def test_the_issue_example() -> None:
    """A 352 MB bf16 expert copies in ~13.8 ms over PCIe 4.0 (25.6 GB/s) and is read from
    DRAM in 3.4-5.9 ms at 60-105 GB/s: the CPU beats the copy 2-4x at batch 1."""
    copy = _cost().copy_s
    assert copy == pytest.approx(10e-6 + B / 25.6e9) and 13e-3 < copy < 14e-3
    for name in ("rtx3090_pcie4_xeon_e5v4", "rtx3090_pcie4_epyc7532", "rtx3090_pcie4_xeon6454s"):
        ratio = _cost(name).gpu_miss_s(1) / _cost(name).cpu_miss_s(1)
        assert 2.0 < ratio < 4.5, (name, ratio)


def test_copy_only_numbers_identical_with_and_without_a_cpu_block() -> None:
    """The CPU block changes no GPU or copy number: bit-identical (==, not approx)."""
    plain, with_cpu = _cost("rtx3090_pcie4"), _cost()
    assert plain.copy_s == with_cpu.copy_s
    for n in (0, 1, 7, 512):
        assert plain.expert_s(n) == with_cpu.expert_s(n)
        assert plain.dense_s(n, 3 * n, n) == with_cpu.dense_s(n, 3 * n, n)
    d1, d2 = plain.describe(), with_cpu.describe()
    assert {k: v for k, v in d1.items() if k != "hardware"} == \
           {k: v for k, v in d2.items() if k != "hardware"}
    assert _cost("rtx3090_pcie4", expert_format="dense") == plain


def test_dequantising_formats_add_their_device_memory_traffic() -> None:
    """hqq2 on the GPU (HQQ's PyTorch backend): + 176,160,768 weights * 4 B / 748.8 GB/s
    = 0.94 ms per expert call; int4 (fused kernel) adds nothing."""
    dims = replace(MIXTRAL, expert_bytes=66_748_416)
    dense = CostModel.from_profile(load_profile("rtx3090_pcie4"), dims)
    hqq = CostModel.from_profile(load_profile("rtx3090_pcie4"), dims, expert_format="hqq2")
    int4 = CostModel.from_profile(load_profile("rtx3090_pcie4"), dims, expert_format="int4")
    extra = 176_160_768 * 4 / (936e9 * 0.8)
    assert hqq.gpu_dequant_s == pytest.approx(extra)
    assert hqq.expert_s(1) == pytest.approx(dense.expert_s(1) + extra)
    assert int4.expert_s(1) == dense.expert_s(1) and int4.gpu_dequant_s == 0.0
    assert hqq.copy_s == dense.copy_s  # copies move the format's bytes, already in the dims


def test_cpu_refused_without_block_or_efficiency() -> None:
    with pytest.raises(ConfigError, match="no cpu: block"):
        _cost("rtx3090_pcie4").cpu_expert_s(1)
    with pytest.raises(ConfigError, match="no cpu: block"):
        _cost("rtx3090_pcie4").check_cpu("execution=balanced")
    with pytest.raises(ConfigError, match=r"valid: dense, int8"):
        _cost(expert_format="q2_k")
    _cost(expert_format="hqq3").check_cpu("x")  # every shipped CPU has every format


def test_contended_rates() -> None:
    """E5: CPU reads 60 GB/s, the link 25.6 GB/s, host memory 60 GB/s: both cut by 60/85.6."""
    cpu, link = _cost().contended_rates()
    assert cpu == pytest.approx(60e9 * 60 / 85.6) and link == pytest.approx(25.6e9 * 60 / 85.6)
    assert _cost().cpu_expert_s(1, cpu) == pytest.approx(B / cpu + 30e-6)
