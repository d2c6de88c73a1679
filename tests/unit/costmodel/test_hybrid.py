"""A layer split between GPU and CPU: both chains and the merge, worked out by hand."""

from __future__ import annotations

import pytest

from moeexp.costmodel import CostModel, load_profile
from moeexp.costmodel.hybrid import merge_s, mixed_layer_s, split_layer_time
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

MIXTRAL = TraceDims(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, spec_depth=0,
                    expert_bytes=3 * 4096 * 14336 * 2, dense_bytes=32 * 100_000_000,
                    intermediate_size=14336)


def _cost(profile: str = "rtx3090_pcie4_xeon_e5v4") -> CostModel:
    return CostModel.from_profile(load_profile(profile), MIXTRAL)


def test_mixed_layer_ends_when_both_chains_and_the_merge_end() -> None:
    assert mixed_layer_s(3.0, 5.0, 0.5) == 5.5
    assert mixed_layer_s(5.0, 3.0, 0.5) == 5.5


def test_gpu_only_layer_is_the_copy_pipeline() -> None:
    """Resident expert (1 token), then two copies: the second copied expert starts when its
    copy lands at 2 copy_s (the GPU is idle by then). No CPU work: no merge, no CPU block
    needed."""
    c = _cost("rtx3090_pcie4")
    t = split_layer_time(c, [1], [1, 1], [])
    e, cp = c.expert_s(1), c.copy_s
    assert t.gpu_s == pytest.approx(max(max(e, cp) + e, 2 * cp) + e)
    assert (t.cpu_s, t.merge_s, t.link_s) == (0.0, 0.0, pytest.approx(2 * cp))
    assert t.total_s == t.gpu_s
    delayed = split_layer_time(c, [], [1], [], link_free_s=0.005)
    assert delayed.gpu_s == pytest.approx(0.005 + cp + e)


def test_both_sides() -> None:
    """One expert copied, two on the CPU (1 token each): CPU chain = hidden states of 2
    tokens both ways + 2 CPU experts; merge = 3 * 2 * 4096 * 2 B over 748.8 GB/s."""
    c = _cost()
    t = split_layer_time(c, [], [1], [1, 1])
    assert t.gpu_s == pytest.approx(c.copy_s + c.expert_s(1))
    assert t.cpu_s == pytest.approx(c.hidden_transfer_s(2) + 2 * c.cpu_expert_s(1))
    assert t.merge_s == pytest.approx(3 * 2 * 4096 * 2 / (936e9 * 0.8)) == merge_s(c, 2)
    assert t.total_s == pytest.approx(max(t.gpu_s, t.cpu_s) + t.merge_s)
    one = split_layer_time(c, [], [], [1, 1], hidden_tokens=1)
    assert one.cpu_s == pytest.approx(c.hidden_transfer_s(1) + 2 * c.cpu_expert_s(1))


def test_host_memory_sharing_slows_both_sides_only_when_both_are_busy() -> None:
    c = _cost()
    free, shared = split_layer_time(c, [], [1], [1]), split_layer_time(c, [], [1], [1], contended=True)
    assert shared.gpu_s > free.gpu_s and shared.cpu_s > free.cpu_s
    cpu_bps, link_bps = c.contended_rates()
    assert shared.link_s == pytest.approx(10e-6 + c.expert_bytes / link_bps)
    assert split_layer_time(c, [], [], [1], contended=True) == split_layer_time(c, [], [], [1])
    assert split_layer_time(c, [], [1], [], contended=True) == split_layer_time(c, [], [1], [])


def test_cpu_work_needs_a_cpu_block() -> None:
    with pytest.raises(ConfigError, match="no cpu: block"):
        split_layer_time(_cost("rtx3090_pcie4"), [], [], [1])
