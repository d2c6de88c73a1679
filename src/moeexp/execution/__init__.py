"""Where a missed expert runs (the ``execution`` config group): one file per policy, each
registering itself in :data:`EXECUTIONS`.

``copy`` (copy then compute on the GPU: every system's behaviour so far, the default),
``cpu_on_miss`` (Fiddler), ``layer_split`` (llama.cpp ``--n-cpu-moe``), ``hot_pinned``
(kTransformers) and ``balanced`` (HybriMoE) are pure decisions over a
:class:`~moeexp.costmodel.roofline.CostModel` (algorithms.md §11): given a layer's missed
experts and the pass's tokens they say which run on the host CPU and which are copied.

The root config's ``execution`` group (default ``copy``) chooses one; the pipeline builds it
on the run's cost model, binds it to the cache budget, fits it on the store split and
hands it to the backend; the simulator's static replay asks :meth:`ExecutionPolicy.place`
at every layer with misses (:mod:`moeexp.simulator.exec_device`) and so does the engine
(:mod:`moeexp.engine.host_experts`; also ``offload(..., execution=...)``). Every option also
takes ``share_host_memory`` (default false): the simulator then charges the CPU's reads and
the link's copies their shared host-memory bandwidth in layers where both work
(``balanced``'s own ``contended`` prices its split so), and ``hidden_on_link`` (default
false; ``up`` or ``both``): the simulator then queues a CPU layer's outputs (``up``: the
copies' direction) or its hidden states both ways (``both``: one copy stream) on the link
behind the copies booked before them (:mod:`moeexp.simulator.exec_device`), and
``late_to_cpu`` (default false; a policy that computes on the CPU only): the simulator then
computes an expert whose copy is still in flight when its layer runs on the CPU where that
ends sooner than the GPU's wait for the copy (the copy still lands and stays cached).
:func:`check_execution` validates a group before any work;
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
from moeexp.errors import ConfigError
from moeexp.execution.base import (
    EXECUTIONS,
    HIDDEN_ON_LINK,
    ExecutionPolicy,
    Key,
    LayerMisses,
    Placement,
)
from moeexp.registry import GroupChoice, check_kwargs, group_choice

import_submodules(sys.modules[__name__])

#: Keywords the builder fills from the cost model, never from the config.
_INJECTED = frozenset({"num_layers", "num_experts"})
#: Keys of every option that the mechanism reads, not the policy's constructor.
_MECHANISM_KEYS = frozenset({"share_host_memory", "hidden_on_link", "late_to_cpu"})


def check_execution(choice: GroupChoice) -> None:
    """An unknown name or key raises ConfigError naming the valid ones."""
    check_kwargs(EXECUTIONS.get(choice.name), choice.kwargs, f"execution={choice.name}",
                 injected=_INJECTED, config_only={"name", *_MECHANISM_KEYS})
    share = choice.kwargs.get("share_host_memory", False)
    if not isinstance(share, bool):
        raise ConfigError(f"execution={choice.name}: share_host_memory={share!r} must be true "
                          "or false")
    hidden = choice.kwargs.get("hidden_on_link", False)
    if not (hidden is False or hidden in HIDDEN_ON_LINK):
        raise ConfigError(f"execution={choice.name}: hidden_on_link={hidden!r}; valid: false, "
                          f"{', '.join(HIDDEN_ON_LINK)}")
    late = choice.kwargs.get("late_to_cpu", False)
    if not isinstance(late, bool):
        raise ConfigError(f"execution={choice.name}: late_to_cpu={late!r} must be true or false")


def build_execution(choice: GroupChoice | Mapping[str, Any], cost: CostModel) -> ExecutionPolicy:
    """The ``execution`` group's policy for ``cost``'s model and profile, checked against it
    (:meth:`ExecutionPolicy.check`) before it is returned."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "execution")
    check_execution(choice)
    kwargs = {k: v for k, v in choice.kwargs.items() if k not in _MECHANISM_KEYS}
    policy = EXECUTIONS.build(choice.name, num_layers=cost.num_layers,
                              num_experts=cost.num_experts, **kwargs)
    policy.share_host_memory = bool(choice.kwargs.get("share_host_memory", False))
    policy.hidden_on_link = choice.kwargs.get("hidden_on_link", False)
    policy.late_to_cpu = bool(choice.kwargs.get("late_to_cpu", False))
    policy.check(cost)
    if policy.late_to_cpu and (policy.plain or not policy.needs_cpu()):
        raise ConfigError(f"execution={choice.name}: late_to_cpu=true needs a policy that "
                          "computes experts on the CPU (cpu_on_miss, layer_split with CPU "
                          "layers, hot_pinned, balanced)")
    return policy


__all__ = ["EXECUTIONS", "ExecutionPolicy", "Key", "LayerMisses", "Placement",
           "build_execution", "check_execution"]
