"""Trace schema round trip and failure modes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeexp.errors import TraceError
from moeexp.traces import io
from moeexp.traces.synthetic import random_trace


def test_round_trip(tmp_path):
    t = random_trace(with_hidden=True, seed=1)
    io.save(t, tmp_path / "t")
    back = io.load(tmp_path / "t")
    assert back.dims == t.dims and back.requests == t.requests
    for k in ("probs", "topk_idx", "embed", "spec_probs", "hidden", "iter_offsets"):
        np.testing.assert_array_equal(getattr(back, k), getattr(t, k))


def test_split_is_disjoint_and_complete():
    t = random_trace(num_requests=10)
    s, q = t.split("store"), t.split("test")
    ids_s = {r.request_id for r in s.requests}
    ids_q = {r.request_id for r in q.requests}
    assert ids_s.isdisjoint(ids_q) and len(ids_s | ids_q) == 10
    assert s.num_tokens + q.num_tokens == t.num_tokens
    s.validate()
    q.validate()


def test_old_schema_rejected(tmp_path):
    io.save(random_trace(), tmp_path / "t")
    side = tmp_path / "t.json"
    meta = json.loads(side.read_text())
    meta["schema_version"] = 0
    side.write_text(json.dumps(meta))
    with pytest.raises(TraceError, match="schema version"):
        io.load(tmp_path / "t")


def test_corrupt_arrays_rejected(tmp_path):
    io.save(random_trace(), tmp_path / "t")
    (tmp_path / "t.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="corrupt"):
        io.load(tmp_path / "t")


def test_iteration_counts_match_topk():
    t = random_trace()
    c = t.iteration_counts(0)
    assert c.sum() == t.dims.num_layers * t.dims.top_k * t.token_slice(0).stop
