"""static: pins the store split's most used experts and never evicts them."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.static import usage_counts
from moeexp.errors import ConfigError
from moeexp.traces.synthetic import random_trace


def store():
    """L=2, J=4, K=1; 3 requests x 6 one-token iterations = 18 iterations. Layer 0 uses
    expert 2 in all of them; layer 1 uses expert 3 in every third (6) and expert 1 in the
    others (12)."""
    tr = random_trace(num_layers=2, num_experts=4, top_k=1, num_requests=3, prompt_len=1,
                      output_len=6, store_fraction=1.0, seed=0)
    n = tr.num_tokens  # 18 iterations of one token
    tr.topk_idx[:, 0, 0] = 2
    tr.topk_idx[:, 1, 0] = np.where(np.arange(n) % 3 == 0, 3, 1)
    return tr


def test_pins_the_most_used_and_serves_misses_in_scratch() -> None:
    """Uses: (0,2) 18, (1,1) 12, (1,3) 6. Capacity 3 with 1 scratch slot pins (0,2) and
    (1,1), most used first. A miss on (0,0) takes the scratch slot; the next miss (1,0) must
    evict (0,0), never a pinned expert, even when the pinned ones are the least recent."""
    c = CACHES.build("static", capacity_slots=3, num_layers=2, num_experts=4, scratch_slots=1)
    c.fit(store())
    assert c.initial_residents() == [(0, 2), (1, 1)]
    for k in c.initial_residents():
        c.on_insert(k, 0, prefetched=True)
    assert c.victim((0, 0), set(), 1) is None
    c.on_insert((0, 0), 1, prefetched=False)
    c.on_access((0, 0), 2, hit=True)
    assert c.victim((1, 0), set(), 3) == (0, 0)
    with pytest.raises(ConfigError, match="scratch_slots"):
        c.victim((1, 0), {(0, 0)}, 3)


def test_usage_counts_accesses_and_tokens() -> None:
    """A 4-token prefill routing tokens to experts 0,0,0,1 at a layer counts as one access
    of each (accesses) or 3 and 1 (tokens)."""
    tr = random_trace(num_layers=1, num_experts=4, top_k=1, num_requests=1, prompt_len=4,
                      output_len=1, store_fraction=1.0)
    tr.topk_idx[:, 0, 0] = [0, 0, 0, 1]
    assert usage_counts(tr, "accesses")[0].tolist() == [1, 1, 0, 0]
    assert usage_counts(tr, "tokens")[0].tolist() == [3, 1, 0, 0]


def test_default_scratch_and_validation() -> None:
    """Default scratch = max(1, min(J, capacity // 4)): 64 slots, J=8 -> 8; 8 slots -> 2.
    scratch 0 is invalid (misses could not be served)."""
    assert CACHES.build("static", capacity_slots=64, num_layers=32,
                        num_experts=8).scratch_slots == 8
    assert CACHES.build("static", capacity_slots=8, num_layers=4, num_experts=8).scratch_slots == 2
    with pytest.raises(ConfigError):
        CACHES.build("static", capacity_slots=8, num_layers=4, num_experts=8, scratch_slots=0)
