"""``round_robin``: experts dealt to the devices in flat layer x expert order.

The FineMoE artifact's placement (``IntelliSys-Lab/FineMoE-EuroSys26`` at ``6d063946``,
``core/model/model_topology.cpp``, ``ArcherTopologyHandle::InitializeTopology``): the
sparse (expert) nodes, layer by layer and expert by expert, get
``target_device_id = (target_device_id + 1) % num_gpu`` in turn. Its counter starts where
the dense nodes' placement left it (a model- and GPU-count-dependent offset):
``start_device`` sets that offset (0 by default).
"""

from __future__ import annotations

import numpy as np

from moeexp.errors import ConfigError
from moeexp.placement.base import PLACEMENTS, Placement


@PLACEMENTS.register("round_robin")
class RoundRobinPlacement(Placement):
    """Expert ``(l, e)`` on device ``(start_device + l * J + e) % devices``.

    Args:
        start_device: the device of expert (0, 0) (>= 0; taken modulo the device count).
    """

    name = "round_robin"

    def __init__(self, *, start_device: int = 0) -> None:
        if not isinstance(start_device, int) or start_device < 0:
            raise ConfigError(f"placement=round_robin: start_device must be an integer >= 0, "
                              f"got {start_device!r}")
        self.start_device = start_device

    def assign(self, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
        flat = np.arange(num_layers * num_experts, dtype=np.int64) + self.start_device
        return (flat % devices).reshape(num_layers, num_experts)
