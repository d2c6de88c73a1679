"""``copy``: every missed expert is copied to the GPU and computed there (the default).

What every system of moeexp did before CPU execution existed: on-demand loads in the
order the layer needs them, kept in the cache. Needs no CPU block.
"""

from __future__ import annotations

from moeexp.costmodel.roofline import CostModel
from moeexp.execution.base import EXECUTIONS, ExecutionPolicy, LayerMisses, Placement


@EXECUTIONS.register("copy")
class Copy(ExecutionPolicy):
    """Copy then compute on the GPU, for every miss."""

    uses_cpu = False
    plain = True

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        self._check_layer(misses)
        return Placement(copy=misses.experts)
