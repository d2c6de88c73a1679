"""``Predictor.preview_pass`` is a speed hook only: with it, every hook returns exactly what
it returns without it (the same experts, priorities and score rows, bit for bit), and a
replay's metrics are identical."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from tests.unit.simulator.simhelpers import unit_cost

from moeexp.cache import CACHES
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import (
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    RequestStart,
    layer_observations,
)
from moeexp.simulator import simulate
from moeexp.traces.schema import Trace
from moeexp.traces.synthetic import random_trace

#: predictor config, cache name: every predictor that previews, in its variants
CASES = [
    ({"name": "expert_map", "prefetch_distance": 2}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "prefill": "token_union"}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 1, "use_semantic": False}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "use_delta": False}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "map_granularity": "iteration",
      "embed_pooling": "mean"}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "mode": "online"}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "selection": "v0_tail",
      "prefill": "token_union"}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "selection": "v1_window"}, "finemoe"),
    ({"name": "expert_map", "prefetch_distance": 2, "selection": "v0_tail", "mode": "online"},
     "finemoe"),
    ({"name": "eam"}, "moe_infinity"),
    ({"name": "eam", "variant": "oss"}, "moe_infinity"),
    ({"name": "learned_mlp", "distance": 2, "epochs": 2, "holdout": 0.0, "progress": False},
     "lru"),
    ({"name": "speculative_gate", "distance": 1}, "lru_per_layer"),
    ({"name": "promoe", "distance": 3}, "lru"),
    ({"name": "promoe", "distance": 1}, "finemoe"),
    # emoe: periods such that a prompt's prediction reads a previewed prompt's history
    ({"name": "emoe", "steps": 20, "period": 1}, "emoe"),
    ({"name": "emoe", "steps": 20, "period": 2}, "emoe"),
    ({"name": "emoe", "steps": 20, "period": 1, "variant": "emoe_a"}, "emoe"),
    # reuse_prob: its one-token passes' trajectory kNN, with and without each kNN column
    ({"name": "reuse_prob", "depth": 2}, "next_use"),
    ({"name": "reuse_prob", "depth": 3, "knn_within": False}, "next_use"),
    ({"name": "reuse_prob", "depth": 1, "knn_ahead": False, "horizon": False}, "next_use"),
    ({"name": "reuse_prob", "depth": 2, "knn": False}, "next_use"),
]


def _trace() -> Trace:
    return random_trace(num_layers=6, num_experts=6, top_k=2, hidden_size=8, num_requests=12,
                        prompt_len=5, output_len=6, with_hidden=True, spec_depth=2, seed=11)


def _replay(cfg: dict, cache_name: str, batch_size: int, previews: bool) -> dict[str, float]:
    trace = _trace()
    args = {k: v for k, v in cfg.items() if k != "name"}
    pred = PREDICTORS.build(cfg["name"], dims=trace.dims, **args)
    pred.previews = previews  # type: ignore[misc]
    pred.fit(trace.split("store"))
    d = trace.dims
    cache = CACHES.build(cache_name, capacity_slots=9, num_layers=d.num_layers,
                         num_experts=d.num_experts)
    m = simulate(trace.split("test"), pred, cache, unit_cost(d), batch_size=batch_size,
                 progress=False).metrics
    return {k: v for k, v in m.items()
            if not (k in ("wall_s", "sim_wall_s", "accesses_per_s", "predictor_train_s")
                    or "query_us" in k)}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        for k in a)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize(("cfg", "cache_name"), CASES)
def test_replay_metrics_identical_with_and_without_preview(cfg: dict, cache_name: str,
                                                           batch_size: int) -> None:
    """Hit rate, bytes, latencies, prediction recall: the same floats either way."""
    with_preview = _replay(cfg, cache_name, batch_size, previews=True)
    without = _replay(cfg, cache_name, batch_size, previews=False)
    assert _same(with_preview, without)


def _hooks(pred: Predictor, trace: Trace, preview: str) -> list[Prediction]:
    """Every hook's Prediction over ``trace``'s iterations (one request each, started
    at its first iteration and ended after its last).

    ``preview``: ``none``; ``same`` (the observations previewed are the ones observed);
    ``other`` (equal copies are observed: the predictor must notice and compute anew)."""
    out = []
    L = trace.dims.num_layers
    assert trace.embed is not None and trace.probs is not None and trace.hidden is not None
    assert trace.spec_probs is not None
    last = {int(r): it for it, r in enumerate(trace.iter_request)}
    started: set[int] = set()
    for it in range(trace.num_iterations):
        sl, rid = trace.token_slice(it), int(trace.iter_request[it])
        T = sl.stop - sl.start
        if rid not in started:
            started.add(rid)
            out.append(pred.start_request(RequestStart(request=trace.request(rid))))
        out.append(pred.start_iteration(IterationStart(
            request_ids=np.array([rid]), step=int(trace.iter_step[it]),
            embed=trace.embed[sl].astype(np.float32), token_request=np.full(T, rid))))
        probs = np.ascontiguousarray(np.swapaxes(trace.probs[sl], 0, 1), dtype=np.float32)
        counts = trace.iteration_counts(it)
        experts = [np.flatnonzero(c) for c in counts]
        hidden = np.ascontiguousarray(np.swapaxes(trace.hidden[sl], 0, 1), dtype=np.float32)
        spec = np.ascontiguousarray(np.swapaxes(trace.spec_probs[sl], 0, 1), dtype=np.float32)
        seen = layer_observations(probs, experts, counts, spec, hidden)
        if preview != "none":
            pred.preview_pass(seen)
        if preview == "other":  # equal values, other objects, from layer 2 on
            seen = seen[:2] + [LayerObservation(layer=o.layer, probs=o.probs.copy(),
                                                experts=o.experts, counts=o.counts.copy(),
                                                hidden=hidden[o.layer].copy(),
                                                spec_probs=spec[o.layer].copy())
                               for o in seen[2:]]
        for layer in range(L):
            out.append(pred.observe_layer(seen[layer]))
        pred.end_iteration()
        if last[rid] == it:
            pred.end_request(rid)
    return out


def _key(p: Prediction) -> tuple:
    return ([(f.priority, f.layer, f.expert) for f in p.prefetch],
            {k: v.tolist() for k, v in p.scores.items()},
            {k: np.asarray(v).tolist() for k, v in p.predicted.items()})


@pytest.mark.parametrize(("cfg", "cache_name"), CASES)
def test_every_hook_identical_and_a_changed_observation_is_recomputed(cfg: dict,
                                                                      cache_name: str) -> None:
    """Hook by hook: previewed == not previewed == previewed but observed other objects."""
    trace = _trace()
    args = {k: v for k, v in cfg.items() if k != "name"}
    got = {}
    for mode in ("none", "same", "other"):
        pred = PREDICTORS.build(cfg["name"], dims=trace.dims, **args)
        pred.fit(trace.split("store"))
        got[mode] = [_key(p) for p in _hooks(pred, trace.split("test"), mode)]
    assert got["same"] == got["none"]
    assert got["other"] == got["none"]


def test_layer_observations_equal_the_constructor() -> None:
    """The fast builder makes the same frozen observations as LayerObservation(...)."""
    probs = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    experts = [np.array([0, 1]), np.array([2]), np.array([3])]
    counts = np.ones((3, 4), dtype=np.int64)
    hidden = np.zeros((3, 2, 5), dtype=np.float32)
    got = layer_observations(probs, experts, counts, None, hidden)
    for layer, obs in enumerate(got):
        ref = LayerObservation(layer=layer, probs=probs[layer], experts=experts[layer],
                               counts=counts[layer], spec_probs=None, hidden=hidden[layer])
        assert type(obs) is LayerObservation and repr(obs) == repr(ref)
        assert vars(obs).keys() == vars(ref).keys()
        assert obs.layer == layer and obs.hidden is not None and obs.spec_probs is None
        with pytest.raises(AttributeError):
            obs.layer = 5  # type: ignore[misc]


@pytest.mark.parametrize("preview", ["none", "same"])
def test_expert_map_reports_the_searchs_time_per_layer_when_previewed(
        monkeypatch: pytest.MonkeyPatch, preview: str) -> None:
    """``trajectory_query_us_mean`` is the search's time per layer either way: previewed,
    each layer is a 1/L share of the pass's search (the previewed ``observe_layer`` only
    looks its Prediction up and is not timed); not previewed, each layer's own search.
    On a clock that advances 1 s per reading: 1/L s and 1 s per layer query."""
    import moeexp.predictors.expert_map as em

    clock = iter(range(10**6))
    monkeypatch.setattr(em, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    trace = _trace()
    pred = PREDICTORS.build("expert_map", dims=trace.dims, prefetch_distance=2,
                            use_semantic=False)
    pred.fit(trace.split("store"))
    _hooks(pred, trace.split("test"), preview)
    L = trace.dims.num_layers
    want = 1e6 / L if preview == "same" else 1e6
    assert pred.stats()["trajectory_query_us_mean"] == pytest.approx(want)
