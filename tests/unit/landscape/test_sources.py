"""Routing sources: typed specs, the run's trace, synthetic and imported traces."""

from __future__ import annotations

import pytest

from moeexp.errors import ConfigError
from moeexp.landscape.sources import (
    ImportedSourceSpec,
    RunSourceSpec,
    SyntheticSourceSpec,
    build_source,
    source_spec,
)
from moeexp.traces.synthetic import random_trace


def test_specs_are_typed_and_checked() -> None:
    """Each kind has its own keys; a misspelled one names the closest; bad values fail."""
    assert isinstance(source_spec({"name": "a", "kind": "run"}), RunSourceSpec)
    syn = source_spec({"name": "s", "kind": "synthetic", "num_layers": 4})
    assert isinstance(syn, SyntheticSourceSpec) and syn.num_layers == 4
    imp = source_spec({"name": "g", "kind": "imported", "source": "gpt_oss_20b",
                       "model": "gpt_oss_20b"})
    assert isinstance(imp, ImportedSourceSpec) and imp.request_filter == "non_repetitive"
    with pytest.raises(ConfigError, match="kind='web'"):
        source_spec({"name": "x", "kind": "web"})
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        source_spec({"name": "x", "kind": "synthetic", "num_layer": 4})
    with pytest.raises(ConfigError, match="max_test_requests"):
        source_spec({"name": "x", "kind": "run", "max_test_requests": 0})
    with pytest.raises(ConfigError, match="request_filter"):
        source_spec({"name": "x", "kind": "imported", "source": "s", "model": "m",
                     "request_filter": "some"})


def test_run_and_synthetic_sources() -> None:
    """kind run takes the pipeline's splits (first N test requests when capped); kind
    synthetic is a seeded random_trace split by request."""
    tr = random_trace(num_requests=10, seed=0)
    test, store = tr.split("test"), tr.split("store")
    src = build_source(source_spec({"name": "r", "kind": "run", "max_test_requests": 2}),
                       test, store)
    assert [r.request_id for r in src.test.requests] == [r.request_id
                                                         for r in test.requests[:2]]
    assert src.store is store
    with pytest.raises(ConfigError, match="needs the run's trace"):
        build_source(source_spec({"name": "r", "kind": "run"}))
    a = build_source(source_spec({"name": "s", "kind": "synthetic", "num_layers": 6,
                                  "num_requests": 10, "seed": 3}))
    b = build_source(source_spec({"name": "s", "kind": "synthetic", "num_layers": 6,
                                  "num_requests": 10, "seed": 3}))
    assert a.test.dims.num_layers == 6 and len(a.test.requests) == 3
    assert (a.test.topk_idx == b.test.topk_idx).all()
    assert {r.split for r in a.store.requests} == {"store"}  # type: ignore[union-attr]


def test_imported_gpt_oss_source() -> None:
    """The shipped gpt-oss-20b trace on its preset's arch dims: decode only, L 24, J 32,
    K 4, split by request, no test request in the store."""
    src = build_source(source_spec({"name": "g", "kind": "imported", "source": "gpt_oss_20b",
                                    "model": "gpt_oss_20b", "max_test_requests": 2}))
    d = src.test.dims
    assert (d.num_layers, d.num_experts, d.top_k) == (24, 32, 4)
    assert len(src.test.requests) == 2 and "prefill" not in src.test.capabilities
    assert src.store is not None
    assert not {r.request_id for r in src.test.requests} & {r.request_id
                                                            for r in src.store.requests}
    with pytest.raises(ConfigError, match="unknown model 'nope'. Valid model names"):
        build_source(source_spec({"name": "g", "kind": "imported", "source": "gpt_oss_20b",
                                  "model": "nope"}))
