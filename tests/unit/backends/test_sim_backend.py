"""backend=sim's feed charge (``backend.predictor_feed_us``): one number for every
predictor, or each predictor's own from a mapping; bad values and names are refused."""

from __future__ import annotations

import pytest

from moeexp.backends import BACKENDS, BackendContext
from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.synthetic import random_trace


def _ctx(predictor: str) -> tuple[BackendContext, object]:
    trace = random_trace(num_layers=4, num_experts=8, num_requests=6, prompt_len=6,
                         output_len=6, seed=3)
    d = trace.dims
    pred = PREDICTORS.build(predictor, dims=d)
    pred.fit(trace.split("store"))
    cache = CACHES.build("lru", capacity_slots=capacity_slots(0.25, d),
                         num_layers=d.num_layers, num_experts=d.num_experts)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    ctx = BackendContext(loaded=None, prompts=[], trace=trace.split("test"), predictor=pred,
                         cache=cache, cost=cost, seed=0)
    return ctx, trace


def _fresh_run(predictor: str, feed_s: float) -> dict:
    """The same run through ``simulate`` directly, with ``feed_s`` charged."""
    ctx, _ = _ctx(predictor)
    return simulate(ctx.trace, ctx.predictor, ctx.cache, ctx.cost, progress=False,
                    predictor_feed_s=feed_s).metrics


@pytest.mark.parametrize("predictor", ["layer_transition", "hit_count"])
def test_a_mapping_charges_each_predictor_its_own_feed(predictor: str) -> None:
    """With {layer_transition: 300, hit_count: 50} each run pays its own predictor's entry:
    the TPOT is simulate's with that charge (not the other entry's), and the run reports it
    as ``predictor_feed_us``."""
    feeds = {"layer_transition": 300.0, "hit_count": 50.0}
    backend = BACKENDS.build("sim", progress=False, predictor_feed_us=feeds)
    ctx, _ = _ctx(predictor)
    m = backend.run(ctx).metrics
    own = _fresh_run(predictor, feeds[predictor] * 1e-6)
    other = _fresh_run(predictor, feeds["hit_count" if predictor == "layer_transition"
                                        else "layer_transition"] * 1e-6)
    assert m["tpot_ms_mean"] == own["tpot_ms_mean"] != other["tpot_ms_mean"]
    assert m["predictor_feed_us"] == feeds[predictor]


def test_one_number_charges_every_predictor_and_none_pays_nothing() -> None:
    """A number charges any predictor; the predictor ``none`` is never charged, and a run
    without a charge reports no ``predictor_feed_us`` (its metrics are as before)."""
    backend = BACKENDS.build("sim", progress=False, predictor_feed_us=120)
    ctx, _ = _ctx("layer_transition")
    m = backend.run(ctx).metrics
    assert m["tpot_ms_mean"] == _fresh_run("layer_transition", 120e-6)["tpot_ms_mean"]
    assert m["predictor_feed_us"] == 120.0
    ctx0, _ = _ctx("none")
    m0 = backend.run(ctx0).metrics
    assert "predictor_feed_us" not in m0
    assert m0["tpot_ms_mean"] == _fresh_run("none", 0.0)["tpot_ms_mean"]


def test_a_mapping_without_the_runs_predictor_raises() -> None:
    backend = BACKENDS.build("sim", progress=False, predictor_feed_us={"hit_count": 50})
    ctx, _ = _ctx("layer_transition")
    with pytest.raises(ConfigError, match="no entry for predictor 'layer_transition'"):
        backend.run(ctx)
    ctx0, _ = _ctx("none")  # none needs no entry
    assert "predictor_feed_us" not in backend.run(ctx0).metrics


@pytest.mark.parametrize("feed, match", [
    ({"finemoe": 331}, "unknown predictor.*'finemoe'.*valid:.*expert_map"),
    ({"expert_map": -1}, "finite number >= 0"),
    ({"expert_map": True}, "finite number >= 0"),
    ({"expert_map": float("inf")}, "finite number >= 0"),
    (-5, "finite number >= 0"),
    ("600", "finite number >= 0"),
])
def test_bad_feeds_are_refused_with_what_is_valid(feed: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BACKENDS.build("sim", predictor_feed_us=feed)
