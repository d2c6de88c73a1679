"""Shared cost models for the execution tests: Mixtral-8x7B bf16 dims on the RTX 3090 /
PCIe 4.0 profile (25.6 GB/s achieved) with and without the Xeon E5-2683 v4 (60 GB/s)."""

from __future__ import annotations

from dataclasses import replace

from moeexp.costmodel import CostModel, load_profile
from moeexp.traces.schema import TraceDims

MIXTRAL = TraceDims(num_layers=32, num_experts=8, top_k=2, hidden_size=4096, spec_depth=0,
                    expert_bytes=3 * 4096 * 14336 * 2, dense_bytes=32 * 100_000_000,
                    intermediate_size=14336)


def cost(profile: str = "rtx3090_pcie4_xeon_e5v4", num_layers: int = 32,
         num_experts: int = 8) -> CostModel:
    """A Mixtral-priced cost model with ``num_layers`` x ``num_experts`` experts."""
    dims = replace(MIXTRAL, num_layers=num_layers, num_experts=num_experts)
    return CostModel.from_profile(load_profile(profile), dims)
