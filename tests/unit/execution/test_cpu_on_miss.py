"""cpu_on_miss (Fiddler): per missed expert, the CPU when its predicted time beats the copy."""

from __future__ import annotations

import pytest
from tests.unit.execution.exechelpers import cost

from moeexp.errors import ConfigError
from moeexp.execution import LayerMisses, build_execution


def test_batch_one_goes_to_the_cpu_512_tokens_to_the_gpu() -> None:
    """Batch 1, a 352 MB bf16 expert: the copy over PCIe 4.0 (25.6 GB/s) takes 13.8 ms, the
    CPU reads it at 60 GB/s in 5.9 ms -> CPU. 512 tokens: 180 GFLOP on a 0.54 TFLOPS CPU
    take 334 ms, copy + GPU 18 ms -> copy."""
    c = cost()
    p = build_execution({"name": "cpu_on_miss"}, c)
    assert p.place(LayerMisses.of(0, [3], [1], 1), c).cpu == (3,)
    big = p.place(LayerMisses.of(0, [3], [512], 512), c)
    assert big.copy == (3,) and big.cpu == () and big.stream == ()


def test_each_expert_decided_by_its_own_tokens() -> None:
    """A 64-token pass whose experts serve 1 and 63 tokens: the light one on the CPU, the
    heavy one copied (the E5's crossover is 22 tokens); every expert placed once."""
    c = cost()
    m = LayerMisses.of(5, [1, 6], [1, 63], 64)
    out = build_execution({"name": "cpu_on_miss"}, c).place(m, c)
    assert (out.cpu, out.copy) == ((1,), (6,)) and out.covers(m)


def test_the_decision_switches_once_as_tokens_grow() -> None:
    """CPU time grows with the tokens, the copy's does not: below a crossover always the
    CPU, above it always the copy."""
    c = cost()
    p = build_execution({"name": "cpu_on_miss"}, c)
    on_cpu = [bool(p.place(LayerMisses.of(0, [0], [n], n), c).cpu) for n in range(1, 200)]
    k = on_cpu.index(False)
    assert all(on_cpu[:k]) and not any(on_cpu[k:]) and 10 < k < 40


def test_needs_a_cpu_block() -> None:
    with pytest.raises(ConfigError, match="execution=cpu_on_miss computes experts on the CPU, "
                                          "but hardware=rtx3090_pcie4 has no cpu: block"):
        build_execution({"name": "cpu_on_miss"}, cost("rtx3090_pcie4"))
