"""predictors/base.py: which hooks a predictor class implements."""

from __future__ import annotations

from moeexp.predictors.base import Predictor, RestLayer, overrides
from moeexp.traces.schema import TraceDims


class _Resting(Predictor):
    def rest_layer(self, obs: RestLayer) -> None:
        self.seen = obs


class _Child(_Resting):
    pass


def test_overrides_names_the_hooks_a_class_or_its_parents_implement() -> None:
    dims = TraceDims(num_layers=2, num_experts=4, top_k=1, hidden_size=2, spec_depth=0,
                     expert_bytes=1)
    assert not overrides(Predictor(dims=dims), "rest_layer")
    assert overrides(_Resting(dims=dims), "rest_layer")
    assert overrides(_Child(dims=dims), "rest_layer")  # inherited from a subclass of the base
    assert not overrides(_Resting(dims=dims), "observe_layer")
