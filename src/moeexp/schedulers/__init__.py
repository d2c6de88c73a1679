"""Schedulers (the ``scheduler`` config group): one file per admission policy, each
registering itself in :data:`SCHEDULERS`.

``static`` is today's static batching (the default; ``backend=sim`` then runs
:func:`moeexp.simulator.simulate` unchanged); ``fcfs`` is continuous batching in arrival
order (vLLM, DeepSpeed-FastGen); ``emoe`` is eMoE's SLO-aware admission. The batching loop
that runs them is :mod:`moeexp.serving.loop` (the simulator's and the engine's). :func:`check_scheduler` validates a
``scheduler`` group before any work; :func:`build_scheduler` builds it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from moeexp._autoload import import_submodules
from moeexp.registry import GroupChoice, check_kwargs, group_choice
from moeexp.schedulers.base import (
    SCHEDULERS,
    RunningRequest,
    Scheduler,
    SchedulerView,
    ServingProfile,
    WaitingRequest,
)

import_submodules(sys.modules[__name__])

#: Keywords the builder fills, never the config (static's batch size is the backend's).
_INJECTED = frozenset({"batch_size"})


def check_scheduler(choice: GroupChoice) -> None:
    """An unknown name or key raises ConfigError naming the valid ones; so does a bad value."""
    check_kwargs(SCHEDULERS.get(choice.name), choice.kwargs, f"scheduler={choice.name}",
                 injected=_INJECTED, config_only={"name"})
    build_scheduler(choice)


def build_scheduler(choice: GroupChoice | Mapping[str, Any], *, batch_size: int = 1) -> Scheduler:
    """``SCHEDULERS.build(name, **keywords)`` of the ``scheduler`` group (a validated
    :class:`GroupChoice`, or a mapping holding ``name``); ``static`` gets ``batch_size``."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "scheduler")
    extra = {"batch_size": batch_size} if choice.name == "static" else {}
    return SCHEDULERS.build(choice.name, **choice.kwargs, **extra)


__all__ = ["SCHEDULERS", "RunningRequest", "Scheduler", "SchedulerView", "ServingProfile",
           "WaitingRequest", "build_scheduler", "check_scheduler"]
