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


def test_npz_swapped_for_another_traces_is_refused(tmp_path):
    """Issue 14 case 1: A's sidecar with B's arrays (same shapes, a partial copy or a
    mixed cluster sync) is refused by the array digest, not replayed silently."""
    io.save(random_trace(seed=1), tmp_path / "a")
    io.save(random_trace(seed=2), tmp_path / "b")
    (tmp_path / "a.npz").write_bytes((tmp_path / "b.npz").read_bytes())
    with pytest.raises(TraceError, match="not the ones its sidecar was written with"):
        io.load(tmp_path / "a")


def test_edited_split_labels_are_refused(tmp_path):
    """Issue 14 case 2: flipping one request's split in the sidecar is detected."""
    io.save(random_trace(), tmp_path / "t")
    side = tmp_path / "t.json"
    meta = json.loads(side.read_text())
    meta["requests"][0]["split"] = "test" if meta["requests"][0]["split"] == "store" else "store"
    side.write_text(json.dumps(meta))
    with pytest.raises(TraceError, match="modified after it was written"):
        io.load(tmp_path / "t")


def test_routing_only_trace_round_trips(tmp_path):
    """A trace without probs, embed and token_ids (an imported one) saves and loads; its
    capabilities say what it lacks and router_probs scatters the top-k weights."""
    t = random_trace(spec_depth=0)
    t.probs = t.embed = t.token_ids = None
    io.save(t, tmp_path / "r")
    back = io.load(tmp_path / "r")
    assert back.probs is None and back.embed is None and back.token_ids is None
    assert {"router_probs", "embed", "token_ids", "spec_probs"}.isdisjoint(back.capabilities)
    dense = back.router_probs(slice(0, 3), 1)
    assert dense.shape == (3, t.dims.num_experts)
    np.testing.assert_array_equal(np.sort(dense, axis=1)[:, -t.dims.top_k:],
                                  np.sort(t.topk_weight[:3, 1], axis=1))
    assert json.loads((tmp_path / "r.json").read_text())["capabilities"] == sorted(back.capabilities)
