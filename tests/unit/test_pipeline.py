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


def test_a_format_the_model_cannot_take_is_refused_with_the_valid_ones():
    """model.expert_format on the loaded model's own experts: checked on their shapes (the
    pipeline does it on the meta-device probe, before the load); a projection skips it."""
    from types import SimpleNamespace

    import pytest

    from moeexp.errors import ConfigError
    from moeexp.models.adapters import adapter_for
    from moeexp.models.toy_configs import toy_model
    from moeexp.pipeline import check_model_format

    adapter = adapter_for(toy_model("mixtral"))  # experts 96x32 and 32x48

    def spec(fmt, as_model=None):
        return SimpleNamespace(model=SimpleNamespace(name="m", expert_format=fmt),
                               cost=SimpleNamespace(as_model=as_model))

    with pytest.raises(ConfigError, match=r"model=m: expert_format=int4: its groups of 128 .*"
                                          r"can hold .*: dense, int8 \(all formats"):
        check_model_format(spec("int4"), adapter)
    check_model_format(spec("int8"), adapter)
    check_model_format(spec("int4", as_model="mixtral_8x7b"), adapter)


def test_a_recorded_trace_prices_the_models_experts_in_its_format():
    """No projection: the cost model's expert bytes are the loaded model's experts in
    model.expert_format (formats.py's bits; the routing stays the recording's)."""
    from types import SimpleNamespace

    from moeexp.costmodel.hardware import load_profile
    from moeexp.models.adapters import adapter_for
    from moeexp.models.toy_configs import toy_model
    from moeexp.pipeline import _cost_model
    from moeexp.traces.recorder import trace_dims

    model = toy_model("mixtral")  # fp32 experts 96x32 + 32x48 = 4608 weights
    loaded = SimpleNamespace(model=model, adapter=adapter_for(model))
    tr = SimpleNamespace(dims=trace_dims(loaded.adapter, 0))

    def cost(fmt):
        spec = SimpleNamespace(model=SimpleNamespace(name="m", expert_format=fmt, dtype="float32"),
                               cost=SimpleNamespace(as_model=None, projected=False),
                               hardware=load_profile("rtx3090_pcie4"))
        return _cost_model(spec, tr, loaded)

    assert cost("dense").expert_bytes == 4608 * 4
    assert cost("int8").expert_bytes == 4608 + 2 * (96 + 32)  # a bf16 scale per stored row
