"""``hot_pinned`` (kTransformers, SOSP'25; SGLang kt-kernel): the hot experts live on the GPU,
every other expert runs on the CPU; a long prefill copies the layer instead.

Placement: :meth:`HotPinned.fit` ranks every (layer, expert) by its use in the store split
(:func:`moeexp.cache.static.usage_counts`, kt-kernel's ``--kt-expert-placement-strategy
frequency``) and pins the ``gpu_experts`` most used (``--kt-num-gpu-experts``; a total over
all layers by default, or per layer with ``per_layer: true``); ties go to the lower
(layer, expert); ``gpu_experts: budget`` pins as many as the cache budget holds (the
pinned experts count inside it: :meth:`HotPinned.bind_budget`, which refuses a count that
does not fit). Execution: a missed expert runs on the CPU, except in a pass of more than
``prefill_threshold`` tokens (``--kt-gpu-prefill-token-threshold``; "prefill above ~1-2k
tokens copies the layer", algorithms.md §11), where its copy serves that pass only
(kTransformers' layer-wise prefill: ``stream``). A pinned expert that is not yet
resident is copied and kept.
"""

from __future__ import annotations

import logging

import numpy as np

from moeexp.cache.static import RankBy, usage_counts
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.execution.base import EXECUTIONS, ExecutionPolicy, Key, LayerMisses, Placement
from moeexp.traces.schema import Trace

log = logging.getLogger(__name__)


@EXECUTIONS.register("hot_pinned")
class HotPinned(ExecutionPolicy):
    """The store split's hottest experts on the GPU, the rest computed on the CPU.

    Args:
        num_layers, num_experts: L, J (injected).
        gpu_experts: experts pinned on the GPU: an int count, a float in (0, 1] as a
            fraction of all of them (of L*J, or of J with ``per_layer``), or ``"budget"``:
            every slot of the cache budget (per layer: slots // L).
        per_layer: ``gpu_experts`` counts per layer (each layer pins its own hottest).
        prefill_threshold: a pass of more tokens copies its missed experts for that pass.
        rank_by: ``accesses`` or ``tokens`` (:func:`~moeexp.cache.static.usage_counts`).
    """

    needs_store = True

    def __init__(self, *, num_layers: int, num_experts: int,
                 gpu_experts: int | float | str = 0.25,
                 per_layer: bool = False, prefill_threshold: int = 1024,
                 rank_by: RankBy = "accesses") -> None:
        super().__init__(num_layers=num_layers, num_experts=num_experts)
        pool = num_experts if per_layer else num_layers * num_experts
        self.from_budget = gpu_experts == "budget"
        self.gpu_experts = 0 if self.from_budget else _count(gpu_experts, pool, per_layer)
        if isinstance(prefill_threshold, bool) or not isinstance(prefill_threshold, int) \
                or prefill_threshold < 0:
            raise ConfigError(f"execution=hot_pinned: prefill_threshold={prefill_threshold!r} "
                              "must be an integer >= 0 (tokens; kTransformers: ~1-2k)")
        if rank_by not in ("accesses", "tokens"):
            raise ConfigError(f"execution=hot_pinned: rank_by={rank_by!r}; valid: accesses, tokens")
        self.per_layer = bool(per_layer)
        self.prefill_threshold = prefill_threshold
        self.rank_by: RankBy = rank_by
        self._pinned: list[Key] | None = None

    def bind_budget(self, capacity_slots: int) -> None:
        """``budget``: pin every slot (per layer: slots // L, at most J); a count of pinned
        experts above ``capacity_slots`` raises ConfigError."""
        if self.from_budget:
            self.gpu_experts = (min(self.num_experts, capacity_slots // self.num_layers)
                                if self.per_layer else capacity_slots)
            return
        total = self.gpu_experts * (self.num_layers if self.per_layer else 1)
        if total > capacity_slots:
            raise ConfigError(f"execution=hot_pinned: gpu_experts pins {total} experts, the "
                              f"cache budget holds {capacity_slots} slots (the pinned experts "
                              "count inside it): lower gpu_experts, use gpu_experts=budget, or "
                              "raise cache.capacity")

    def fit(self, store: Trace) -> None:
        """Pin the hottest experts of ``store`` (see the module docstring)."""
        if (store.dims.num_layers, store.dims.num_experts) != (self.num_layers, self.num_experts):
            raise ConfigError(f"execution=hot_pinned: store has L={store.dims.num_layers}, "
                              f"J={store.dims.num_experts}; built for L={self.num_layers}, "
                              f"J={self.num_experts}")
        use = usage_counts(store, self.rank_by)
        self._pinned = hottest(use, self.gpu_experts, self.per_layer)
        log.info("hot_pinned: %d experts pinned on the GPU", len(self._pinned))

    def gpu_resident(self) -> list[Key]:
        """The pinned experts, hottest first."""
        return list(self._fitted())

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        self._check_layer(misses)
        pinned = set(self._fitted())
        keep = tuple(e for e in misses.experts if (misses.layer, e) in pinned)
        rest = tuple(e for e in misses.experts if (misses.layer, e) not in pinned)
        if misses.pass_tokens > self.prefill_threshold:
            return Placement(copy=keep, stream=rest)
        return Placement(cpu=rest, copy=keep)

    def _fitted(self) -> list[Key]:
        if self._pinned is None:
            raise RuntimeError("execution=hot_pinned: fit(store) was not called before placing")
        return self._pinned


def hottest(use: np.ndarray, count: int, per_layer: bool) -> list[Key]:
    """The ``count`` most used keys of ``use`` (float[L, J]), most used first, ties by
    (layer, expert); with ``per_layer`` the ``count`` most used of every layer."""
    L, J = use.shape
    if per_layer:
        out: list[Key] = []
        for layer in range(L):
            order = np.lexsort((np.arange(J), -use[layer]))[:count]
            out += [(layer, int(e)) for e in order]
        return out
    flat = use.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[:count]
    return [(int(i) // J, int(i) % J) for i in order]


def _count(value: int | float, pool: int, per_layer: bool) -> int:
    """``gpu_experts`` as a count of experts out of ``pool``."""
    what = "per layer (J)" if per_layer else "in all (L*J)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"execution=hot_pinned: gpu_experts={value!r} must be a count, a "
                          "fraction in (0, 1] or budget")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"execution=hot_pinned: gpu_experts={value} as a fraction must be "
                              f"in (0, 1] of the {pool} experts {what}")
        return max(1, int(round(value * pool)))
    if not 0 <= value <= pool:
        raise ConfigError(f"execution=hot_pinned: gpu_experts={value} must be in 0..{pool} "
                          f"(the experts {what})")
    return value
