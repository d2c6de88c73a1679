"""Per-layer LRU (Mixtral-Offloading, algorithms.md §2): a fixed number of slots per layer.

Each MoE layer owns ``slots_per_layer`` device slots and evicts only among its own residents:
an incoming expert of layer l never displaces an expert of another layer, so a layer's
share of the cache never shrinks (unlike a global LRU, where a long-unused layer loses all
its slots). Within a layer, the victim is the least recently used expert (last insert or
access, logical clock ``now``; ties by key).
"""

from __future__ import annotations

import logging

from moeexp.cache.base import CACHES, Key, RecencyPolicy
from moeexp.errors import ConfigError

log = logging.getLogger(__name__)


@CACHES.register("lru_per_layer")
class LRUPerLayer(RecencyPolicy):
    """LRU within each layer's fixed slots.

    Args:
        capacity_slots: total slots (all layers).
        num_layers: L.
        num_experts: J.
        slots_per_layer: slots each layer owns; ``None`` derives ``capacity_slots // L``.
            ``slots_per_layer * L`` may not exceed ``capacity_slots``.
    """

    def __init__(
        self,
        *,
        capacity_slots: int,
        num_layers: int,
        num_experts: int,
        slots_per_layer: int | None = None,
    ) -> None:
        super().__init__(capacity_slots=capacity_slots, num_layers=num_layers,
                         num_experts=num_experts)
        if slots_per_layer is None:
            slots_per_layer = capacity_slots // num_layers
            if slots_per_layer < 1:
                raise ConfigError(
                    f"lru_per_layer: capacity of {capacity_slots} slots gives less than one "
                    f"slot per layer for {num_layers} layers; raise cache.capacity to at "
                    f"least {num_layers} experts or set cache.slots_per_layer explicitly")
        if slots_per_layer < 1:
            raise ConfigError(f"lru_per_layer: slots_per_layer must be >= 1, got {slots_per_layer}")
        if slots_per_layer * num_layers > capacity_slots:
            raise ConfigError(
                f"lru_per_layer: slots_per_layer={slots_per_layer} x {num_layers} layers = "
                f"{slots_per_layer * num_layers} slots exceeds the cache capacity of "
                f"{capacity_slots} slots; lower cache.slots_per_layer or raise cache.capacity")
        if slots_per_layer > num_experts:
            log.warning("lru_per_layer: slots_per_layer=%d > num_experts=%d; capped",
                        slots_per_layer, num_experts)
            slots_per_layer = num_experts
        self.slots_per_layer = slots_per_layer
        self._per_layer = [0] * num_layers
        self._layer_keys: list[set[Key]] = [set() for _ in range(num_layers)]  # residents

    def has_room(self, incoming: Key) -> bool:
        return self._per_layer[incoming[0]] < self.slots_per_layer

    def candidates(self, incoming: Key) -> list[Key]:
        return sorted(self._layer_keys[incoming[0]])

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        return min(candidates, key=lambda k: (self.last_use(k), k))

    def on_insert(self, key: Key, now: int, prefetched: bool) -> None:
        if key not in self.resident:
            self._per_layer[key[0]] += 1
            self._layer_keys[key[0]].add(key)
        super().on_insert(key, now, prefetched)

    def on_evict(self, key: Key) -> None:
        if key in self.resident:
            self._per_layer[key[0]] -= 1
            self._layer_keys[key[0]].discard(key)
        super().on_evict(key)
