"""Cache (eviction) policies: one file per policy, each registering itself in :data:`CACHES`.

Importing this package imports every policy module, so ``CACHES`` is complete.
:func:`check_cache` validates a ``cache`` group before any work; :func:`build_cache`
builds it once the model's dims are known (its ``capacity`` becomes slots through
:func:`moeexp.cache.capacity.capacity_slots`, which refuses fewer slots than top-k).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from moeexp._autoload import import_submodules
from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.cache.capacity import capacity_slots
from moeexp.errors import ConfigError
from moeexp.registry import GroupChoice, check_kwargs, group_choice
from moeexp.traces.schema import TraceDims

import_submodules(sys.modules[__name__])

#: Keywords the builder fills from the dims, never from the config.
_INJECTED = frozenset({"capacity_slots", "num_layers", "num_experts"})


def check_cache(choice: GroupChoice) -> None:
    """An unknown name or key, or a missing ``capacity``, raises ConfigError."""
    check_kwargs(CACHES.get(choice.name), choice.kwargs, f"cache={choice.name}",
                 injected=_INJECTED, config_only={"capacity", "name"})
    if "capacity" not in choice.kwargs:
        raise ConfigError(f"cache={choice.name}: no 'capacity' (a fraction of all expert "
                          "bytes <= 1.0, bytes as an int, or a string like '2GB'/'512MB')")


def build_cache(choice: GroupChoice | Mapping[str, Any], dims: TraceDims) -> CachePolicy:
    """``CACHES.build(name, capacity_slots=..., num_layers=L, num_experts=J, **keywords)`` of
    the ``cache`` group (a validated :class:`GroupChoice`, or a mapping holding ``name``)."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "cache")
    check_cache(choice)
    kwargs = dict(choice.kwargs)
    slots = capacity_slots(kwargs.pop("capacity"), dims)
    return CACHES.build(choice.name, capacity_slots=slots, num_layers=dims.num_layers,
                        num_experts=dims.num_experts, **kwargs)


__all__ = ["CACHES", "CachePolicy", "Key", "build_cache", "check_cache"]
