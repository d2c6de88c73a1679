"""The engine's N emulated devices: one cache policy, prefetch queue and copy thread each.

The engine's counterpart of :class:`moeexp.simulator.device_group.DeviceGroup` (the rules
are :mod:`moeexp.simulator.topology`'s): with ``hardware.devices = N > 1`` an expert lives
on the device its :class:`~moeexp.placement.Placement` names; only that device's copy
thread (its emulated link, ``EngineSettings.bandwidth_bps`` each) copies it, only that
device's policy decides its evictions (within that device's slots) and its prefetches wait
in that device's queue. CPU only: the slot buffers of all devices are one
:class:`~moeexp.engine.store.SlotPool` in host memory (the emulation is of the links and
budgets, not of separate memories); a multi-GPU CUDA path is refused until a machine with
several GPUs can test it.

:class:`DeviceCaches` puts the per-device policies behind the one-policy interface the
engine's decision code calls, routing each call by its key's device; predictor scores go
to every policy (as the simulator's ``take``). Demand concurrency ``single`` (one blocking
demand thread over all links, the FineMoE artifact's) chains a layer's demand copies: each
starts only once the previous one landed (:attr:`~moeexp.engine.transfer.CopyJob.after`);
``per_device`` lets each device's demand copies run on its own link in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moeexp.cache.base import CachePolicy, Key
from moeexp.errors import ConfigError
from moeexp.traces.schema import Trace


class DeviceCaches:
    """Per-device cache policies behind the one-policy interface (module docstring).

    Args:
        caches: one policy per device (``capacity_slots`` = that device's slots).
        where: int[L][J]: the device of each expert (the placement's map).
    """

    def __init__(self, caches: Sequence[CachePolicy], where: list[list[int]]) -> None:
        if len({id(c) for c in caches}) != len(caches):
            raise ConfigError("each device needs its own cache policy instance (the same "
                              "object was given twice)")
        self.caches = list(caches)
        self.where = where
        self.name = caches[0].name
        self.pause_prefetch_on_miss = any(c.pause_prefetch_on_miss for c in caches)
        self.needs_future = any(c.needs_future for c in caches)
        #: slots over all devices (the engine's slot pool holds this many)
        self.capacity_slots = sum(c.capacity_slots for c in caches)

    def of(self, key: Key) -> CachePolicy:
        """The policy of ``key``'s device."""
        return self.caches[self.where[key[0]][key[1]]]

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        return self.of(incoming).victim(incoming, protected, now)

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        self.of(key).on_insert(key, now, prefetched)

    def on_access(self, key: Key, now: int, hit: bool) -> None:
        self.of(key).on_access(key, now, hit)

    def on_evict(self, key: Key) -> None:
        self.of(key).on_evict(key)

    def observe_scores(self, scores: dict[int, np.ndarray]) -> None:
        for c in self.caches:
            c.observe_scores(scores)

    def prepare_future(self, accesses: list[Key]) -> None:
        """Every device's policy sees the whole stream (its candidates are its own keys)."""
        for c in self.caches:
            if c.needs_future:
                c.prepare_future(accesses)

    def fit(self, store: Trace) -> None:
        for c in self.caches:
            c.fit(store)

    def initial_residents(self) -> list[Key]:
        return [k for c in self.caches for k in c.initial_residents()]
