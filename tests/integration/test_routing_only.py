"""Every predictor on a routing-only trace (what an imported trace holds): either it is
reported not applicable, naming what the trace lacks, or the simulator replays it; and the
app runs the shipped real trace end to end (TTFT unavailable, never a made-up number)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from moeexp.cache import build_cache
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.paths import group_options, load_group_yaml
from moeexp.predictors import build_predictor
from moeexp.simulator import simulate
from moeexp.traces.interchange import ExternalRouting, split_labels, to_trace
from moeexp.traces.schema import missing_for
from moeexp.traces.synthetic import random_trace

#: What a routing-only trace cannot serve, per predictor (the rest must run).
NOT_APPLICABLE = {"speculative_gate": "spec_probs", "promoe": "spec_probs",
                  "learned_mlp": "hidden", "expert_map": "embed"}


def _routing_only(prompt_embed: bool):
    """A synthetic trace re-expressed as an imported one: top-k ids and weights of decode
    rows only (the prefill rows dropped), no probs, embeddings, token ids or gates."""
    t = random_trace(num_requests=8, num_layers=4, num_experts=8, prompt_len=5, output_len=6,
                     spec_depth=0)
    keep = [i for i in range(t.num_iterations) if t.iter_step[i] > 0]
    rows = [int(t.iter_offsets[i]) for i in keep]
    lens = [sum(1 for i in keep if t.iter_request[i] == r.request_id) for r in t.requests]
    ext = ExternalRouting(
        info={"model": "synthetic", "num_layers": 4, "num_experts": 8, "top_k": 2},
        experts=t.topk_idx[rows], weights=t.topk_weight[rows],
        offsets=np.concatenate([[0], np.cumsum(lens)]),
        requests=[{"prompt": r.prompt, "prompt_tokens": 5} for r in t.requests])
    tr = to_trace(ext, t.dims, split_labels(8, 0.5, 0))
    if prompt_embed:
        tr.prompt_embed = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    return tr


@pytest.mark.parametrize("name", group_options("predictor"))
def test_every_predictor_on_a_routing_only_trace(name):
    tr = _routing_only(prompt_embed=True)
    cfg = OmegaConf.create({"model": {"prefetch_distance": 1},
                            "p": load_group_yaml("predictor", name)})
    pred = build_predictor(OmegaConf.to_container(cfg, resolve=True)["p"], tr.dims)
    lacks = missing_for(pred.needs, tr.capabilities)
    if name in NOT_APPLICABLE:
        assert lacks and NOT_APPLICABLE[name] in lacks[0], (name, lacks)
        with pytest.raises(ConfigError, match="not applicable: the trace lacks"):
            simulate(tr.split("test"), pred, build_cache({"name": "lru", "capacity": 0.5}, tr.dims),
                     CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims), progress=False)
        return
    assert not lacks, (name, lacks)
    cache = build_cache({"name": "lru", "capacity": 0.5}, tr.dims)
    pred.fit(tr.split("store"))
    cache.fit(tr.split("store"))
    res = simulate(tr.split("test"), pred, cache,
                   CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims), progress=False)
    assert 0 <= res.metrics["hit_rate"] <= 1 and res.metrics["tpot_ms_mean"] > 0


def test_decode_only_tpot_counts_every_decode_step():
    """No prefill: every request's TPOT is (finish - start) / decode iterations, and with
    every expert resident TPOT equals the no_offload reference (ratio 1)."""
    tr = _routing_only(prompt_embed=False)
    pred = build_predictor({"name": "none"}, tr.dims)
    cache = build_cache({"name": "resident", "capacity": 1.0}, tr.dims)
    res = simulate(tr.split("test"), pred, cache,
                   CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims), progress=False)
    assert res.metrics["tpot_norm_mean"] == pytest.approx(1.0)
    s = res.series
    for e2e, tpot in zip(s["e2e_ms"], s["tpot_ms"], strict=True):
        assert tpot == pytest.approx(e2e / 5)  # 5 decode rows per request


def test_app_replays_the_shipped_real_trace(tmp_path):
    """trace.source=gpt_oss_20b: no model load, the real dims, TTFT marked unavailable;
    finemoe (semantic search) is reported not applicable; a backend that needs a model
    is refused before any work."""
    from hydra import compose, initialize_config_dir

    from moeexp.paths import CONF_DIR
    from moeexp.pipeline import run

    def cfg(*o):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", ["model=gpt_oss_20b", "trace.source=gpt_oss_20b",
                                      "logger=none", "trace.progress=false",
                                      "backend.progress=false", "dataset.store_fraction=0.9",
                                      *o])

    m = run(cfg("system=deepspeed"), run_dir=tmp_path / "ds")
    assert m["status"] == "ok" and m["ttft_available"] is False
    assert math.isnan(m["ttft_ms_mean"]) and m["tpot_ms_mean"] > 0 and 0 < m["hit_rate"] < 1
    # the replayed trace's identity (its requests' task labels included: task_label=family)
    assert m["trace_hash"] == "b66e90f5d7037f76ebdadb0a8fa2c05a70c7c1a5bef15a6a8bb7340b3c72a04a"
    src = run(cfg("system=deepspeed", "trace.task_label=source"), run_dir=tmp_path / "src")
    assert src["trace_hash"] == "1594037828bff3d79945c0b1fc7a8479ffb71c6f63d621e6c2ffa9f64d2a2c9e"
    assert src["hit_rate"] == m["hit_rate"]  # labels change the identity, not the replay
    na = run(cfg("system=finemoe"), run_dir=tmp_path / "fm")
    assert na["status"] == "not_applicable" and "embedding-layer outputs" in na["not_applicable_reason"]
    with pytest.raises(ConfigError, match="backend=engine cannot run it"):
        run(cfg("backend=engine"), run_dir=tmp_path / "eng")
