"""The prefetch rules the simulator and the engine share, so that both take the same decisions.

Both mechanisms run these two objects (no torch, no time source of their own; the caller
says what "now" is):

:class:`PrefetchQueue`: prefetch requests queued but not started (they hold no slot)::

    push(prefetches, current layer, resident keys[, at])   queue, re-prioritise or drop
    pop(current layer[, free_at, before])                   the best request to start now
    clear()                                                 the forward pass ended

* higher priority first, FIFO among equals; a key is queued once, at its highest priority
  (asking again at a lower or equal priority changes nothing);
* a request for a resident key is ignored; one for a layer that already ran in this
  forward pass (``layer <= current layer``) is dropped, when pushed and again when it
  would start; everything still queued when the pass ends is dropped;
* the simulator's copy engine starts the best request when it is free (``free_at``: the
  engine free and not paused; a request never starts before it was pushed) and only if
  that is before its next event (``before``); the engine's copy thread starts one whenever
  no demand load waits. Either way the eviction decision is taken at that moment, by the
  caller, and a request the policy finds no victim for is dropped (:meth:`~PrefetchQueue.drop`).

:class:`PredictionSets`: P of ``prediction_recall``/``prediction_precision``
(algorithms.md §8, :func:`moeexp.metrics.prediction_overlap`) per forward pass and layer:
the last ``Prediction.predicted`` given for the layer by a hook *before* its router ran,
else the union of the experts prefetched for it by such hooks (resident or not). A hook at
layer l speaks only for layers > l (``start_request``/``start_iteration``: l = -1). Cleared
when a forward pass begins.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING

import numpy as np

from moeexp.frozen_memo import FrozenMemo

if TYPE_CHECKING:
    from collections.abc import Container, Iterable
    from collections.abc import Set as AbstractSet

    from moeexp.predictors.base import Prediction, Prefetch

Key = tuple[int, int]
_NEG_INF = float("-inf")
_INF = float("inf")


class PrefetchQueue:
    """Queued prefetch requests of the running forward pass (see the module docstring).

    Not thread-safe: the engine calls it under its lock.

    Attributes:
        pending: key -> -priority of its queued request (read it, never write it: empty
            means nothing is queued).
        dropped: requests dropped so far: for a layer that had run (at push or pop), left
            at the end of a pass, or counted by the caller (:meth:`drop`).
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.L, self.J = num_layers, num_experts
        # (-priority, push order, pushed at, key); entries whose -priority is no longer
        # the key's in pending were superseded by a higher-priority request.
        self._heap: list[tuple[float, int, float, Key]] = []
        self.pending: dict[Key, float] = {}
        self._seq = 0
        self.dropped = 0

    def __len__(self) -> int:
        """Requests queued (one per key)."""
        return len(self.pending)

    def push(self, prefetches: Iterable[Prefetch], current_layer: int, resident: Container[Key],
             at: float = 0.0) -> int:
        """Queue ``prefetches`` made while layer ``current_layer`` runs (-1: before layer 0).

        Args:
            prefetches: the requests, in the predictor's order.
            current_layer: the last layer whose experts ran (or are running) in this pass.
            resident: keys holding a slot (a request for one is ignored).
            at: when they were made (simulator: seconds; the engine leaves 0).

        Returns:
            How many requests were queued or re-prioritised.

        Raises:
            ValueError: a request outside the L x J experts.
        """
        J, L, pending, heap = self.J, self.L, self.pending, self._heap
        get, push = pending.get, heappush
        n, seq = 0, self._seq
        try:
            for pf in prefetches:
                layer = pf.layer
                if layer <= current_layer:
                    if layer < 0 or not 0 <= pf.expert < J:
                        raise ValueError(f"prefetch {pf} out of range (L={L}, J={J})")
                    self.dropped += 1
                    continue
                key = (layer, pf.expert)
                if key in resident:  # ignored, queued or not: checked first, as most of a
                    continue  # re-sent window is resident (the oracle's: 80 % of its items)
                neg = -pf.priority
                old = get(key)
                if old is not None and old <= neg:
                    continue  # queued at this priority or higher
                if layer >= L or not 0 <= key[1] < J:
                    raise ValueError(f"prefetch {pf} out of range (L={L}, J={J})")
                pending[key] = neg
                seq += 1
                push(heap, (neg, seq, at, key))
                n += 1
        finally:
            self._seq = seq
        return n

    def pop(self, current_layer: int, free_at: float = _NEG_INF,
            before: float = _INF) -> tuple[Key, float] | None:
        """Take the best request that can start before ``before``.

        Its start is ``max(free_at, the time it was pushed)``. Requests for a layer
        <= ``current_layer`` met on the way are dropped.

        Returns:
            (key, start) or None (nothing queued, or the best request cannot start before
            ``before``: it stays queued). The caller checks residency and picks the victim.
        """
        heap, pending = self._heap, self.pending
        while heap:
            neg, _, at, key = heap[0]
            if pending.get(key) != neg:
                heappop(heap)  # superseded by a higher-priority request
                continue
            start = free_at if free_at >= at else at  # max(free_at, at)
            if start >= before:
                return None
            heappop(heap)
            del pending[key]
            if key[0] <= current_layer:
                self.dropped += 1
                continue
            return key, start
        return None

    def drop(self) -> None:
        """Count a popped request the caller could not start (the policy found no victim)."""
        self.dropped += 1

    def clear(self) -> None:
        """The forward pass ended: every queued request targets a layer that ran."""
        self.dropped += len(self.pending)
        self.pending.clear()
        self._heap.clear()


class PredictionSets:
    """P per layer for the running forward pass (see the module docstring).

    Prefetches are folded into their per-layer sets only when a layer without a
    ``predicted`` set asks (most predictors give ``predicted`` for every layer they speak
    for, and then no prefetch list is ever walked here).
    """

    def __init__(self) -> None:
        self._predicted: dict[int, AbstractSet[int]] = {}
        self._prefetched: dict[int, set[int]] = {}
        self._unfolded: list[tuple[int, list[Prefetch]]] = []  # (hook layer, its prefetches)
        # the sets of read-only arrays: predictors resend memoised arrays (expert_map)
        self._as_sets: FrozenMemo[frozenset[int]] = FrozenMemo()

    def clear(self) -> None:
        """A forward pass begins: no hook has spoken for it yet."""
        self._predicted.clear()
        self._prefetched.clear()
        self._unfolded.clear()

    def take(self, pred: Prediction, hook_layer: int) -> None:
        """Record ``pred``, made by a hook at layer ``hook_layer`` (-1: request/iteration)."""
        if pred.prefetch:
            self._unfolded.append((hook_layer, pred.prefetch))
        if pred.predicted:
            for layer, experts in pred.predicted.items():
                if layer > hook_layer:
                    self._predicted[layer] = self._as_set(experts)

    def _as_set(self, experts: np.ndarray) -> AbstractSet[int]:
        """The experts as a set (made once for a read-only array: :mod:`moeexp.frozen_memo`)."""
        out = self._as_sets.get(experts)
        if out is None:
            out = frozenset(np.asarray(experts).tolist())
            self._as_sets.put(experts, out)
        return out

    def for_layer(self, layer: int) -> AbstractSet[int] | None:
        """P of ``layer``: its predicted set, else its prefetched set, else None."""
        got = self._predicted.get(layer)
        if got is not None:
            return got
        if self._unfolded:
            self._fold()
        return self._prefetched.get(layer)

    def _fold(self) -> None:
        sets = self._prefetched
        for hook_layer, prefetches in self._unfolded:
            for pf in prefetches:
                if pf.layer > hook_layer:
                    s = sets.get(pf.layer)
                    if s is None:
                        sets[pf.layer] = s = set()
                    s.add(pf.expert)
        self._unfolded.clear()
