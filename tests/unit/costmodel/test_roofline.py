"""The roofline cost model: copy, expert and dense times worked out by hand."""

from __future__ import annotations

import pytest

from moeexp.costmodel import CostModel, HardwareProfile, load_profile
from moeexp.traces.schema import TraceDims

# Mixtral-8x7B (bf16): H 4096, I 14336 -> 352,321,536 bytes per expert
MIXTRAL = TraceDims(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, spec_depth=0,
                    expert_bytes=3 * 4096 * 14336 * 2, dense_bytes=32 * 100_000_000,
                    intermediate_size=14336)


def _profile(**kw) -> HardwareProfile:  # type: ignore[no-untyped-def]
    base = dict(name="t", h2d_gbps=32.0, h2d_efficiency=0.5, copy_latency_us=10.0,
                peak_tflops=100.0, compute_efficiency=0.5, hbm_gbps=1000.0,
                memory_efficiency=0.5, memory_gb=24.0, dense_overhead_us=0.0,
                expert_overhead_us=0.0)
    base.update(kw)
    return HardwareProfile(**base)  # type: ignore[arg-type]


def test_copy_time_is_latency_plus_bytes_over_achieved_bandwidth() -> None:
    """352,321,536 B at 32 GB/s * 0.5 = 16 GB/s: 22.02 ms, + 10 us latency."""
    c = CostModel.from_profile(_profile(), MIXTRAL)
    assert c.copy_s == pytest.approx(10e-6 + 352_321_536 / 16e9)


def test_expert_memory_bound_for_one_token_compute_bound_for_many() -> None:
    """One token: 6*H*I = 352 MFLOP at 50 TFLOP/s = 7 us vs 352 MB at 500 GB/s = 0.70 ms:
    memory bound. 1000 tokens: 352 GFLOP -> 7.05 ms > 0.70 ms (+ activations): compute bound."""
    c = CostModel.from_profile(_profile(), MIXTRAL)
    one = c.expert_s(1)
    assert one == pytest.approx((352_321_536 + (2 * 4096 + 3 * 14336) * 2) / 500e9)
    many = c.expert_s(1000)
    assert many == pytest.approx(6 * 4096 * 14336 * 1000 / 50e12)
    assert c.expert_s(0) == 0.0
    assert c.experts_s(__import__("numpy").array([1, 0, 1000])) == pytest.approx(one + many)


def test_dense_part_and_overheads() -> None:
    """Decode: 1e8 B of dense weights at 500 GB/s = 0.2 ms (+ KV reads) + 30 us overhead."""
    c = CostModel.from_profile(_profile(dense_overhead_us=30.0, expert_overhead_us=5.0), MIXTRAL)
    kv = 2 * 100 * 4096 * 2
    assert c.dense_s(1, 100, 100) == pytest.approx((1e8 + kv) / 500e9 + 30e-6)
    assert c.expert_s(1) == pytest.approx((352_321_536 + (2 * 4096 + 3 * 14336) * 2) / 500e9 + 5e-6)


def test_the_roofline_ignores_a_pass_members() -> None:
    """A batched GPU engine runs the dense part once per pass: dense_s of 1, 2 or 16
    members is the same number to the bit, decode and prefill, on every shipped profile;
    and a static batch of 4 builds its groups' dense time as the three-argument call does."""
    from moeexp.simulator.plan import Plan
    from moeexp.traces.synthetic import random_trace

    for name in ("rtx3090_pcie4", "a5000_pcie4", "a100_80g_pcie4", "h100_pcie5"):
        c = CostModel.from_profile(load_profile(name), MIXTRAL)
        for args in ((1, 100, 100), (16, 1600, 1600), (300, 45150, 300)):
            assert {c.dense_s(*args, m) for m in (1, 2, 16)} == {c.dense_s(*args)}
    tr = random_trace(num_requests=8, num_layers=4, num_experts=8, top_k=2, output_len=3)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims)
    plan = Plan(tr, cost, batch_size=4, arrival_rate=None, num_requests=None, seed=0)
    for b in plan.batches:
        for iters in b.groups:
            gd = plan.group(iters)
            assert len(iters) == 4
            assert gd.dense_s == cost.dense_s(*_sums(plan, iters))


def _sums(plan, iters):  # type: ignore[no-untyped-def]
    """(tokens, ctx, kv) of a group as Plan sums them."""
    tr, tokens, ctx, kv = plan.trace, 0, 0, 0
    for i in iters:
        T = int(plan._lens[i])
        if int(tr.iter_step[i]) == 0:
            tokens, ctx, kv = tokens + T, ctx + T * (T + 1) // 2, kv + T
        else:
            c = plan._prompt_len[int(tr.iter_request[i])] + int(tr.iter_step[i])
            tokens, ctx, kv = tokens + T, ctx + T * c, kv + c
    return tokens, ctx, kv


def test_fallbacks_when_dims_are_sparse() -> None:
    """intermediate from expert_bytes / (3 H dtype); dense part from 4 H^2 parameters."""
    d = TraceDims(num_layers=2, num_experts=4, top_k=1, hidden_size=64, spec_depth=0,
                  expert_bytes=3 * 64 * 128 * 2)
    c = CostModel.from_profile(load_profile("rtx3090_pcie4"), d, dtype_bytes=2)
    assert c.intermediate_size == 128
    assert c.dense_layer_bytes == 4 * 64 * 64 * 2
    assert c.gpu_mem_bytes(3) == 3 * d.expert_bytes + 2 * 4 * 64 * 64 * 2
