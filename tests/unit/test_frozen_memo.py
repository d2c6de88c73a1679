"""The frozen-array memo: values kept only for arrays that cannot change, by identity."""

from __future__ import annotations

import numpy as np

from moeexp.frozen_memo import FrozenMemo, is_frozen


def test_only_read_only_owning_arrays_are_remembered_and_by_identity() -> None:
    memo: FrozenMemo[str] = FrozenMemo(capacity=2)
    frozen = np.arange(3.0)
    frozen.setflags(write=False)
    live, view = np.arange(3.0), frozen[1:]
    assert is_frozen(frozen) and not is_frozen(live) and not is_frozen(view)
    for a in (frozen, live, view):
        memo.put(a, "x")
    assert memo.get(frozen) == "x" and memo.get(live) is None and memo.get(view) is None
    twin = frozen.copy()
    twin.setflags(write=False)
    assert memo.get(twin) is None  # equal values, another array
    memo.put(twin, "y")
    assert len(memo) == 2
    third = np.zeros(1)
    third.setflags(write=False)
    memo.put(third, "z")  # full: cleared, then this one kept
    assert len(memo) == 1 and memo.get(frozen) is None and memo.get(third) == "z"
