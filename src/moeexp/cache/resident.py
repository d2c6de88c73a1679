"""``resident``: every expert pinned on the device (the ``no_offload`` latency floor).

Whatever capacity the config asks for, the cache holds all L * J experts, loads them
before the first request (``initial_residents``) and never evicts.
"""

from __future__ import annotations

import logging

from moeexp.cache.base import CACHES, CachePolicy, Key
from moeexp.errors import ConfigError

log = logging.getLogger(__name__)


@CACHES.register("resident")
class ResidentCache(CachePolicy):
    """All experts resident; ``capacity_slots`` is overridden to L * J."""

    def __init__(self, *, capacity_slots: int, num_layers: int, num_experts: int) -> None:
        total = num_layers * num_experts
        if capacity_slots != total:
            log.debug("resident cache: capacity %d slots -> all %d experts", capacity_slots, total)
        super().__init__(capacity_slots=total, num_layers=num_layers, num_experts=num_experts)

    def initial_residents(self) -> list[Key]:
        return [(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)]

    def victim(self, incoming: Key, protected: set[Key], now: int) -> Key | None:
        if self.has_room(incoming):
            return None
        raise ConfigError(f"{self.name}: every expert is pinned; nothing may be evicted for {incoming}")

    def choose(self, candidates: list[Key], incoming: Key, now: int) -> Key:
        raise ConfigError(f"{self.name}: every expert is pinned; nothing may be evicted")
