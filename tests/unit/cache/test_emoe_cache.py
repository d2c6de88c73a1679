"""emoe cache: evict outside the predicted set first, then the lowest predicted score."""

from __future__ import annotations

import numpy as np

from moeexp.cache import CACHES


def test_keeps_the_predicted_set() -> None:
    """Set for layer 0 = {1 (score .7), 2 (.3)}. Residents (0,1) t=0, (0,2) t=1, (0,3) t=5,
    (0,0) t=6 (most recent); capacity 4 is full and (1,0) comes in. (0,3) and (0,0) are outside the set -> the LRU of them, (0,3),
    goes first although (0,1) is older; with both protected the lowest-score member (0,2)."""
    c = CACHES.build("emoe", capacity_slots=4, num_layers=2, num_experts=4)
    c.observe_scores({0: np.array([0.0, 0.7, 0.3, 0.0])})
    for t, e in [(0, 1), (1, 2), (5, 3), (6, 0)]:
        c.on_insert((0, e), t, prefetched=True)
    assert c.victim((1, 0), set(), 7) == (0, 3)
    assert c.victim((1, 0), {(0, 3), (0, 0)}, 7) == (0, 2)
