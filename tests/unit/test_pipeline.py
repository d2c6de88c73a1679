"""The pipeline's store split: disjoint from the test split by default; the authors' demo
leak (dataset.store_leak=artifact_demo) only by name, with a warning."""

from __future__ import annotations

import logging

import numpy as np

from moeexp.pipeline import store_split
from moeexp.predictors.expert_map import ExpertMapPredictor
from moeexp.traces.synthetic import random_trace


def _trace():
    return random_trace(num_layers=3, num_experts=4, top_k=1, hidden_size=4, num_requests=10,
                        prompt_len=3, output_len=4, seed=0)


def test_the_default_store_split_is_disjoint_from_the_test_split(caplog):
    """store_leak null: the store holds exactly the store requests, none of the test ones,
    and nothing is logged as a leak; a predictor fitted on it stores no test request."""
    tr = _trace()
    with caplog.at_level(logging.WARNING, logger="moeexp.pipeline"):
        store = store_split(tr, None, "finemoe")
    test_ids = {r.request_id for r in tr.split("test").requests}
    assert {r.request_id for r in store.requests} == {
        r.request_id for r in tr.requests if r.split == "store"}
    assert test_ids and test_ids.isdisjoint(r.request_id for r in store.requests)
    pred = ExpertMapPredictor(dims=tr.dims, prefetch_distance=1)
    pred.fit(store)
    assert test_ids.isdisjoint(pred.store.request[: pred.store.size].tolist())
    assert "store_leak" not in caplog.text


def test_the_artifact_demo_leak_puts_every_test_request_in_the_store(caplog):
    """store_leak=artifact_demo: every request, the test ones relabelled store (so the
    predictors' guards, which drop other splits, keep them): a fitted expert-map store
    holds rows of every test request, with their own routing; a warning names the run."""
    tr = _trace()
    with caplog.at_level(logging.WARNING, logger="moeexp.pipeline"):
        store = store_split(tr, "artifact_demo", "finemoe+store_leak=artifact_demo")
    test = tr.split("test")
    assert [r.request_id for r in store.requests] == [r.request_id for r in tr.requests]
    assert all(r.split == "store" for r in store.requests)
    assert np.array_equal(store.topk_idx, tr.topk_idx)
    pred = ExpertMapPredictor(dims=tr.dims, prefetch_distance=1, store_capacity=1000)
    pred.fit(store)
    stored = set(pred.store.request[: pred.store.size].tolist())
    assert {r.request_id for r in test.requests} <= stored
    assert "finemoe+store_leak=artifact_demo: dataset.store_leak=artifact_demo" in caplog.text
    assert f"the {len(test.requests)} test requests are in the store too" in caplog.text
    assert all(r.split == "test" for r in tr.split("test").requests)  # the trace unchanged
