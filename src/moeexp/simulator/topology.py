"""Several devices, each with its own link, slots, prefetch queue and cache policy.

:class:`Topology` says how many devices there are, where experts live (a
:class:`~moeexp.placement.Placement` decision), how a cache budget is split and how demand
loads may overlap. With ``devices == 1`` the replay uses one plain
:class:`~moeexp.simulator.device.Device` (the same objects in the same order as before
topologies existed, so every result is bit-identical); with more it uses a
:class:`DeviceGroup` (:mod:`moeexp.simulator.device_group`).

Rules of the model (algorithms.md §10 names the FineMoE artifact's testbed they follow):

* An expert lives on one device (``placement``): it is copied only over that device's link
  and held only in that device's slots, whose budget that device's own cache policy
  enforces (one policy instance per device; predictor scores go to every instance).
* Each link drains its own device's prefetch queue in parallel with the others (one copy
  worker per device: ``num_thread_per_gpu = 1`` in the artifact's
  ``core/prefetch/task_scheduler.cpp``).
* ``demand_concurrency``: ``single`` = one blocking demand thread (the artifact's Python
  expert loop): at most one demand copy in flight over all links, each starting when the
  previous one finished; ``per_device``: each device's demand copies run on its own link,
  in parallel with other devices'.
* Compute stays one stream: a layer's experts compute one after another in expert order as
  they become ready (hits first), as the artifact's sequential expert loop does.
* ``budget``: how a cache capacity becomes per-device slots (:func:`device_slots`):
  ``total`` = the capacity is the sum over devices (split evenly, the remainder to the
  lowest devices), ``per_device`` = every device gets the capacity (the artifact's
  ``cache_limit`` is per GPU). Either is capped at the experts the device holds.
* ``host_gbps``: optional host-side limit (a PCIe switch or the root complex every link
  passes through) capping the sum of the links' rates, GB/s
  (:class:`~moeexp.simulator.link.HostLimit`); None (default) = none, every link at
  ``hardware.h2d_gbps`` whatever the others do. Simulator only, whole-expert copies only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from moeexp.cache import CACHES, CachePolicy, check_cache
from moeexp.cache.capacity import capacity_slots
from moeexp.errors import ConfigError
from moeexp.placement import PLACEMENTS, Placement, device_map
from moeexp.registry import GroupChoice, group_choice
from moeexp.traces.schema import TraceDims

DemandConcurrency = Literal["single", "per_device"]
BudgetScope = Literal["total", "per_device"]
DEMAND_CONCURRENCY: tuple[str, ...] = ("single", "per_device")
BUDGET_SCOPES: tuple[str, ...] = ("total", "per_device")


def _default_placement() -> Placement:
    return PLACEMENTS.build("round_robin")


@dataclass(frozen=True)
class Topology:
    """The simulated machine's shape.

    Attributes:
        devices: GPUs, each with one link and one copy worker (>= 1).
        placement: which device holds each expert.
        demand_concurrency: ``single`` (one demand copy in flight over all links) or
            ``per_device`` (one per link).
        budget: ``total`` or ``per_device`` (how :func:`device_slots` reads a capacity).
        host_gbps: the shared host-side limit, GB/s (> 0), or None (no limit).
    """

    devices: int = 1
    placement: Placement = field(default_factory=_default_placement)
    demand_concurrency: DemandConcurrency = "single"
    budget: BudgetScope = "total"
    host_gbps: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or isinstance(self.devices, bool) or self.devices < 1:
            raise ConfigError(f"hardware.devices must be an integer >= 1, got {self.devices!r}")
        if self.demand_concurrency not in DEMAND_CONCURRENCY:
            raise ConfigError(f"demand_concurrency {self.demand_concurrency!r} is not valid; "
                              f"valid: {', '.join(DEMAND_CONCURRENCY)}")
        if self.budget not in BUDGET_SCOPES:
            raise ConfigError(f"cache budget scope {self.budget!r} is not valid; valid: "
                              f"{', '.join(BUDGET_SCOPES)}")
        h = self.host_gbps
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float))
                              or not math.isfinite(h) or h <= 0):
            raise ConfigError(f"topology.host_gbps must be a number of GB/s > 0, or null (no "
                              f"host-side limit), got {h!r}")

    @classmethod
    def build(cls, *, devices: int = 1, placement: GroupChoice | Mapping[str, Any] | None = None,
              demand_concurrency: str = "single", budget: str = "total",
              host_gbps: float | None = None) -> Topology:
        """From config values; ``placement`` is a group (``name`` + its keywords), default
        ``round_robin``. Unknown placement names or keywords raise ConfigError."""
        if placement is None:
            return cls(devices=devices, demand_concurrency=demand_concurrency,  # type: ignore[arg-type]
                       budget=budget, host_gbps=host_gbps)  # type: ignore[arg-type]
        if not isinstance(placement, GroupChoice):
            placement = group_choice(placement, "placement")
        policy = PLACEMENTS.build(placement.name, **placement.kwargs)
        return cls(devices=devices, placement=policy, demand_concurrency=demand_concurrency,  # type: ignore[arg-type]
                   budget=budget, host_gbps=host_gbps)  # type: ignore[arg-type]

    def device_map(self, num_layers: int, num_experts: int) -> np.ndarray:
        """int64[L, J]: the device of each expert (checked)."""
        return device_map(self.placement, num_layers, num_experts, self.devices)


def device_slots(topology: Topology, slots: int, where: np.ndarray) -> list[int]:
    """Each device's slot budget for a cache of ``slots`` (already converted from the
    config's capacity), read as ``topology.budget`` says; capped at the experts each
    device holds (``where``: int[L, J] device map).

    Raises:
        ConfigError: a device that holds experts gets no slot (it could never load one).
    """
    n = topology.devices
    held = np.bincount(where.ravel(), minlength=n).tolist()
    if topology.budget == "per_device":
        out = [min(slots, h) for h in held]
    else:
        base, extra = divmod(slots, n)
        out = [min(base + (1 if d < extra else 0), h) for d, h in enumerate(held)]
    short = [d for d in range(n) if held[d] and out[d] < 1]
    if short:
        raise ConfigError(
            f"cache budget of {slots} slot(s) ({topology.budget}) leaves device(s) "
            f"{', '.join(map(str, short))} without a slot for the {max(held)} experts each "
            f"holds under placement {topology.placement.name!r}; give at least "
            f"{n if topology.budget == 'total' else 1} slot(s), or budget=per_device")
    return out


def build_device_caches(choice: GroupChoice | Mapping[str, Any], dims: TraceDims,
                        topology: Topology) -> list[CachePolicy]:
    """One policy of the ``cache`` group per device, each with that device's slots
    (:func:`device_slots` of the group's ``capacity``). Devices that hold no expert still
    get a policy of one slot (never used)."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "cache")
    check_cache(choice)
    kwargs = dict(choice.kwargs)
    slots = capacity_slots(kwargs.pop("capacity"), dims)
    per = device_slots(topology, slots, topology.device_map(dims.num_layers, dims.num_experts))
    return [CACHES.build(choice.name, capacity_slots=max(s, 1), num_layers=dims.num_layers,
                         num_experts=dims.num_experts, **kwargs) for s in per]


def check_caches(caches: Sequence[CachePolicy], topology: Topology) -> None:
    """ConfigError unless there is one policy per device, each a distinct object."""
    if len(caches) != topology.devices:
        raise ConfigError(f"{topology.devices} devices need {topology.devices} cache policies "
                          f"(one per device), got {len(caches)}")
    if len({id(c) for c in caches}) != len(caches):
        raise ConfigError("each device needs its own cache policy instance (the same object "
                          "was given twice)")
