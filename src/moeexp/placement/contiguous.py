"""``contiguous``: each device holds a block of whole consecutive layers (pipeline style).

Layers are split into ``devices`` blocks as evenly as possible, the first blocks one layer
longer when L is not a multiple (``numpy.array_split``'s rule); every expert of a layer
sits on that layer's device. With more devices than layers the last devices hold nothing.
"""

from __future__ import annotations

import numpy as np

from moeexp.placement.base import PLACEMENTS, Placement


@PLACEMENTS.register("contiguous")
class ContiguousPlacement(Placement):
    """Layer ``l`` (all its experts) on the device of its block of consecutive layers."""

    name = "contiguous"

    def assign(self, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
        per_layer = np.empty(num_layers, dtype=np.int64)
        for d, block in enumerate(np.array_split(np.arange(num_layers), devices)):
            per_layer[block] = d
        return np.repeat(per_layer[:, None], num_experts, axis=1)
