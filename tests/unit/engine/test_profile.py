"""Profiling the engine for the calibration: what is timed, and the copy path's link."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.costmodel.fitted import fit_linear
from moeexp.engine.profile import profile_compute, profile_copy, profile_feed, profile_passes
from moeexp.models.adapters import adapter_for


def test_profile_compute_times_every_layer_and_pass(mixtral) -> None:
    """Two requests (6 and 3 prompt tokens, 3 generated each) on the 2-layer tiny Mixtral:
    6 passes (2 prefills with T = 6 and 3, then T = 1), 12 MoE layer samples whose experts
    call is part of the layer, attended context T(T+1)/2 at prefill and prompt + step after;
    the model is plain again afterwards."""
    loaded = types.SimpleNamespace(model=mixtral, adapter=adapter_for(mixtral), name="t")
    reqs = [(prompt_ids(6, 0)[0].tolist(), 3), (prompt_ids(3, 1)[0].tolist(), 3)]
    s = profile_compute(loaded, reqs, warmup=1)
    a = s.arrays()
    assert a["pass_prefill"].tolist() == [1, 0, 0, 1, 0, 0]
    assert a["pass_tokens"].tolist() == [6, 1, 1, 3, 1, 1]
    assert len(a["layer_s"]) == 12
    assert a["layer_ctx"].tolist() == [21, 21, 7, 7, 8, 8, 6, 6, 4, 4, 5, 5]
    assert (a["layer_rows"] == 2 * a["layer_tokens"]).all()
    assert (a["experts_s"] > 0).all() and (a["layer_s"] >= a["experts_s"]).all()
    assert (a["pass_s"] > 0).all() and (a["layer_active"] >= 2).all()
    assert mixtral.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("batch_decode", [False, True])
def test_profile_passes_times_multi_member_passes(mixtral, batch_decode: bool) -> None:
    """B = 1, 2, 3 on the 2-layer tiny Mixtral (prompts of 5, 3, 4 tokens cycled), 2 decode
    steps, the mix pass for B >= 2: per B a prefill pass of B members, 2 decode passes, then
    (B >= 2) B - 1 decoders with the next prompt's prefill; tokens, context and KV summed
    as the simulator's Plan.group sums them; the experts calls inside each pass; the model
    plain again afterwards."""
    loaded = types.SimpleNamespace(model=mixtral, adapter=adapter_for(mixtral), name="t")
    reqs = [(prompt_ids(n, seed)[0].tolist(), 1) for seed, n in enumerate((5, 3, 4))]
    s = profile_passes(loaded, reqs, batch_sizes=(1, 2, 3), steps=2, warmup=1,
                       batch_decode=batch_decode)
    a = s.arrays()
    assert a["batch_members"].tolist() == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert a["batch_prefills"].tolist() == [1, 0, 0, 2, 0, 0, 1, 3, 0, 0, 1]
    # warm-up took prompts 5, 3; B=1: 4; B=2: 5, 3 (+ 4 mixed in); B=3: 5, 3, 4 (+ 5)
    assert a["batch_tokens"].tolist() == [4, 1, 1, 8, 2, 2, 5, 12, 3, 3, 7]
    assert a["batch_ctx"].tolist() == [10, 5, 6, 21, 10, 12, 16, 31, 15, 18, 28]
    assert a["batch_kv"].tolist() == [4, 5, 6, 8, 10, 12, 10, 12, 15, 18, 18]
    assert ((a["batch_experts_s"] > 0) & (a["batch_s"] > a["batch_experts_s"])).all()
    half = profile_passes(loaded, reqs, batch_sizes=(1, 2), steps=1, prompt_fractions=(0.5,),
                          mixed=False, batch_decode=batch_decode).arrays()
    assert half["batch_tokens"].tolist() == [2, 1, 4, 2]  # prompts cut to round(n / 2)
    assert mixtral.config._experts_implementation == "grouped_mm"


def test_profile_copy_follows_the_emulated_link() -> None:
    """Copies of 0.5, 1 and 2 x 18 KiB through the copy thread with a 20 MB/s emulated link
    take at least bytes / 20 MB/s each, and the fitted bandwidth is the link's within 25%."""
    bw = 20e6
    s = profile_copy(torch.device("cpu"), 18432, bandwidth_bps=bw, factors=(0.5, 1.0, 2.0),
                     repeats=3)
    b, t = np.asarray(s.copy_bytes), np.asarray(s.copy_s)
    assert sorted(set(b.tolist())) == [9216, 18432, 36864] and len(t) == 9
    assert (t >= b / bw * 0.999).all()
    fit = fit_linear(np.c_[np.ones(len(b)), b], t)
    assert 1 / fit.coef[1] == pytest.approx(bw, rel=0.25)


def test_profile_feed_is_a_per_layer_cost_and_leaves_the_predictor_untouched(mixtral, store_of) -> None:
    """A fitted predictor's feeding cost per MoE layer: finite, >= 0, from copies of the
    predictor (the one passed in is not used, so the caller can still replay with it)."""
    from moeexp.predictors import PREDICTORS
    from moeexp.traces.recorder import trace_dims

    loaded = types.SimpleNamespace(model=mixtral, adapter=adapter_for(mixtral), name="t")
    dims = trace_dims(loaded.adapter, 2)
    pred = PREDICTORS.build("speculative_gate", dims=dims)
    pred.fit(store_of("mixtral"))
    before = repr(vars(pred))
    reqs = [(prompt_ids(6, seed=s)[0].tolist(), 3) for s in range(2)]
    feed = profile_feed(loaded, reqs, pred, repeats=1)
    assert np.isfinite(feed) and feed >= 0
    assert repr(vars(pred)) == before
