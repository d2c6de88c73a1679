"""The engine's prefetch queue and prediction bookkeeping (the simulator's rules).

Queue rules (same as :mod:`moeexp.simulator.device`): higher priority first, FIFO among
equals; a key is queued once, at its highest priority; a request for a layer that already
ran in this forward pass (``layer <= current layer``) is dropped, at enqueue time and again
when it would start; everything still queued when the forward pass ends is dropped.

Prediction sets for ``prediction_recall``/``precision`` (simulator's definition): per
forward pass and layer, P is the last ``Prediction.predicted`` given for the layer by a hook
*before* its router ran, else the union of the experts prefetched for it by such hooks; a
hook at layer l speaks only for layers > l; predictions made by ``start_request`` are
cleared when the first forward pass begins, as the simulator does.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from moeexp.engine.store import Key
from moeexp.predictors.base import Prediction, Prefetch


class PrefetchQueue:
    """Queued prefetch requests (not started: they hold no slot). Not thread-safe: the
    engine calls it under its lock."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.L, self.J = num_layers, num_experts
        self._heap: list[tuple[float, int, Key]] = []
        self._pending: dict[Key, float] = {}
        self._seq = itertools.count()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, prefetches: list[Prefetch], current_layer: int,
             is_resident: set[Key] | dict[Key, int]) -> int:
        """Queue ``prefetches``; returns how many were queued or re-prioritised."""
        n = 0
        for pf in prefetches:
            layer, expert = int(pf.layer), int(pf.expert)
            if not (0 <= layer < self.L and 0 <= expert < self.J):
                raise ValueError(f"prefetch {pf} out of range (L={self.L}, J={self.J})")
            if layer <= current_layer:
                self.dropped += 1
                continue
            key = (layer, expert)
            if key in is_resident:
                continue
            neg = -float(pf.priority)
            old = self._pending.get(key)
            if old is not None and old <= neg:
                continue
            self._pending[key] = neg
            heapq.heappush(self._heap, (neg, next(self._seq), key))
            n += 1
        return n

    def pop(self, current_layer: int) -> Key | None:
        """The best queued key still worth starting, or None."""
        while self._heap:
            neg, _, key = heapq.heappop(self._heap)
            if self._pending.get(key) != neg:
                continue  # superseded by a higher-priority request
            del self._pending[key]
            if key[0] <= current_layer:
                self.dropped += 1
                continue
            return key
        return None

    def clear(self) -> None:
        """End of a forward pass: every queued request targets a layer that ran."""
        self.dropped += len(self._pending)
        self._pending.clear()
        self._heap.clear()


class PredictionSets:
    """P per layer for the current forward pass (see the module docstring)."""

    def __init__(self) -> None:
        self.predicted: dict[int, set[int]] = {}
        self.prefetched: dict[int, set[int]] = {}

    def clear(self) -> None:
        self.predicted.clear()
        self.prefetched.clear()

    def take(self, pred: Prediction, hook_layer: int) -> None:
        """Record ``pred`` made by a hook at layer ``hook_layer`` (-1: request/iteration)."""
        for pf in pred.prefetch:
            if pf.layer > hook_layer:
                self.prefetched.setdefault(int(pf.layer), set()).add(int(pf.expert))
        for layer, arr in pred.predicted.items():
            if layer > hook_layer:
                self.predicted[int(layer)] = {int(e) for e in np.asarray(arr).ravel()}

    def for_layer(self, layer: int) -> set[int] | None:
        got = self.predicted.get(layer)
        return got if got is not None else self.prefetched.get(layer)
