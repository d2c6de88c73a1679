"""The on-demand access stream of a test trace, as the simulator replays it (no torch).

An access is one (forward pass, layer, expert) triple whose expert got at least one token
(algorithms.md §0). The stream lists them in the replay's order: requests one after
another (batch size 1, offline), each request's passes in order, layers 0..L-1, and a
layer's experts in ascending order. The layer's experts form one **run**: the unit the
mechanism serves at once, and the unit its protection rule is about (while a layer runs,
its experts are not evicted; :mod:`moeexp.simulator.device`).

Keys are flat ints ``layer * J + expert`` (what a cache simulator wants as object ids).
The order comes from the simulator's own :class:`~moeexp.simulator.plan.Plan`, so this is
the very stream ``simulate(..., predictor=none)`` serves (a test checks it against
:meth:`~moeexp.simulator.plan.Plan.access_stream`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moeexp.costmodel.roofline import CostModel
from moeexp.simulator.plan import Plan
from moeexp.traces.schema import Trace

#: ``next_use`` of an access whose key is never used again (libCacheSim's "never": INT64_MAX).
NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class AccessStream:
    """A trace's on-demand accesses in replay order.

    Attributes:
        num_layers: L.
        num_experts: J.
        keys: int64[N] ``layer * J + expert`` of every access.
        run_offsets: int64[R + 1]: run r (one layer of one forward pass) is
            ``keys[run_offsets[r]:run_offsets[r + 1]]``; no run is empty.
    """

    num_layers: int
    num_experts: int
    keys: np.ndarray
    run_offsets: np.ndarray

    @property
    def num_accesses(self) -> int:
        return int(self.keys.size)

    @property
    def num_runs(self) -> int:
        return int(self.run_offsets.size - 1)

    @property
    def num_objects(self) -> int:
        """L * J: every expert that could be accessed."""
        return self.num_layers * self.num_experts

    def runs(self) -> Iterator[list[int]]:
        """Each run's keys as python ints (the cache simulators' hot loop wants ints)."""
        keys = self.keys.tolist()
        bounds = self.run_offsets.tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            yield keys[a:b]

    def pairs(self) -> list[tuple[int, int]]:
        """The accesses as ``(layer, expert)`` keys (moeexp's cache-policy keys)."""
        J = self.num_experts
        return [(k // J, k % J) for k in self.keys.tolist()]

    def next_use(self) -> np.ndarray:
        """int64[N]: index of the next access to the same key, :data:`NEVER` if none."""
        n = self.keys.size
        out = np.full(n, NEVER, dtype=np.int64)
        if n == 0:
            return out
        order = np.lexsort((np.arange(n), self.keys))  # by key, then position
        same = self.keys[order[1:]] == self.keys[order[:-1]]
        out[order[:-1][same]] = order[1:][same]
        return out


def access_stream(trace: Trace, cost: CostModel) -> AccessStream:
    """The on-demand access stream the simulator replays for ``trace`` (a test split).

    ``cost`` only sizes the plan's timing tables; the order does not depend on it.
    """
    plan = Plan(trace, cost, batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    J = trace.dims.num_experts
    keys: list[int] = []
    offsets = [0]
    for batch in plan.batches:
        for iters in batch.groups:
            for layer, experts in enumerate(plan.group(iters).experts):
                if experts:
                    keys.extend(layer * J + e for e in experts)
                    offsets.append(len(keys))
    return AccessStream(num_layers=trace.dims.num_layers, num_experts=J,
                        keys=np.asarray(keys, dtype=np.int64),
                        run_offsets=np.asarray(offsets, dtype=np.int64))
