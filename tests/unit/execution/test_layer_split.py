"""layer_split (llama.cpp --n-cpu-moe N): the first N MoE layers' experts on the CPU."""

from __future__ import annotations

import pytest
from tests.unit.execution.exechelpers import cost

from moeexp.errors import ConfigError
from moeexp.execution import LayerMisses, Placement, build_execution


def test_first_n_layers_on_the_cpu_with_the_32_token_threshold() -> None:
    """L=4, N=2: a 1-token miss in layer 0 or 1 runs on the CPU; a 32-token pass (llama.cpp's
    GGML_OP_OFFLOAD_MIN_BATCH) streams the used experts to the GPU for that pass only, 31
    tokens do not; layers 2-3 copy (and are meant to be resident)."""
    c = cost(num_layers=4)
    p = build_execution({"name": "layer_split", "n_cpu_layers": 2}, c)
    assert p.place(LayerMisses.of(1, [0, 7], [1, 1], 1), c) == Placement(cpu=(0, 7))
    assert p.place(LayerMisses.of(0, [3], [2], 31), c) == Placement(cpu=(3,))
    assert p.place(LayerMisses.of(0, [3], [2], 32), c) == Placement(stream=(3,))
    assert p.place(LayerMisses.of(2, [3], [1], 1), c) == Placement(copy=(3,))
    assert p.gpu_resident() == [(layer, e) for layer in (2, 3) for e in range(8)]


def test_null_is_every_layer_and_zero_needs_no_cpu() -> None:
    """n_cpu_layers null = --cpu-moe (all L); 0 puts nothing on the CPU, so a copy-only
    profile is fine; any N > 0 needs the CPU block."""
    c = cost(num_layers=4)
    p = build_execution({"name": "layer_split", "n_cpu_layers": None}, c)
    assert p.place(LayerMisses.of(3, [1], [1], 1), c) == Placement(cpu=(1,)) and not p.gpu_resident()
    plain = cost("rtx3090_pcie4", num_layers=4)
    assert build_execution({"name": "layer_split", "n_cpu_layers": 0}, plain).place(
        LayerMisses.of(0, [1], [1], 1), plain) == Placement(copy=(1,))
    with pytest.raises(ConfigError, match="no cpu: block"):
        build_execution({"name": "layer_split", "n_cpu_layers": 1}, plain)


@pytest.mark.parametrize(("kw", "match"), [
    ({"n_cpu_layers": 5}, r"n_cpu_layers=5 must be an integer in 0\.\.4"),
    ({"n_cpu_layers": -1}, r"in 0\.\.4"),
    ({"n_cpu_layers": 1.5}, r"in 0\.\.4"),
    ({"min_batch": 0}, r"min_batch=0 must be an integer >= 1"),
    ({"n_cpu_moe": 2}, r"unknown key\(s\) 'n_cpu_moe'.*Accepted keys: hidden_on_link, late_to_cpu, min_batch, n_cpu_layers"),
])
def test_bad_settings_refused_with_what_is_valid(kw, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        build_execution({"name": "layer_split", **kw}, cost(num_layers=4))
