"""copy: every miss copied then computed on the GPU (today's behaviour), no CPU needed."""

from __future__ import annotations

from tests.unit.execution.exechelpers import cost

from moeexp.execution import LayerMisses, Placement, build_execution


def test_everything_is_copied_in_the_given_order_on_a_copy_only_profile() -> None:
    c = cost("rtx3090_pcie4")
    p = build_execution({"name": "copy"}, c)
    assert p.place(LayerMisses.of(2, [5, 1], [1, 1], 1), c) == Placement(copy=(5, 1))
    assert p.place(LayerMisses.of(2, [5], [4096], 4096), c) == Placement(copy=(5,))
    assert p.gpu_resident() == []
