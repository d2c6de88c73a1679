"""The prefetch queue and prediction-set rules shared by the simulator and the engine."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.predictors.base import Prediction, Prefetch
from moeexp.prefetching import PredictionSets, PrefetchQueue


def test_priority_dedupe_and_drops() -> None:
    """(2,1) asked at 1.0 then 5.0 is queued once at 5.0; (0,3) targets a layer <= current
    (0) and is dropped; resident (3,0) is skipped; pop order: 5.0 then 2.0."""
    q = PrefetchQueue(4, 4)
    n = q.push([Prefetch(1.0, 2, 1), Prefetch(5.0, 2, 1), Prefetch(2.0, 3, 2),
                Prefetch(9.0, 0, 3), Prefetch(9.0, 3, 0)], current_layer=0,
               resident={(3, 0)})
    assert n == 3 and len(q) == 2 and q.dropped == 1
    assert q.pop(current_layer=0) == ((2, 1), 0.0)
    assert q.pop(current_layer=2) == ((3, 2), 0.0)
    assert q.pop(current_layer=2) is None


def test_lower_or_equal_priority_changes_nothing_and_ties_are_fifo() -> None:
    """(1,0) at 3.0 asked again at 3.0 and 1.0 keeps its place; (1,1) and (1,2) at 2.0 pop in
    the order they were pushed."""
    q = PrefetchQueue(2, 4)
    assert q.push([Prefetch(3.0, 1, 0), Prefetch(2.0, 1, 2), Prefetch(2.0, 1, 1)], -1, set()) == 3
    assert q.push([Prefetch(3.0, 1, 0), Prefetch(1.0, 1, 0)], -1, set()) == 0
    assert [q.pop(-1)[0] for _ in range(3)] == [(1, 0), (1, 2), (1, 1)]  # type: ignore[index]


def test_pop_drops_passed_layers_and_clear() -> None:
    q = PrefetchQueue(4, 4)
    q.push([Prefetch(3.0, 1, 0), Prefetch(2.0, 3, 1)], current_layer=-1, resident=set())
    assert q.pop(current_layer=2) == ((3, 1), 0.0)  # (1, 0) is for a layer that already ran
    assert q.dropped == 1
    q.push([Prefetch(1.0, 2, 2)], current_layer=-1, resident=set())
    q.clear()
    assert len(q) == 0 and q.dropped == 2 and q.pop(-1) is None
    q.drop()
    assert q.dropped == 3


def test_pop_starts_when_free_and_not_before_the_push() -> None:
    """The simulator's clock: a request pushed at 2.0 with the copy engine free at 1.0 starts
    at 2.0; with the engine free at 3.0 it starts at 3.0; not at all if that is not before
    the next event (it stays queued)."""
    q = PrefetchQueue(2, 2)
    q.push([Prefetch(1.0, 1, 0)], current_layer=-1, resident=set(), at=2.0)
    assert q.pop(-1, free_at=3.0, before=3.0) is None and len(q) == 1
    assert q.pop(-1, free_at=1.0, before=5.0) == ((1, 0), 2.0)
    q.push([Prefetch(1.0, 1, 1)], current_layer=-1, resident=set(), at=2.0)
    assert q.pop(-1, free_at=3.0, before=5.0) == ((1, 1), 3.0)


@pytest.mark.parametrize("bad", [Prefetch(1.0, 4, 0), Prefetch(1.0, 1, 4), Prefetch(1.0, -1, 0),
                                 Prefetch(1.0, 0, 9)])
def test_out_of_range_requests_raise(bad: Prefetch) -> None:
    """Outside L x J is an error, also for a layer that already ran."""
    with pytest.raises(ValueError, match="out of range"):
        PrefetchQueue(4, 4).push([bad], current_layer=0, resident=set())


def test_prediction_sets() -> None:
    """predicted beats prefetched; a hook at layer l speaks only for layers > l."""
    ps = PredictionSets()
    ps.take(Prediction(prefetch=[Prefetch(1.0, 1, 2), Prefetch(1.0, 2, 0)]), hook_layer=-1)
    ps.take(Prediction(predicted={2: np.array([3, 4]), 0: np.array([1])}), hook_layer=0)
    assert ps.for_layer(1) == {2}
    assert ps.for_layer(2) == {3, 4}
    assert ps.for_layer(0) is None
    ps.clear()
    assert ps.for_layer(2) is None


def test_prefetched_sets_union_over_hooks_and_predicted_replaces() -> None:
    """Layer 3's P is the union of what every hook before its router prefetched for it; a
    later ``predicted`` for layer 3 replaces that union, and a later one replaces it again."""
    ps = PredictionSets()
    ps.take(Prediction(prefetch=[Prefetch(1.0, 3, 1)]), hook_layer=-1)
    ps.take(Prediction(prefetch=[Prefetch(1.0, 3, 5), Prefetch(1.0, 1, 0)]), hook_layer=1)
    assert ps.for_layer(3) == {1, 5}
    ps.take(Prediction(predicted={3: np.array([7])}), hook_layer=2)
    assert ps.for_layer(3) == {7}
    ps.take(Prediction(predicted={3: np.array([6, 2])}), hook_layer=2)
    assert ps.for_layer(3) == {2, 6}
    assert ps.for_layer(1) is None  # prefetched by the hook at layer 1 itself: not before


def test_prediction_sets_remember_only_arrays_that_cannot_change() -> None:
    """The set of a read-only array that owns its data is made once (the same object comes
    back); a writable array is read afresh at every take, so changing it changes P."""
    ps = PredictionSets()
    frozen = np.array([1, 3])
    frozen.setflags(write=False)
    ps.take(Prediction(predicted={1: frozen}), hook_layer=-1)
    first = ps.for_layer(1)
    ps.clear()
    ps.take(Prediction(predicted={1: frozen}), hook_layer=-1)
    assert ps.for_layer(1) == {1, 3} and ps.for_layer(1) is first
    live = np.array([0, 2])
    ps.take(Prediction(predicted={2: live}), hook_layer=-1)
    assert ps.for_layer(2) == {0, 2}
    live[1] = 3
    ps.take(Prediction(predicted={2: live}), hook_layer=-1)
    assert ps.for_layer(2) == {0, 3}
