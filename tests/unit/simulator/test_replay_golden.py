"""The replay's decisions, metrics and series are pinned: same values as before the
prediction-set bookkeeping and the prefetch queue became one implementation shared with the
engine (:mod:`moeexp.prefetching`), and before ``simulate`` was split into steps."""

from __future__ import annotations

import json

import pytest
from tests.fixtures.replay_cases import CASES, GOLDEN, run_case, same


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_matches_golden_to_the_bit(case: str, golden: dict) -> None:
    """Every metric (wall-clock ones aside) and every series value equals the recorded one
    exactly (same type, same float bits, NaN where NaN)."""
    got = json.loads(json.dumps(run_case(case)))
    want = golden[case]
    assert got["metrics"].keys() == want["metrics"].keys()
    bad = [k for k in want["metrics"] if not same(got["metrics"][k], want["metrics"][k])]
    assert not bad, {k: (got["metrics"][k], want["metrics"][k]) for k in bad}
    assert got["series"].keys() == want["series"].keys()
    bad = [k for k in want["series"] if not same(got["series"][k], want["series"][k])]
    assert not bad, bad
