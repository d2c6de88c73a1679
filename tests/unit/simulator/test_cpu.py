"""HostCpu: one chain, experts back to back after the hidden states go down; counters."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.unit.simulator.cpuhelpers import cpu_cost
from tests.unit.simulator.simhelpers import hand_trace

from moeexp.costmodel import CostModel
from moeexp.errors import ConfigError
from moeexp.simulator.cpu import HostCpu


def test_one_chain_queues_its_work_and_counts_it() -> None:
    """Two experts (1 and 3 tokens) from t=2: hidden states of 3 tokens, then 0.5 s each
    (bandwidth-bound at 2 GB/s); a second call before the chain is free starts after it."""
    cost = cpu_cost(cost_dims())
    cpu = HostCpu(cost)
    end = cpu.run(2.0, [1, 3], 3)
    first = cost.hidden_transfer_s(3) + 2 * 0.5
    assert end == pytest.approx(2.0 + first) and cost.cpu_expert_s(3) == pytest.approx(0.5)
    end2 = cpu.run(2.5, [2], 2)
    assert end2 == pytest.approx(end + cost.hidden_transfer_s(2) + 0.5)
    assert (cpu.calls, cpu.tokens, cpu.hidden_tokens) == (3, 6, 5)
    assert cpu.busy_s == pytest.approx(first + cost.hidden_transfer_s(2) + 0.5)
    bare = CostModel.from_profile(replace(cost.profile, cpu=None), cost_dims())
    with pytest.raises(ConfigError, match="no cpu: block"):
        HostCpu(bare).run(0.0, [1], 1)


def cost_dims():  # type: ignore[no-untyped-def]
    return hand_trace([[[[[0]]]]], num_experts=2).dims
