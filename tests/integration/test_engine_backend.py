"""backend=engine and the sim_vs_engine calibration from the Hydra app.

Decision (conf/backend/engine.yaml, ``replay_tokens: true``): the engine decodes the tokens
the trace recorded (top-k sampled by the recorder, as for the simulator), so both backends
serve the very same forward passes; a system whose decisions do not depend on timing
(deepspeed) then takes the same decisions in both.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from moeexp.metrics import CORE_KEYS
from moeexp.tracking.run_dir import read_series

#: The issue's small setting: 6 prompts (4 store / 2 test) of 12 tokens + 6 generated.
LEN = ["dataset.num_prompts=6", "dataset.input_len=12", "dataset.output_len=6",
       "trace.prompt_embedder=null", "trace.progress=false", "backend.progress=false",
       "logger=none", "++hydra.job.env_set.OMP_NUM_THREADS=1"]
#: A small calibration for the sim_vs_engine runs: 4 store requests, copies of 0.5-2 experts
#: twice each, passes of 1, 2 and 4 members once (3 decode steps) for the members term.
CALIBRATION = ["backend.profile_requests=4", "backend.copy_repeats=2",
               "backend.copy_factors=[0.5,1.0,2.0]",
               "backend.pass_profile={batch_sizes:[1,2,4],steps:3,repeats:1}"]


def _ok(out) -> None:
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_overrides, trace_dir, run_app):
    """deepspeed through backend=sim and backend=engine on the same prompts and trace (one
    multirun: one process start)."""
    base = tmp_path_factory.mktemp("engine_backend")
    _ok(run_app("--multirun", "backend=sim,engine", *model_overrides, *LEN,
                f"trace.cache_dir={trace_dir}", "system=deepspeed", f"hydra.sweep.dir={base}",
                "hydra.sweep.subdir=${backend.name}"))
    return {b: base / b for b in ("sim", "engine")}


def test_engine_writes_the_sim_layout(runs):
    """metrics.json: every CORE_KEY and every key backend=sim writes except its own wall
    clock (sim_wall_s) and what only a replay of the whole trace can compute (the latency
    floor bound_* and the makespan it is held against), ttft/tpot norms >= 0; series.parquet: the sim's series, 2 per-request
    values (2 test requests) and 12 per-pass values (2 requests x 6 passes); env.json."""
    sim = json.loads((runs["sim"] / "metrics.json").read_text())
    eng = json.loads((runs["engine"] / "metrics.json").read_text())
    assert set(CORE_KEYS) <= set(eng)
    sim_only = {"sim_wall_s", "makespan_ms"} | {k for k in sim if k.startswith("bound_")}
    assert set(sim) - sim_only <= set(eng), sorted(set(sim) - sim_only - set(eng))
    assert eng["backend"] == "engine" and eng["requests_total"] == 2
    assert eng["ttft_norm_mean"] > 0 and eng["tpot_norm_mean"] > 0
    s_sim, s_eng = read_series(runs["sim"]), read_series(runs["engine"])
    assert set(s_sim) <= set(s_eng)
    assert len(s_eng["ttft_ms"]) == 2 and len(s_eng["iter_ms"]) == 12
    assert sum(s_eng["iter_hits"]) + sum(s_eng["iter_misses"]) == eng["accesses_total"]
    assert (runs["engine"] / "env.json").is_file()


def test_deepspeed_engine_decisions_equal_the_simulator(runs):
    """Same passes (token replay), no timing-dependent decision: hit_rate, h2d_bytes_total,
    accesses and hits equal exactly; the engine moved real bytes (h2d > 0) and took time."""
    sim = json.loads((runs["sim"] / "metrics.json").read_text())
    eng = json.loads((runs["engine"] / "metrics.json").read_text())
    assert sim["trace_hash"] == eng["trace_hash"]
    for k in ("hit_rate", "h2d_bytes_total", "accesses_total", "hits_total", "requests_total"):
        assert eng[k] == sim[k], k
    assert eng["h2d_bytes_total"] > 0 and eng["ttft_ms_mean"] > 0 and eng["tpot_ms_mean"] > 0


def test_system_sets_backend_keys_for_both_backends():
    """emoe's `backend: {restricted_routing: true}` reaches backend=sim and backend=engine
    (system is last in the root defaults); a command-line override still wins; the engine
    group validates; backend.device=cuda without CUDA fails validation, naming the fix."""
    import torch
    from hydra import compose, initialize_config_dir

    from moeexp.config import validate
    from moeexp.errors import ConfigError
    from moeexp.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for b in ("sim", "engine"):
            cfg = compose(config_name="config", overrides=["system=emoe", f"backend={b}"])
            assert validate(cfg).backend.kwargs["restricted_routing"] is True
        cfg = compose(config_name="config", overrides=["system=emoe", "backend=engine",
                                                      "backend.restricted_routing=false"])
        assert cfg.backend.restricted_routing is False
        if not torch.cuda.is_available():
            cfg = compose(config_name="config", overrides=["backend=engine", "backend.device=cuda"])
            with pytest.raises(ConfigError, match="CUDA is not available"):
                validate(cfg)


@pytest.mark.slow
def test_sim_vs_engine_experiment(tmp_path, model_overrides, trace_dir, run_app):
    """+experiment=sim_vs_engine shrunk to three systems, with the predictor-feeding term:
    summary.csv has the columns the figure reads, one row per system, deepspeed's hit rates
    equal, a feed cost only where a predictor is measured; the fitted profile is written
    (calibration.json, and its roofline approximation as a hardware profile)."""
    run = tmp_path / "cal"
    _ok(run_app(*model_overrides, "+experiment=sim_vs_engine", *LEN,
                f"trace.cache_dir={trace_dir}", f"hydra.run.dir={run}",
                "backend.systems=[deepspeed,oracle,mixtral_offloading]",
                *CALIBRATION, "backend.predictor_feed=true"))
    df = pd.read_csv(run / "summary.csv")
    assert list(df.columns[:7]) == ["system", "engine_ttft_ms_mean", "sim_ttft_ms_mean",
                                    "engine_tpot_ms_mean", "sim_tpot_ms_mean",
                                    "engine_hit_rate", "sim_hit_rate"]
    assert list(df["system"]) == ["deepspeed", "oracle", "mixtral_offloading"]
    feed = df.set_index("system")["sim_predictor_feed_us"]
    assert feed["deepspeed"] == 0 and feed["oracle"] == 0  # no predictor; needs the future
    assert feed["mixtral_offloading"] >= 0
    ds = df.set_index("system").loc["deepspeed"]
    assert ds["engine_hit_rate"] == ds["sim_hit_rate"] and ds["hit_rate_diff"] == 0
    assert (df[["sim_ttft_ms_mean", "sim_tpot_ms_mean", "ttft_mape_pct"]] > 0).all().all()
    m = json.loads((run / "metrics.json").read_text())
    assert m["systems"] == "deepspeed,oracle,mixtral_offloading" and m["ttft_mape_pct_mean"] >= 0
    assert (run / "calibration.json").is_file() and (run / "conf/hardware/calibrated.yaml").is_file()


def test_sim_vs_engine_cpu_experiment(tmp_path, model_overrides, trace_dir, run_app):
    """+experiment=sim_vs_engine_cpu shrunk: the calibrated profile gets a cpu: block fitted
    on the engine's CPU path (calibration.json, the hardware YAML, metrics.json), and an
    entry with an execution (a mapping of its option's name, as from the command line) runs on
    the engine and on the simulator with both backends' CPU counters in summary.csv."""
    from moeexp.costmodel.hardware import load_profile

    run = tmp_path / "cpu"
    _ok(run_app(*model_overrides, "+experiment=sim_vs_engine_cpu", *LEN,
                f"trace.cache_dir={trace_dir}", f"hydra.run.dir={run}",
                "backend.systems=[deepspeed,{name:llama,system:deepspeed,execution:{name:layer_split}}]",
                *CALIBRATION))
    df = pd.read_csv(run / "summary.csv").set_index("system")
    assert list(df.index) == ["deepspeed", "llama"]
    assert df.loc["deepspeed", "execution"] == "copy" and df.loc["deepspeed", "engine_cpu_expert_calls"] == 0
    assert df.loc["llama", "execution"] == "layer_split"
    assert df.loc["llama", "engine_cpu_expert_calls"] > 0 and df.loc["llama", "engine_cpu_ms_total"] > 0
    assert df.loc["llama", "sim_cpu_expert_calls"] > 0 and df.loc["llama", "sim_cpu_ms_total"] > 0
    assert df.loc["deepspeed", "sim_cpu_expert_calls"] in (0, 0.0) or pd.isna(
        df.loc["deepspeed", "sim_cpu_expert_calls"])
    assert df["sim_tpot_ms_mean"].notna().all()
    cal = json.loads((run / "calibration.json").read_text())
    assert cal["cpu"]["tflops"] > 0 and cal["fit"]["cpu"]["n"] > 0
    assert load_profile("calibrated", conf_dir=run / "conf/hardware").cpu is not None
    m = json.loads((run / "metrics.json").read_text())
    assert m["calib_cpu_dram_gbps"] > 0


def test_sim_backend_uses_a_cost_profile(tmp_path):
    """backend=sim with cost_profile=calibration.json replays with the fitted model: every
    expert resident, a decode pass costs exactly L * (layer_s + 2 experts of one token) +
    decode_pass_s = 8 * (500 + 2 * 50) + 2000 us = 6.8 ms (the TPOT); a missing file is a
    ConfigError at construction."""
    from moeexp.backends import BackendContext, SimBackend
    from moeexp.cache import CACHES
    from moeexp.costmodel import CostModel, load_profile
    from moeexp.costmodel.fitted import CalibratedProfile
    from moeexp.errors import ConfigError
    from moeexp.predictors import PREDICTORS
    from moeexp.traces.synthetic import random_trace

    tr = random_trace(num_requests=2, num_layers=8, num_experts=8, top_k=2, output_len=4)
    d = tr.dims
    prof = CalibratedProfile(
        num_layers=8, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size or 1,
        expert_bytes=d.expert_bytes, layer_s=500e-6, dense_token_s=0.0, dense_ctx_s=0.0,
        expert_s=50e-6, expert_token_s=0.0, prefill_pass_s=0.0, prefill_token_s=0.0,
        decode_pass_s=2e-3, copy_latency_s=0.0, copy_bytes_per_s=1e9, member_s=0.0,
        member_kv_s=0.0)
    path = prof.save(tmp_path / "calibration.json")
    pol = CACHES.build("resident", capacity_slots=64, num_layers=8, num_experts=8)
    ctx = BackendContext(loaded=None, prompts=[], trace=tr,
                         predictor=PREDICTORS.build("none", dims=d), cache=pol,
                         cost=CostModel.from_profile(load_profile("rtx3090_pcie4"), d), seed=0)
    m = SimBackend(cost_profile=str(path), progress=False).run(ctx).metrics
    assert m["cost_profile"] == str(path)
    assert m["tpot_ms_mean"] == pytest.approx(6.8)
    with pytest.raises(ConfigError, match="does not exist"):
        SimBackend(cost_profile=str(tmp_path / "nope.json"))


def test_two_emulated_devices_take_the_simulators_decisions(tmp_path, model_overrides,
                                                             trace_dir, run_app):
    """hardware.devices=2 (round robin, per-device budgets, one demand thread) through
    backend=engine (two emulated links on CPU) and backend=sim: deepspeed's decisions do
    not depend on timing, so hit rate and every device's bytes equal exactly."""
    _ok(run_app("--multirun", "backend=sim,engine", *model_overrides, *LEN,
                f"trace.cache_dir={trace_dir}", "system=deepspeed", "hardware.devices=2",
                "topology.cache_budget=per_device", f"hydra.sweep.dir={tmp_path}",
                "hydra.sweep.subdir=${backend.name}"))
    sim, eng = (json.loads((tmp_path / b / "metrics.json").read_text()) for b in ("sim", "engine"))
    for k in ("hit_rate", "h2d_bytes_total", "devices", "demand_concurrency",
              "dev0_h2d_bytes_total", "dev1_h2d_bytes_total", "dev0_expert_cache_bytes",
              "dev1_expert_cache_bytes"):
        assert eng[k] == sim[k], k
    assert eng["devices"] == 2 and eng["dev0_h2d_bytes_total"] > 0 < eng["dev1_h2d_bytes_total"]
