"""The engine's timing-independent metrics and tokens are pinned: same values as before its
prediction sets and prefetch queue became the ones the simulator uses
(:mod:`moeexp.prefetching`) and before its layer procedure was split from its state.
``finemoe`` was re-pinned when FineMoE's prefill default became ``token_union``
(``conf/predictor/expert_map.yaml``): its prediction recall 0.717 -> 0.850 and F1 0.637 ->
0.685, every other value and every token unchanged."""

from __future__ import annotations

import json

import pytest
from tests.fixtures.engine_cases import CASES, GOLDEN, run_case
from tests.fixtures.replay_cases import same


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_golden(case: str, golden: dict, store_of) -> None:
    """Prediction accounting and access counts (and, where only decisions set the
    residency, hits, traffic and substitutions) equal the recorded ones exactly, and the
    greedy tokens are the recorded ones."""
    got = json.loads(json.dumps(run_case(case, store_of("mixtral"))))
    want = golden[case]
    assert got["tokens"] == want["tokens"]
    bad = {k: (got["metrics"].get(k), v) for k, v in want["metrics"].items()
           if not same(got["metrics"].get(k), v)}
    assert not bad, bad
