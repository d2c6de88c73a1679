"""balanced (HybriMoE): the copy/CPU split of a layer's misses with the lowest layer time."""

from __future__ import annotations

import pytest
from tests.unit.execution.exechelpers import cost

from moeexp.costmodel.hybrid import split_layer_time
from moeexp.execution import LayerMisses, build_execution


def _all_splits(c, m):  # type: ignore[no-untyped-def]
    """Every assignment of the misses to copy/CPU (copies heaviest first): its layer time."""
    out = {}
    for mask in range(1 << len(m.experts)):
        cp = [n for i, n in enumerate(m.tokens) if mask >> i & 1]
        cpu = [n for i, n in enumerate(m.tokens) if not mask >> i & 1]
        out[mask] = split_layer_time(c, m.resident_tokens, sorted(cp, reverse=True), cpu,
                                     link_free_s=m.link_free_s).total_s
    return out


def test_decode_with_three_misses_copies_one_and_computes_two_on_the_cpu() -> None:
    """E5-2683 v4, 1 token each: all on the CPU is 3 x 5.9 = 17.8 ms, all copied 3 x 13.8 =
    41.8 ms; one copy (14.3 ms) beside two CPU experts (11.9 ms) ends at 14.3 ms: the best."""
    c = cost()
    m = LayerMisses.of(0, [4, 5, 6], [1, 1, 1], 1)
    out = build_execution({"name": "balanced"}, c).place(m, c)
    assert (out.copy, out.cpu) == ((4,), (5, 6)) and out.covers(m)
    assert out.predicted_s == pytest.approx(min(_all_splits(c, m).values()))
    assert out.predicted_s == pytest.approx(c.copy_s + c.expert_s(1) + 3 * 2 * 4096 * 2 / 748.8e9)


def test_the_heaviest_expert_is_the_one_copied() -> None:
    c = cost()
    out = build_execution({"name": "balanced"}, c).place(LayerMisses.of(0, [4, 5, 6], [1, 5, 2], 5), c)
    assert out.copy == (5,) and set(out.cpu) == {4, 6}


def test_never_worse_than_all_cpu_or_all_copy() -> None:
    """Over a grid of token counts the chosen split is at most both extremes (and equals the
    best of all 2^M assignments: heaviest-first loses nothing here)."""
    c = cost()
    p = build_execution({"name": "balanced"}, c)
    for tokens in ([1, 1], [1, 1, 1, 1], [3, 40, 7], [512, 512, 512], [1, 200]):
        m = LayerMisses.of(0, list(range(len(tokens))), tokens, sum(tokens))
        splits = _all_splits(c, m)
        got = p.place(m, c).predicted_s
        assert got <= splits[0] + 1e-12 and got <= splits[(1 << len(tokens)) - 1] + 1e-12
        assert got == pytest.approx(min(splits.values()))


def test_prefill_copies_everything_and_a_busy_link_pushes_work_to_the_cpu() -> None:
    """512 tokens per expert: 334 ms each on the CPU, so all three are copied. A link busy
    for another 20 ms makes the one decode copy land at 33.8 ms: all three go to the CPU."""
    c = cost()
    p = build_execution({"name": "balanced"}, c)
    assert p.place(LayerMisses.of(0, [0, 1, 2], [512] * 3, 1536), c).cpu == ()
    assert p.place(LayerMisses.of(0, [0, 1, 2], [1] * 3, 1, link_free_s=0.020), c).copy == ()
