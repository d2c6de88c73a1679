"""Cost projection: the trace's routing with another model's bytes and compute."""

from __future__ import annotations

import pytest

from moeexp.costmodel import CostModel, load_profile
from moeexp.costmodel.projection import copy_to_compute, project
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

TINY = TraceDims(num_layers=8, num_experts=16, top_k=2, hidden_size=64, spec_depth=4,
                 expert_bytes=98304, dense_bytes=1609984, intermediate_size=128)
MIXTRAL = TraceDims(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, spec_depth=0,
                    expert_bytes=352321536, dense_bytes=3211272192, intermediate_size=14336)


def test_projection_keeps_routing_dims_and_takes_bytes_and_compute():
    """L, J, K, D from the trace; H, I, expert bytes and dense bytes per layer from Mixtral."""
    p = project(TINY, MIXTRAL)
    assert (p.num_layers, p.num_experts, p.top_k, p.spec_depth) == (8, 16, 2, 4)
    assert (p.hidden_size, p.intermediate_size, p.expert_bytes) == (4096, 14336, 352321536)
    assert p.dense_bytes == round(3211272192 / 32 * 8)
    assert project(TINY, None, 4.0).expert_bytes == 4 * 98304
    with pytest.raises(ConfigError, match="expert_bytes_scale must be > 0"):
        project(TINY, None, 0.0)


def test_copy_to_compute_places_the_two_regimes():
    """On the RTX 3090 profile the tiny model sits below 1 (copies hide behind compute) and
    its Mixtral projection far above it (FineMoE's testbed: copies dominate)."""
    hw = load_profile("rtx3090_pcie4")
    tiny = copy_to_compute(CostModel.from_profile(hw, TINY), 2)
    mixtral = copy_to_compute(CostModel.from_profile(hw, project(TINY, MIXTRAL)), 2)
    assert tiny < 1 < 5 < mixtral
