"""``pinned``: the device of every expert from a map file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.placement import PLACEMENTS, device_map
from moeexp.simulator.topology import Topology


def test_a_json_map_places_each_expert(tmp_path) -> None:
    path = tmp_path / "map.json"
    path.write_text(json.dumps([[1, 0, 0], [2, 2, 1]]))
    got = device_map(PLACEMENTS.build("pinned", map=str(path)), 2, 3, 3)
    assert got.tolist() == [[1, 0, 0], [2, 2, 1]]


def test_an_npy_map_and_the_topology_take_it(tmp_path) -> None:
    path = tmp_path / "map.npy"
    np.save(path, np.array([[0, 1], [1, 1]], dtype=np.int32))
    topo = Topology.build(devices=2, placement={"name": "pinned", "map": str(path)})
    assert topo.device_map(2, 2).tolist() == [[0, 1], [1, 1]]


@pytest.mark.parametrize(("content", "devices", "shape", "pattern"), [
    (None, 2, (1, 2), "does not exist"),
    ("[[0, 1], [1]]", 2, (2, 2), "cannot read map|must be int"),
    ("[[0.5, 1]]", 2, (1, 2), "must be int"),
    ("[[0, -1]]", 2, (1, 2), "must be int"),
    ("[[0, 1]]", 2, (2, 2), "the model has L=2"),
    ("[[0, 3]]", 2, (1, 2), "outside 0..1"),
    ("{not json", 2, (1, 2), "cannot read map"),
])
def test_a_bad_map_is_refused(tmp_path, content, devices, shape, pattern) -> None:
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=pattern):
        device_map(PLACEMENTS.build("pinned", map=str(path)), *shape, devices)


def test_a_map_is_required() -> None:
    with pytest.raises(ConfigError, match="needs placement.map"):
        PLACEMENTS.build("pinned")
