"""Where a missed expert runs (the ``execution`` config group): one file per policy, each
registering itself in :data:`EXECUTIONS`.

``copy`` (copy then compute on the GPU: every system's behaviour so far, the default),
``cpu_on_miss`` (Fiddler), ``layer_split`` (llama.cpp ``--n-cpu-moe``), ``hot_pinned``
(kTransformers) and ``balanced`` (HybriMoE) are pure decisions over a
:class:`~moeexp.costmodel.roofline.CostModel` (algorithms.md §11): given a layer's missed
experts and the pass's tokens they say which run on the host CPU and which are copied.

**Wired into the engine only** (:mod:`moeexp.engine.host_experts`: ``offload(...,
execution=...)``, or ``BackendContext.execution`` for ``backend=engine``); the simulator
does not call these policies yet, and the root config does not list the group; the replay will ask
:meth:`ExecutionPolicy.place` at every layer with misses once the simulator's device model
has a CPU. :func:`check_execution` validates a group before any work;
:func:`build_execution` builds it for a cost model and refuses settings it cannot price
(a CPU policy on a profile without a ``cpu:`` block, a format the CPU has no kernel
efficiency for, a layer split larger than the model).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from moeexp._autoload import import_submodules
from moeexp.costmodel.roofline import CostModel
from moeexp.execution.base import (
    EXECUTIONS,
    ExecutionPolicy,
    Key,
    LayerMisses,
    Placement,
)
from moeexp.registry import GroupChoice, check_kwargs, group_choice

import_submodules(sys.modules[__name__])

#: Keywords the builder fills from the cost model, never from the config.
_INJECTED = frozenset({"num_layers", "num_experts"})


def check_execution(choice: GroupChoice) -> None:
    """An unknown name or key raises ConfigError naming the valid ones."""
    check_kwargs(EXECUTIONS.get(choice.name), choice.kwargs, f"execution={choice.name}",
                 injected=_INJECTED, config_only={"name"})


def build_execution(choice: GroupChoice | Mapping[str, Any], cost: CostModel) -> ExecutionPolicy:
    """The ``execution`` group's policy for ``cost``'s model and profile, checked against it
    (:meth:`ExecutionPolicy.check`) before it is returned."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "execution")
    check_execution(choice)
    policy = EXECUTIONS.build(choice.name, num_layers=cost.num_layers,
                              num_experts=cost.num_experts, **choice.kwargs)
    policy.check(cost)
    return policy


__all__ = ["EXECUTIONS", "ExecutionPolicy", "Key", "LayerMisses", "Placement",
           "build_execution", "check_execution"]
