"""mrs: HybriMoE's minus-recent-score cache (S = a TopP(s) + (1 - a) S, lowest S of the
incoming expert's layer evicted)."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.mrs import mrs_update
from moeexp.errors import ConfigError


def build(**kw):
    return CACHES.build("mrs", capacity_slots=4, num_layers=2, num_experts=4, **kw)


def test_update_keeps_top_p_and_decays_the_rest() -> None:
    """alpha 0.5, top_p 2: S = [0.4, 0, 0, 0.2], s = [0.1, 0.5, 0.3, 0.1] -> the top 2 of s
    are experts 1 and 2: S = [0.2, 0.25, 0.15, 0.1] (0 and 3 halved, 1 and 2 half s plus half S)."""
    row = np.array([0.4, 0.0, 0.0, 0.2])
    mrs_update(row, np.array([0.1, 0.5, 0.3, 0.1]), 0.5, 2)
    np.testing.assert_allclose(row, [0.2, 0.25, 0.15, 0.1])


def test_victim_is_lowest_score_of_the_incoming_layer() -> None:
    """Layer 0 holds (0,0) and (0,1); layer 1 holds (1,0) with score 0 (lowest overall).
    Scores make (0,0) the lower of layer 0 although it was used last: incoming (0,2) evicts
    (0,0), never (1,0); protected (0,0) -> (0,1). Without scores the tie falls to LRU."""
    c = build()
    for t, k in enumerate([(1, 0), (0, 1), (0, 0)]):
        c.on_insert(k, t, prefetched=False)
    c.observe_scores({0: np.array([0.1, 0.6, 0.3, 0.0])})
    c.on_insert((0, 3), 3, prefetched=False)
    assert c.victim((0, 2), set(), 4) == (0, 3)  # score 0 in layer 0
    c.on_evict((0, 3))
    c.on_insert((0, 3), 5, prefetched=False)
    c.observe_scores({0: np.array([0.1, 0.6, 0.3, 0.4])})  # (0,0): 0.1, (0,1): 0.6, (0,3): 0.2
    assert c.victim((0, 2), set(), 6) == (0, 0)
    assert c.victim((0, 2), {(0, 0)}, 6) == (0, 3)
    lru = build()  # no scores: least recently used of the layer
    for t, k in enumerate([(0, 1), (0, 0)]):
        lru.on_insert(k, t, prefetched=False)
    assert lru.victim((0, 2), set(), 2) == (0, 1)


def test_bad_settings_refused() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        build(alpha=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        build(top_p=5)
