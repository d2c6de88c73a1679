"""``balanced`` (HybriMoE, DAC'25): split each layer's missed experts between CPU compute and
copies so that the layer ends as early as possible.

HybriMoE's intra-layer scheduling lets the GPU take the experts that carry the most tokens
(the GPU's time is flat in the tokens, the CPU's grows with them) and the CPU the lightest
ones, the two sides meeting where their chains balance. Here the split is computed
exactly on the cost model: the missed experts are ordered heaviest first (ties: lower id),
and for every k = 0 .. M the k heaviest are copied (in that order, after the link's
backlog ``link_free_s``) while the rest run on the CPU; the layer time of each split is
:func:`moeexp.costmodel.hybrid.split_layer_time` (GPU chain with the resident experts'
own work, CPU chain with the hidden-state transfers, merge), and the fastest split wins
(ties: fewer copies, i.e. fewer bytes on the link). Copies stay in the cache. With
``contended: true`` the split is priced with host-memory sharing between the CPU's reads
and the copies.
"""

from __future__ import annotations

from moeexp.costmodel.hybrid import split_layer_time
from moeexp.costmodel.roofline import CostModel
from moeexp.execution.base import (
    EXECUTIONS,
    ExecutionPolicy,
    LayerMisses,
    Placement,
    heaviest_first,
)


@EXECUTIONS.register("balanced")
class Balanced(ExecutionPolicy):
    """Per layer, the copy/CPU split of the missed experts with the lowest layer time.

    Args:
        num_layers, num_experts: L, J (injected).
        contended: price the split with host-memory bandwidth shared between CPU reads and
            copies (:func:`~moeexp.costmodel.cpu.share_host_bandwidth`).
    """

    def __init__(self, *, num_layers: int, num_experts: int, contended: bool = False) -> None:
        super().__init__(num_layers=num_layers, num_experts=num_experts)
        self.contended = bool(contended)

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        self._check_layer(misses)
        order = heaviest_first(misses)
        experts = [misses.experts[i] for i in order]
        tokens = [misses.tokens[i] for i in order]
        best_k, best_s = 0, float("inf")
        for k in range(len(order) + 1):
            t = split_layer_time(cost, misses.resident_tokens, tokens[:k], tokens[k:],
                                 link_free_s=misses.link_free_s, contended=self.contended).total_s
            if t < best_s:
                best_k, best_s = k, t
        return Placement(cpu=tuple(experts[best_k:]), copy=tuple(experts[:best_k]),
                         predicted_s=best_s)
