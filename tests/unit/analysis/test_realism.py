"""The realism card's statistics on hand-built routing-only traces."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.analysis.realism import interlayer_recall, load_balance, temporal_reuse, top1_weight
from moeexp.traces.interchange import ExternalRouting, to_trace
from moeexp.traces.schema import TraceDims

DIMS = TraceDims(num_layers=2, num_experts=4, top_k=2, hidden_size=8, spec_depth=0,
                 expert_bytes=1)


def _trace(experts: list[list[list[int]]], lengths: list[int], splits: list[str]):
    e = np.asarray(experts, dtype=np.int16)
    w = np.tile(np.asarray([0.75, 0.25], dtype=np.float16), (*e.shape[:2], 1))
    ext = ExternalRouting(info={"num_layers": 2, "num_experts": 4, "top_k": 2}, experts=e,
                          weights=w, offsets=np.concatenate([[0], np.cumsum(lengths)]),
                          requests=[{} for _ in lengths])
    return to_trace(ext, DIMS, splits)  # type: ignore[arg-type]


def test_temporal_reuse_counts_only_the_same_requests_previous_token():
    """Request 0: tokens [0,1] then [1,2] at both layers -> 1 of 2 shared; request 1's first
    token follows request 0's last but is not compared. Reuse = 0.5."""
    tr = _trace([[[0, 1], [0, 1]], [[1, 2], [1, 2]], [[3, 0], [3, 0]]], [2, 1], ["store", "test"])
    assert temporal_reuse(tr) == pytest.approx(0.5)
    assert top1_weight(tr) == pytest.approx(0.75)


def test_interlayer_recall_learns_a_deterministic_mapping():
    """Layer 1 = layer 0 + 2 (mod 4) on every token: the store table predicts the test
    tokens' layer-1 experts exactly (recall 1); even load gives balance 1."""
    rows = [[[a, (a + 1) % 4], [(a + 2) % 4, (a + 3) % 4]] for a in (0, 2, 0, 2)]
    tr = _trace(rows, [2, 2], ["store", "test"])
    assert interlayer_recall(tr.split("store"), tr.split("test")) == pytest.approx(1.0)
    assert load_balance(tr) == pytest.approx(1.0)
