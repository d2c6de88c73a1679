"""The link on its own: counters, and the chunked overtake/resume rules
(:mod:`moeexp.simulator.link`). Cost: :func:`simhelpers.unit_cost` (a copy 1.0 s);
``copy_chunk_mb=250`` cuts the 1 GB expert into four 0.25 s chunks."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.simulator.simhelpers import hand_trace, unit_cost, unit_profile

from moeexp.costmodel import CostModel
from moeexp.simulator.link import Link

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
