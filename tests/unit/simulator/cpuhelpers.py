"""A round-number host CPU for the CPU-execution tests, beside simhelpers' unit GPU.

With :func:`cpu_cost`: copying one expert takes 1.0 s, its GPU FFN 0.1 s, a layer's dense
part 0.1 s (simhelpers); the CPU reads one expert in 0.5 s (2 GB/s, efficiency 1, FLOP/s
unbounded, no call overhead), so a CPU miss beats a copy. Hidden-state transfers (8 bytes
per token at 1 GB/s) and the merge cost nanoseconds; tests compute them with the cost
model's own methods.
"""

from __future__ import annotations

from dataclasses import replace

from tests.unit.simulator.simhelpers import unit_profile

from moeexp.costmodel import CostModel
from moeexp.costmodel.cpu import CpuProfile
from moeexp.traces.schema import TraceDims

SRC = "test value"


def unit_cpu(dram_gbps: float = 2.0, host_memory_gbps: float | None = None) -> CpuProfile:
    block = {"name": "unit_cpu", "dram_gbps": dram_gbps, "tflops": 1e9, "call_overhead_us": 0.0,
             "hidden_latency_us": 0.0, "efficiency": {"dense": 1.0},
             "source": {"dram_gbps": SRC, "tflops": SRC, "call_overhead_us": SRC,
                        "hidden_latency_us": SRC, "efficiency": {"dense": SRC}}}
    if host_memory_gbps is not None:
        block["host_memory_gbps"] = host_memory_gbps
    return CpuProfile.from_mapping(block)


def cpu_cost(dims: TraceDims, **cpu_kw: float) -> CostModel:
    """simhelpers' unit cost model with :func:`unit_cpu`."""
    return CostModel.from_profile(replace(unit_profile(), cpu=unit_cpu(**cpu_kw)), dims,
                                  dtype_bytes=2)
