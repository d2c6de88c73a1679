"""The placement interface: the device of every routed expert (algorithms.md §10).

A placement is a decision like a cache policy: it sees the model's shape and the number of
devices and returns ``int[L, J]``, the device index of each expert ``(layer, expert)``.
The mechanism (:mod:`moeexp.simulator.topology`) copies an expert only over its device's
link and keeps it only in that device's slots.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from moeexp.errors import ConfigError
from moeexp.registry import Registry


class Placement:
    """Base class: subclasses implement :meth:`assign`."""

    name: ClassVar[str] = "base"

    def assign(self, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
        """int64[L, J]: the device (0 .. devices - 1) that holds each expert."""
        raise NotImplementedError


PLACEMENTS: Registry[Placement] = Registry("placement")


def device_map(placement: Placement, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
    """``placement.assign`` checked: shape [L, J], every value a device index.

    Raises:
        ConfigError: ``devices < 1``, or a placement that names a device out of range or
            returns another shape.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"hardware.devices must be an integer >= 1, got {devices!r}")
    out = np.asarray(placement.assign(num_layers, num_experts, devices))
    if out.shape != (num_layers, num_experts) or not np.issubdtype(out.dtype, np.integer):
        raise ConfigError(f"placement {placement.name!r} returned {out.dtype}{list(out.shape)}, "
                          f"expected int[{num_layers}, {num_experts}]")
    if out.size and (out.min() < 0 or out.max() >= devices):
        raise ConfigError(f"placement {placement.name!r} names device(s) outside 0..{devices - 1}")
    return out.astype(np.int64)
