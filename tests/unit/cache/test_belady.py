"""``belady``: furthest next use goes; prefetches may only make MIN's own replacements."""

from __future__ import annotations

import pytest

from moeexp.cache.belady import BeladyCache, PrefetchRefused
from moeexp.errors import ConfigError

A, B, C, D = (0, 0), (0, 1), (1, 0), (1, 1)


def _cache(stream, slots=2, rule="conservative"):  # type: ignore[no-untyped-def]
    c = BeladyCache(capacity_slots=slots, num_layers=2, num_experts=2, prefetch_rule=rule)
    c.prepare_future(stream)
    return c


def test_evicts_furthest_next_use_on_a_hand_sequence() -> None:
    """Stream A B C A B D A (2 slots). At position 2 (C misses, A and B resident) A is next
    used at 3, B at 4: B goes. At 5 (D misses, resident A and C): A is used at 6, C never
    again: C goes. Demand loads pass their own key as protected, as the simulator does."""
    stream = [A, B, C, A, B, D, A]
    c = _cache(stream)
    c.on_insert(A, 0, False)
    c.on_access(A, 0, False)
    c.on_insert(B, 1, False)
    c.on_access(B, 1, False)
    assert c.next_use(A, 2) == 3 and c.next_use(B, 2) == 4 and c.next_use(C, 3) == float("inf")
    assert c.victim(C, {C}, 2) == B
    c.on_evict(B)
    c.on_insert(C, 2, False)
    c.on_access(C, 2, False)
    c.on_access(A, 3, True)
    assert c.victim(B, {B}, 4) == C  # C is never used again; A at 6


def test_min_schedule_is_recorded() -> None:
    """MIN on A B C A B (2 slots, empty at first): A and B fill free slots; C misses at 2
    and evicts B (A is used at 3, B at 4; B last used at 1); B misses at 4 when A and C
    are both never used again: the tie goes to the smaller key, A (last used at 3)."""
    c = _cache([A, B, C, A, B])
    assert c._room_misses == {0, 1}
    assert c._schedule == {2: (B, 1), 4: (A, 3)}


def test_prefetch_rules() -> None:
    """Stream A B C B, 2 slots; A and B were loaded before access 0.

    MIN: C misses at 2 and evicts A (A is not used again, B is used at 3); A's last use
    before 2 is position 0.
    * ``conservative``: prefetching C at now=0 (A about to be used) is refused; after A's
      use (now=1) it evicts A.
    * ``do_no_harm`` at now=0: the furthest next use is B's (1) < C's (2): refused; at
      now=1 A (never used again) goes.
    * ``any`` at now=0 evicts the furthest, B -- the harm the rules prevent.
    """
    stream = [A, B, C, B]
    caches = {rule: _cache(stream, rule=rule) for rule in BeladyCache.RULES}
    for c in caches.values():
        c.on_insert(A, 0, True)
        c.on_insert(B, 0, True)
    assert caches["conservative"]._schedule[2] == (A, 0)
    with pytest.raises(PrefetchRefused):
        caches["conservative"].victim(C, set(), 0)
    with pytest.raises(PrefetchRefused):
        caches["do_no_harm"].victim(C, set(), 0)
    assert caches["any"].victim(C, set(), 0) == B
    for rule in ("conservative", "do_no_harm"):
        caches[rule].on_access(A, 0, True)
        assert caches[rule].victim(C, set(), 1) == A


def test_demand_waits_when_min_victim_is_still_computing() -> None:
    """A demand load whose MIN victim is protected (an expert of the running layer still
    computing) raises ConfigError: the simulator waits for it and asks again."""
    stream = [A, B, C]
    c = _cache(stream)
    for k in (A, B):
        c.on_insert(k, -1, False)
    with pytest.raises(ConfigError):
        c.victim(C, {A, C}, 2)
    assert c.victim(C, {C}, 2) == A


def test_needs_prepare_future_and_valid_rule() -> None:
    """Without the future stream a victim query fails clearly; rules are checked."""
    c = BeladyCache(capacity_slots=1, num_layers=1, num_experts=2)
    c.on_insert(A, 0, False)
    with pytest.raises(ConfigError, match="prepare_future"):
        c.victim(B, {B}, 0)
    with pytest.raises(ConfigError, match="prefetch_rule"):
        BeladyCache(capacity_slots=1, num_layers=1, num_experts=2, prefetch_rule="nope")


def test_aggressive_rule_prefetches_without_harm_and_never_waits() -> None:
    """``aggressive`` (Cao et al.'s Aggressive rule). Stream A B C B, A and B loaded:
    prefetching C at now=0 would evict B (used at 1, before C at 2): refused; once A has
    been used (now=1) A, never used again, goes. A demand load never waits for MIN's victim:
    stream A B C with A protected (still computing), C's load evicts B, the furthest
    unprotected expert, where the MIN-following rules raise and make the mechanism wait."""
    c = _cache([A, B, C, B], rule="aggressive")
    c.on_insert(A, 0, True)
    c.on_insert(B, 0, True)
    with pytest.raises(PrefetchRefused):
        c.victim(C, set(), 0)
    c.on_access(A, 0, True)
    assert c.victim(C, set(), 1) == A
    d = _cache([A, B, C], rule="aggressive")
    for k in (A, B):
        d.on_insert(k, -1, False)
    assert d.victim(C, {A, C}, 2) == B
    assert d._schedule == {}  # MIN's plan is never consulted, so never computed


def test_refusal_message_is_formatted_when_read() -> None:
    """A refusal carries its format and values; ``str`` says which prefetch and why."""
    c = _cache([A, B, C, B])
    c.on_insert(A, 0, True)
    c.on_insert(B, 0, True)
    with pytest.raises(PrefetchRefused, match=r"belady: MIN makes no room for \(1, 0\) now"):
        c.victim(C, set(), 0)
    assert str(PrefetchRefused("50 % full")) == "50 % full"  # a plain message stays as is


def test_furthest_search_after_untracked_accesses() -> None:
    """The victim heaps are built only at the first search that needs them, from the next
    uses kept so far, and follow every later access. Stream A B C D A B, 2 slots, the
    residents B and D (not MIN's: its plan's victims are absent, so demand loads search).
    After D's access at 3 (next uses: B 5, D never), C's load at 4 evicts D; then with A
    (used at 4, never again) and B (next used at 5) resident, D's load at 5 evicts A: the
    heaps saw A's access after they were built."""
    c = _cache([A, B, C, D, A, B], rule="conservative")
    c.on_insert(B, -1, False)
    c.on_insert(D, -1, False)
    c.on_access(D, 3, True)
    assert not c._heaps
    assert c.victim(C, {C}, 4) == D
    assert c._heaps
    c.on_evict(D)
    c.on_insert(A, 4, False)
    c.on_access(A, 4, False)
    assert c.victim(D, {D}, 5) == A
