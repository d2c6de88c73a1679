"""Values remembered per numpy array that cannot change, by the array's identity.

The simulator's hot path receives the same memoised arrays again and again (the
``expert_map`` predictor resends its read-only score rows and expert sets), so work done on
an array once (a validity check, a set of its values) can be kept for it: an array that is
read-only and owns its data cannot change. The memo holds a reference to each array it
keys, so the array's ``id`` is not reused while its entry lives. Used by the FineMoE cache
(checked score rows) and :class:`moeexp.prefetching.PredictionSets` (predicted sets).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")


def is_frozen(a: Any) -> bool:
    """Whether ``a`` is a read-only numpy array that owns its data (it cannot change)."""
    return isinstance(a, np.ndarray) and not a.flags.writeable and a.base is None


class FrozenMemo(Generic[V]):
    """``id(array) -> (array, value)`` for frozen arrays; cleared when ``capacity`` entries
    are held (a replay's distinct arrays number ~10^4)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._entries: dict[int, tuple[np.ndarray, V]] = {}

    def get(self, a: Any) -> V | None:
        """The value remembered for this very array, else None."""
        got = self._entries.get(id(a))
        return got[1] if got is not None and got[0] is a else None

    def put(self, a: Any, value: V) -> None:
        """Remember ``value`` for ``a`` if ``a`` is frozen (else nothing)."""
        if is_frozen(a):
            if len(self._entries) >= self.capacity:
                self._entries.clear()
            self._entries[id(a)] = (a, value)

    def __len__(self) -> int:
        return len(self._entries)
