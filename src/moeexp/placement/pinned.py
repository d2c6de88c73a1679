"""``pinned``: every expert on the device a map file names (a placement decided elsewhere).

The map is a file of ``int[L][J]``, the device of each expert ``(layer, expert)``: a JSON
nested list (``[[0, 1, ...], ...]``, one row per MoE layer) or a ``.npy`` integer array.
It is read and checked once, when the policy is built (a missing or malformed file is a
ConfigError before any work); its shape and device range are checked against the model
and ``hardware.devices`` when the replay asks for the placement
(:func:`moeexp.placement.base.device_map`). The map is taken as given: nothing here
derives it from the store split's frequencies (write such a map with any script, e.g.
hottest experts spread over the devices, and pin it here).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeexp.errors import ConfigError
from moeexp.placement.base import PLACEMENTS, Placement


def read_map(path: str | Path) -> np.ndarray:
    """int64[L, J] from a ``.json`` nested list or a ``.npy`` integer array.

    Raises:
        ConfigError: the file is missing, unreadable, not two-dimensional, or holds
            anything but non-negative integers.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"placement=pinned: map file {str(path)!r} does not exist (give a "
                          ".json nested list or a .npy array of int[L][J] devices)")
    try:
        raw = np.load(p, allow_pickle=False) if p.suffix == ".npy" else \
            np.asarray(json.loads(p.read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"placement=pinned: cannot read map {str(path)!r}: {exc}") from None
    if raw.ndim != 2 or raw.size == 0 or not np.issubdtype(raw.dtype, np.integer) \
            or raw.min() < 0:
        raise ConfigError(f"placement=pinned: map {str(path)!r} must be int[L][J] of devices "
                          f">= 0 (one row per MoE layer), got {raw.dtype}{list(raw.shape)}")
    return raw.astype(np.int64)


@PLACEMENTS.register("pinned")
class PinnedPlacement(Placement):
    """Expert ``(l, e)`` on device ``map[l][e]`` of the map file.

    Args:
        map: path of the map file (module docstring).
    """

    name = "pinned"

    def __init__(self, *, map: str | None = None) -> None:  # noqa: A002 - the config key
        if not map:
            raise ConfigError("placement=pinned needs placement.map=<file of int[L][J] devices "
                              "(.json nested list or .npy)>")
        self.path = str(map)
        self.table = read_map(map)

    def assign(self, num_layers: int, num_experts: int, devices: int) -> np.ndarray:
        if self.table.shape != (num_layers, num_experts):
            raise ConfigError(f"placement=pinned: map {self.path!r} is {list(self.table.shape)}, "
                              f"the model has L={num_layers} MoE layers of J={num_experts} experts")
        return self.table.copy()
