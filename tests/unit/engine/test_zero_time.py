"""The zero-time release clock (:mod:`moeexp.engine.zero_time`): which of a layer's experts a
demand load may evict, as the simulator's zero-time link has them computed."""

from __future__ import annotations

from moeexp.engine.zero_time import ZeroTimeClock


def test_experts_with_tokens_are_released_one_per_failed_ask() -> None:
    c = ZeroTimeClock()
    c.computed((0, 1), tokens=True)
    c.computed((0, 2), tokens=True)
    assert c.ask_time(0) == []  # nothing finished at the layer's start
    assert c.wait_next() == [(0, 1)]
    assert c.wait_next() == [(0, 2)]
    assert c.wait_next() == []  # nothing left to finish
    c.loaded((0, 3), 0, tokens=True)
    assert c.ask_time(0) == []  # (0, 3) computes after its copy lands


def test_experts_without_tokens_finish_with_their_copy() -> None:
    """A hit without tokens before any compute finishes at once; a load without tokens
    finishes when its copy lands, so the next load may evict it; after an expert with
    tokens the ones without finish with it and are released together."""
    c = ZeroTimeClock()
    c.computed((0, 0), tokens=False)
    assert c.ask_time(0) == [(0, 0)]
    c.loaded((0, 1), 0, tokens=False)
    assert c.ask_time(0) == [(0, 1)]
    c.loaded((0, 2), 0, tokens=True)
    c.ask_time(0)
    c.loaded((0, 3), 0, tokens=False)
    assert c.ask_time(0) == []  # behind (0, 2)'s compute
    assert c.wait_next() == [(0, 2), (0, 3)]


def test_one_demand_thread_per_device_starts_each_link_on_its_own() -> None:
    """With a demand thread per device the other device's copy starts at its own link's
    time, before the first copy landed: the first load is not computed by then."""
    single, per = ZeroTimeClock(single_demand=True), ZeroTimeClock(single_demand=False)
    for c in (single, per):
        c.ask_time(0)
        c.loaded((0, 0), 0, tokens=False)
    assert single.ask_time(1) == [(0, 0)]
    assert per.ask_time(1) == []
    assert per.ask_time(0) == [(0, 0)]
