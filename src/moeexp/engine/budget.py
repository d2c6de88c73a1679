"""The device budget of the engine: how many expert slots a capacity spec buys.

A capacity is a fraction of all routed-expert bytes (a float in (0, 1]), a byte count (an
int) or a string such as ``"2GB"``, ``"512MB"`` or ``"1.5GiB"``. The engine allocates
``slots`` expert-sized slot buffers on the device and never holds more routed-expert bytes
than ``slots * expert_bytes <= budget_bytes``.

The conversion is the simulator's own :func:`moeexp.cache.capacity.capacity_slots`, so both
mechanisms agree slot for slot (and both refuse fewer slots than top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeexp.cache.capacity import capacity_slots
from moeexp.traces.schema import TraceDims


@dataclass(frozen=True)
class Budget:
    """The engine's expert budget.

    Attributes:
        slots: expert slots on the device (all layers together).
        expert_bytes: bytes of one routed expert.
        total_expert_bytes: bytes of all L*J routed experts.
    """

    slots: int
    expert_bytes: int
    total_expert_bytes: int

    @property
    def budget_bytes(self) -> int:
        """Bytes of routed experts the device may hold: ``slots * expert_bytes``."""
        return self.slots * self.expert_bytes


def budget_of(slots: int, dims: TraceDims) -> Budget:
    """The :class:`Budget` of ``slots`` expert slots of a model with ``dims``."""
    total = dims.num_layers * dims.num_experts * dims.expert_bytes
    return Budget(slots=int(slots), expert_bytes=dims.expert_bytes, total_expert_bytes=total)


def make_budget(spec: float | int | str, dims: TraceDims) -> Budget:
    """The :class:`Budget` of a capacity ``spec`` (validated before any weight moves)."""
    return budget_of(capacity_slots(spec, dims), dims)
