"""The link on its own: counters, and the chunked overtake/resume rules
(:mod:`moeexp.simulator.link`). Cost: :func:`simhelpers.unit_cost` (a copy 1.0 s);
``copy_chunk_mb=250`` cuts the 1 GB expert into four 0.25 s chunks."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.simulator.simhelpers import hand_trace, unit_cost, unit_profile

from moeexp.costmodel import CostModel
from moeexp.simulator.link import HostLimit, Link

DIMS = hand_trace([[[[[0], [1]]]]], 2).dims


def _chunked() -> Link:
    prof = dataclasses.replace(unit_profile(), copy_chunk_mb=250.0)
    return Link(CostModel.from_profile(prof, DIMS, dtype_bytes=2))


def test_bytes_and_busy_seconds_count_started_copies() -> None:
    """Three copies of a 1 GB expert at 1.0 s each: 3 GB, 3.0 s busy."""
    link = Link(unit_cost(DIMS))
    link.copies += 3
    assert link.bytes == 3 * 10**9 and link.busy_s == pytest.approx(3.0)


def test_whole_expert_copies_are_never_overtaken() -> None:
    link = Link(unit_cost(DIMS))
    link.free, link.onlink = 1.0, None
    assert link.overtake(0.3, cur_layer=0) == (1.0, 0.0) and link.preemptions == 0


def test_a_demand_load_overtakes_at_the_next_chunk_boundary_and_the_prefetch_resumes() -> None:
    """A prefetch of layer 1 runs 0 -> 1.0 in four chunks; a demand load at 0.3 gets the link
    at the boundary 0.5, with 0.5 s of the prefetch left; resumed at 2.0 it ends at 2.5."""
    link = _chunked()
    link.free, link.onlink = 1.0, ((1, 0), 0.0, 1.0)
    assert link.overtake(0.3, cur_layer=0) == (pytest.approx(0.5), pytest.approx(0.5))
    assert link.preemptions == 1
    key, was, end = link.resume(2.0, 0.5)
    assert (key, was, end) == ((1, 0), 1.0, pytest.approx(2.5))
    assert link.free == pytest.approx(2.5) and link.onlink == ((1, 0), 2.0, pytest.approx(2.5))


def test_a_prefetch_for_the_running_layer_or_in_its_last_chunk_is_not_overtaken() -> None:
    link = _chunked()
    link.free, link.onlink = 1.0, ((0, 1), 0.0, 1.0)
    assert link.overtake(0.3, cur_layer=0) == (1.0, 0.0)  # the layer waits for it anyway
    link.onlink = ((1, 0), 0.0, 1.0)
    assert link.overtake(0.8, cur_layer=0) == (1.0, 0.0)  # its last chunk is on the link
    assert link.preemptions == 0


def test_host_limit_caps_the_sum_of_the_links_rates() -> None:
    """Two links of 1 GB/s behind a 1 GB/s host limit: two 1 GB copies started together end
    at 1.0 and 2.0 (one after the other through the host); at 2 GB/s both end at 1.0;
    the link that waited counts the wait as busy time."""
    cost = unit_cost(DIMS)
    for gbps, ends in ((1.0, (1.0, 2.0)), (2.0, (1.0, 1.0)), (1.5, (1.0, 2 / 1.5))):
        a, b = Link(cost), Link(cost)
        a.host = b.host = HostLimit(gbps, cost.expert_bytes)
        a.copies = b.copies = 1
        assert (a.finish(0.0), b.finish(0.0)) == pytest.approx(ends)
        assert (a.busy_s, b.busy_s) == pytest.approx(ends)


def test_host_limit_below_one_link_slows_it() -> None:
    """One 1 GB/s link behind a 0.5 GB/s limit: back-to-back copies take 2.0 s each."""
    cost = unit_cost(DIMS)
    link = Link(cost)
    link.host = HostLimit(0.5, cost.expert_bytes)
    assert link.finish(0.0) == pytest.approx(2.0) and link.finish(2.0) == pytest.approx(4.0)


def test_host_limit_above_the_links_changes_nothing() -> None:
    """A limit at a link's rate: a copy alone ends at ``start + copy_s``, bit for bit."""
    cost = unit_cost(DIMS)
    link = Link(cost)
    link.host = HostLimit(1.0, cost.expert_bytes)
    assert link.finish(0.25) == 0.25 + cost.copy_s and link.finish(5.0) == 5.0 + cost.copy_s
    assert link.held_s == 0.0
