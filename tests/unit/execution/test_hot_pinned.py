"""hot_pinned (kTransformers): the store's hottest experts on the GPU, the rest on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
from tests.unit.execution.exechelpers import cost

from moeexp.errors import ConfigError
from moeexp.execution import LayerMisses, Placement, build_execution
from moeexp.traces.synthetic import random_trace


def store():  # type: ignore[no-untyped-def]
    """L=2, J=4, K=1; 18 one-token iterations. Layer 0 uses expert 2 in all of them; layer 1
    uses expert 3 in every third (6) and expert 1 in the others (12)."""
    tr = random_trace(num_layers=2, num_experts=4, top_k=1, num_requests=3, prompt_len=1,
                      output_len=6, store_fraction=1.0, seed=0)
    n = tr.num_tokens
    tr.topk_idx[:, 0, 0] = 2
    tr.topk_idx[:, 1, 0] = np.where(np.arange(n) % 3 == 0, 3, 1)
    return tr


def _built(**kw):  # type: ignore[no-untyped-def]
    c = cost(num_layers=2, num_experts=4)
    p = build_execution({"name": "hot_pinned", **kw}, c)
    p.fit(store())
    return p, c


def test_pins_the_hottest_and_runs_the_rest_on_the_cpu() -> None:
    """gpu_experts=2 pins (0,2) (18 uses) and (1,1) (12). A decode miss on (1,3) runs on the
    CPU; a pinned expert not yet resident is copied and kept."""
    p, c = _built(gpu_experts=2)
    assert p.gpu_resident() == [(0, 2), (1, 1)]
    assert p.place(LayerMisses.of(1, [3, 1], [1, 1], 2), c) == Placement(cpu=(3,), copy=(1,))


def test_a_long_prefill_streams_the_layer() -> None:
    """Above prefill_threshold tokens (1024 by default) the non-pinned misses are copied for
    that pass only; exactly at the threshold they still run on the CPU."""
    p, c = _built(gpu_experts=2)
    assert p.place(LayerMisses.of(1, [3, 0], [600, 425], 1025), c) == Placement(stream=(3, 0))
    assert p.place(LayerMisses.of(1, [3], [600], 1024), c) == Placement(cpu=(3,))


def test_per_layer_and_fraction() -> None:
    """per_layer 2: each layer's two hottest (ties to the lower id); 0.25 of L*J=8 = 2."""
    p, _ = _built(gpu_experts=2, per_layer=True)
    assert p.gpu_resident() == [(0, 2), (0, 0), (1, 1), (1, 3)]
    assert _built(gpu_experts=0.25)[0].gpu_resident() == [(0, 2), (1, 1)]


def test_place_before_fit_and_bad_settings() -> None:
    c = cost(num_layers=2, num_experts=4)
    with pytest.raises(RuntimeError, match="fit"):
        build_execution({"name": "hot_pinned"}, c).place(LayerMisses.of(0, [1], [1], 1), c)
    for kw, match in [({"gpu_experts": 9}, r"in 0\.\.8"), ({"gpu_experts": 1.5}, r"\(0, 1\]"),
                      ({"prefill_threshold": -1}, ">= 0"), ({"rank_by": "bytes"}, "accesses")]:
        with pytest.raises(ConfigError, match=match):
            build_execution({"name": "hot_pinned", **kw}, c)
    with pytest.raises(ConfigError, match="no cpu: block"):
        build_execution({"name": "hot_pinned"}, cost("rtx3090_pcie4", 2, 4))
