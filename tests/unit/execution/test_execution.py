"""The execution group: registry == conf/execution, every option builds, bad input refused."""

from __future__ import annotations

import pytest
from tests.unit.execution.exechelpers import cost

from moeexp.errors import ConfigError
from moeexp.execution import EXECUTIONS, LayerMisses, build_execution, check_execution
from moeexp.paths import group_options, load_group_yaml
from moeexp.registry import group_choice
from moeexp.traces.synthetic import random_trace


def test_every_yaml_option_is_registered_and_builds() -> None:
    """conf/execution/*.yaml == the registry; each builds on Mixtral/E5 dims (fit on a
    synthetic store when it needs one) and places every miss exactly once."""
    assert group_options("execution") == EXECUTIONS.names() == \
        ["balanced", "copy", "cpu_on_miss", "hot_pinned", "layer_split"]
    c = cost(num_layers=4)
    store = random_trace(num_layers=4, num_experts=8, store_fraction=1.0)
    for name in EXECUTIONS.names():
        cfg = load_group_yaml("execution", name)
        assert cfg["name"] == name
        policy = build_execution(cfg, c)
        if policy.needs_store:
            policy.fit(store)
        m = LayerMisses.of(1, [0, 3], [1, 2], 2)
        assert policy.place(m, c).covers(m)


def test_unknown_names_keys_and_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="unknown execution 'cpu_on_mis'. Did you mean 'cpu_on_miss'"):
        check_execution(group_choice({"name": "cpu_on_mis"}, "execution"))
    with pytest.raises(ConfigError, match="unknown key"):
        check_execution(group_choice({"name": "balanced", "num_layers": 3}, "execution"))
    with pytest.raises(ConfigError, match="L=4, J=8"):
        EXECUTIONS.build("copy", num_layers=4, num_experts=8).check(cost())
    with pytest.raises(ValueError, match="token counts"):
        LayerMisses.of(0, [1], [5], 4)
    with pytest.raises(ValueError, match="distinct"):
        LayerMisses.of(0, [1, 1], [1, 1], 1)
    with pytest.raises(ValueError, match="layer 4 outside"):
        build_execution({"name": "copy"}, cost(num_layers=4)).place(LayerMisses.of(4, [1], [1], 1),
                                                                    cost(num_layers=4))
