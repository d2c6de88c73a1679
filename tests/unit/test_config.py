"""Every option of every config group composes, validates and builds; errors come early.

The option lists are read from ``conf/<group>/*.yaml`` at collection time, so options other
workers add are covered automatically.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from moeexp.cache import build_cache
from moeexp.config import TraceSpec, validate
from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR, REPO_DIR, group_options
from moeexp.predictors import build_predictor
from moeexp.traces.schema import TraceDims

GROUPS = ("model", "dataset", "predictor", "cache", "system", "hardware", "backend", "logger")
CASES = [(g, o) for g in (*GROUPS, "experiment") for o in group_options(g)]
#: Synthetic dims: 4 MoE layers x 8 experts, top-2, 4 KiB experts (32 slots in all).
DIMS = TraceDims(num_layers=4, num_experts=8, top_k=2, hidden_size=16, spec_depth=4,
                 expert_bytes=4096, dense_bytes=65536, intermediate_size=32)
#: Predictor extras switched on so that every predictor validates alone.
EXTRAS = ["trace.record_hidden=true", "trace.prompt_embedder=minilm", "trace.spec_depth=4"]


def _compose(overrides: list[str], conf_dir: Path = CONF_DIR, hydra: bool = False):
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def test_every_group_has_options():
    for g in GROUPS:
        assert group_options(g), f"conf/{g}/ has no option"


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_validates_builds(group, option):
    """``group=option`` composes, passes validate(), and its predictor and cache build on
    synthetic dims; the YAML's ``name:`` is its file name."""
    choice = f"+experiment={option}" if group == "experiment" else f"{group}={option}"
    cfg = _compose([choice, *EXTRAS])
    if group == "experiment":
        assert cfg.experiment_name == option
        # the app instantiates an experiment's Hydra callbacks before the job, compose()
        # does not
        for cb in (_compose([choice], hydra=True).hydra.callbacks or {}).values():
            importlib.import_module(str(cb._target_).rsplit(".", 1)[0])
    else:
        assert cfg[group].name == option
    if option == "eviction_landscape":  # the experiment and its backend need the extra
        pytest.importorskip("libcachesim", reason="optional: pip install -e '.[cachesim]'")
    spec = validate(cfg)
    assert spec.system.name == cfg.system.name
    predictor = build_predictor(cfg.predictor, DIMS)
    cache = build_cache(cfg.cache, DIMS)
    assert predictor.name == cfg.predictor.name and cache.name == cfg.cache.name
    assert 1 <= cache.capacity_slots <= DIMS.num_layers * DIMS.num_experts


def test_defaults_are_the_contract():
    """Root defaults: tiny, sharegpt, none, lru, deepspeed, rtx3090_pcie4, sim, wandb."""
    cfg = _compose([], hydra=True)
    choices = dict(cfg.hydra.runtime.choices)
    want = {"model": "tiny", "dataset": "sharegpt", "predictor": "none", "cache": "lru",
            "system": "deepspeed", "hardware": "rtx3090_pcie4", "backend": "sim",
            "logger": "wandb"}
    assert {k: choices[k] for k in want} == want
    assert "experiment" not in choices
    assert cfg.hydra.callbacks.summary._target_ == "moeexp.tracking.summary.SummaryCallback"


def test_system_bundles_and_command_line_precedence():
    """system=oracle picks oracle + belady; ``predictor=none`` on the command line still wins."""
    cfg = _compose(["system=oracle"])
    assert (cfg.predictor.name, cfg.cache.name, cfg.system.name) == ("oracle", "belady", "oracle")
    cfg = _compose(["system=oracle", "predictor=none"])
    assert (cfg.predictor.name, cfg.cache.name) == ("none", "belady")


def test_experiment_sweeps_systems_at_fixed_budget():
    cfg = _compose(["+experiment=finemoe_vs_moeinfinity"], hydra=True)
    assert str(cfg.hydra.mode) in ("MULTIRUN", "RunMode.MULTIRUN") and cfg.cache.capacity == 0.25
    systems = cfg.hydra.sweeper.params.system.split(",")
    assert {"no_offload", "deepspeed", "oracle"} <= set(systems)
    assert all(s in group_options("system") for s in systems)


def test_trace_spec_matches_recorder_defaults():
    """TraceSpec's keys and defaults are the trace cache's (one set of trace keys)."""
    from moeexp.traces.store import TRACE_DEFAULTS

    spec = TraceSpec()
    assert {f.name: getattr(spec, f.name) for f in fields(TraceSpec)} == TRACE_DEFAULTS


def test_misspelled_option_lists_valid_names():
    with pytest.raises(MissingConfigException) as err:
        _compose(["cache=lruu"])
    msg = str(err.value)
    assert "cache/lruu" in msg and "Available options" in msg and "lru_per_layer" in msg


@pytest.mark.parametrize(("override", "pattern"), [
    ("+cache.capacty=0.5", r"cache=lru: unknown key\(s\) 'capacty' \(did you mean 'capacity'\?\)"),
    ("+predictor.foo=1", r"predictor=none: unknown key\(s\) 'foo'"),
    ("+model.prefetch_distnce=3", r"model=tiny: unknown key\(s\) 'prefetch_distnce' \(did you mean 'prefetch_distance'\?\)"),
    ("+dataset.num_promts=3", r"dataset=sharegpt: unknown key\(s\) 'num_promts' \(did you mean 'num_prompts'\?\)"),
    ("+backend.batchsize=2", r"backend=sim: unknown key\(s\) 'batchsize'"),
    ("+trace.topk=3", r"trace: unknown key\(s\) 'topk' \(did you mean 'top_k'\?\)"),
    ("+logger.projct=x", r"logger=wandb: unknown key\(s\) 'projct'"),
    ("+system.nam=x", r"system=deepspeed: unknown key\(s\) 'nam'"),
    ("+hardware.h2d_gbs=1", r"hardware profile 'rtx3090_pcie4': unknown key\(s\) h2d_gbs"),
    ("+foo=1", r"unknown top-level key\(s\) 'foo'"),
])
def test_misspelled_key_fails_in_validate(override, pattern):
    """A key no constructor accepts fails in validate(), i.e. before any model or trace work."""
    with pytest.raises(ConfigError, match=pattern):
        validate(_compose([override]))


def test_misspelled_key_in_a_yaml_file(tmp_path):
    """A typo inside a group's YAML (not the command line) fails the same way."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    lru = conf / "cache" / "lru.yaml"
    lru.write_text(lru.read_text() + "evict_polcy: oldest\n")
    with pytest.raises(ConfigError, match="evict_polcy"):
        validate(_compose([], conf_dir=conf))


@pytest.mark.parametrize(("override", "pattern"), [
    ("model.prefetch_distance=0", "prefetch_distance must be >= 1"),
    ("model.path=/nonexistent/model", "model.path='/nonexistent/model' does not exist"),
    ("dataset.path=/nonexistent/sharegpt.json", "dataset.path=.* does not exist"),
    ("backend.batch_size=0", "batch_size must be >= 1"),
    ("trace.sampling=beam", "sampling='beam' .valid: top_k, greedy"),
    ("logger.mode=onlin", "mode='onlin'"),
    ("predictor=learned_mlp", r"needs hidden states \(set trace.record_hidden=true\)"),
    ("backend.name=gpu", r"unknown backend 'gpu'. Valid backend names: engine, (\w+, )*sim"),
])
def test_bad_values_fail_in_validate(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(_compose([override]))


def test_engine_backend_keys_are_checked():
    """backend=engine takes the engine's settings; a typo fails (the engine imports torch)."""
    from moeexp.backends import BACKENDS

    assert BACKENDS.build("engine", bandwidth_bps=1e9, sampling="greedy").settings
    with pytest.raises(ConfigError, match=r"backend=engine: unknown key\(s\) 'bandwith_bps' \(did you mean 'bandwidth_bps'\?\)"):
        BACKENDS.build("engine", bandwith_bps=1e9)


def test_capacity_below_top_k_fails_when_building():
    """0.05 of 32 slots = 1 slot < top_k=2: the message gives the smallest valid capacity."""
    cfg = _compose(["cache.capacity=0.05"])
    validate(cfg)
    with pytest.raises(ConfigError, match="fewer than top_k=2"):
        build_cache(cfg.cache, DIMS)


def _app(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "moeexp", *args], cwd=REPO_DIR, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cfg_job_prints_resolved_config():
    out = _app("--cfg", "job", "cache.capacity=0.5")
    assert out.returncode == 0, out.stderr
    assert "model:\n  name: tiny" in out.stdout and "capacity: 0.5" in out.stdout
    assert "system:\n  name: deepspeed" in out.stdout and "hydra:" not in out.stdout


@pytest.mark.parametrize(("override", "listed"), [("cache=lruu", "lru_per_layer"),
                                                  ("model=nope", "mixtral_8x7b")])
def test_app_misspelled_option_fails_listing_options(override, listed, tmp_path):
    out = _app(override, f"hydra.run.dir={tmp_path}/run")
    assert out.returncode != 0
    assert "Available options" in out.stderr and listed in out.stderr
    assert not (tmp_path / "run").exists()


def test_console_script_from_another_directory(tmp_path):
    """The `moeexp` console script finds conf/ from any working directory, and
    `moeexp collect` dispatches to moeexp.tracking.collect (exit 1: no runs under an empty dir)."""
    script = Path(sys.executable).parent / "moeexp"
    if not script.exists():
        pytest.skip("moeexp console script not installed in this environment")
    out = subprocess.run([str(script), "--cfg", "job"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "name: tiny" in out.stdout
    out = subprocess.run([str(script), "collect", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no run (metrics.json)" in out.stderr


def test_expert_format_on_a_recorded_trace():
    """A recorded trace's model holds its experts in the format (the engine quantises them;
    the shapes are checked by the pipeline before the load); the plain model cannot be
    evaluated in one; an unknown name is refused with the valid ones."""
    spec = validate(_compose(["+model.expert_format=hqq2"]))
    assert spec.model.expert_format == "hqq2"
    with pytest.raises(ConfigError, match="backend=sim_vs_engine does not hold quantised"):
        validate(_compose(["+model.expert_format=int8", "backend=sim_vs_engine"]))
    with pytest.raises(ConfigError, match="system=no_offload evaluates the plain model"):
        validate(_compose(["+model.expert_format=int8", "eval=lm_eval", "system=no_offload"]))
    with pytest.raises(ConfigError, match="expert_format='int3'; valid: dense"):
        validate(_compose(["+model.expert_format=int3", "cost.as_model=mixtral_8x7b"]))
    spec = validate(_compose(["+model.expert_format=hqq2", "cost.as_model=mixtral_8x7b"]))
    assert spec.model.expert_format == "hqq2"


@pytest.mark.parametrize(("overrides", "pattern"), [
    (["hardware.devices=0"], "devices must be an integer >= 1"),
    (["hardware.devices=6", "topology.demand_concurrency=parallel"],
     "demand_concurrency 'parallel' is not valid; valid: single, per_device"),
    (["hardware.devices=6", "topology.cache_budget=each"],
     "cache budget scope 'each' is not valid; valid: total, per_device"),
    (["mechanics.demand_load=all"], "demand_load 'all' is not valid; valid: activated, all_experts"),
    (["mechanics.flush_per_tokn=true"], "flush_per_tokn"),
    (["placement=diagonal"], "Could not find .placement/diagonal"),
    (["hardware.devices=6", "backend=engine", "backend.device=cuda"],
     "backend=engine emulates several devices and the artifact.s mechanics on the CPU only"),
    (["mechanics.flush_per_token=true", "backend=engine", "scheduler=fcfs"],
     "continuous batching"),
    (["hardware.devices=6", "backend=sim_vs_engine"], "only backend=sim"),
    (["topology.host_gbps=-1"], "host_gbps must be a number of GB/s > 0"),
    (["hardware.devices=2", "placement=pinned"], "needs placement.map"),
    (["hardware.devices=2", "placement=pinned", "placement.map=/nonexistent.json"],
     "does not exist"),
    (["hardware.devices=2", "topology.host_gbps=12", "backend=engine"],
     "host-side limit is modelled by backend=sim only"),
    (["hardware.devices=2", "scheduler=fcfs"], "continuous batching"),
])
def test_testbed_settings_are_checked(overrides, pattern):
    """Topology and the artifact's mechanics: a bad value or an unsupported backend fails
    before any work, naming what is valid."""
    with pytest.raises((ConfigError, ConfigCompositionException, MissingConfigException),
                       match=pattern):
        validate(_compose(overrides))


def test_engine_takes_a_topology_on_cpu():
    """backend=engine (CPU) runs several emulated devices with the paper's mechanics."""
    spec = validate(_compose(["hardware.devices=3", "backend=engine",
                              "topology.demand_concurrency=per_device"]))
    assert spec.build_topology().devices == 3 and spec.backend.name == "engine"
    art = validate(_compose(["hardware.devices=2", "backend=engine", "mechanics.flush_per_token=true",
                             "mechanics.demand_load=all_experts"]))
    assert art.build_mechanics().flush_per_token and art.backend.name == "engine"
    capped = validate(_compose(["topology.host_gbps=24"]))
    assert not capped.testbed_default and capped.build_topology().host_gbps == 24


def test_testbed_defaults_are_the_plain_replay():
    """The defaults are one device, the paper's mechanics: the backend gets no topology."""
    spec = validate(_compose([]))
    assert spec.testbed_default and spec.hardware.devices == 1
    six = validate(_compose(["hardware.devices=6", "topology.cache_budget=per_device",
                             "mechanics.demand_load=all_experts", "mechanics.flush_per_token=true"]))
    assert not six.testbed_default
    topo, mech = six.build_topology(), six.build_mechanics()
    assert (topo.devices, topo.budget, topo.placement.name) == (6, "per_device", "round_robin")
    assert (mech.demand_load, mech.flush_per_token) == ("all_experts", True)


CPU_HW = "hardware=rtx3090_pcie4_epyc7532"


@pytest.mark.parametrize("option", group_options("execution"))
def test_every_execution_option_validates_on_a_cpu_profile(option):
    """``execution=<option>`` on a profile with a cpu: block validates and builds on
    synthetic dims (bound to their 8-slot budget); the default is ``copy``."""
    from moeexp.pipeline import _check_with_dims

    assert validate(_compose([])).execution.name == "copy"
    spec = validate(_compose([f"execution={option}", CPU_HW]))
    assert spec.execution.name == option
    _check_with_dims(spec, DIMS)


@pytest.mark.parametrize(("overrides", "pattern"), [
    (["execution=cpu_on_miss"], "no cpu: block; profiles with one: .*rtx3090_pcie4_epyc7532"),
    (["execution=cpu_on_mis", CPU_HW], "Could not find .execution/cpu_on_mis"),
    (["execution=balanced", CPU_HW, "+execution.contendd=true"], "contendd"),
    (["execution=balanced", CPU_HW, "execution.share_host_memory=yes"],
     "share_host_memory='yes' must be true or false"),
    (["execution=cpu_on_miss", CPU_HW, "backend=serving_quality"],
     "backend=sim and backend=engine run experts on the CPU"),
    (["execution=hot_pinned", CPU_HW, "hardware.devices=2"], "one device"),
    (["execution=layer_split", CPU_HW, "scheduler=fcfs"], "scheduler=static"),
    (["execution=cpu_on_miss", CPU_HW, "hardware.cpu.dram_gbps=-20"],
     r"invalid value\(s\) for dram_gbps.*must be > 0"),
    (["execution=cpu_on_miss", CPU_HW, "~hardware.cpu.efficiency.int4",
      "+model.expert_format=int4", "cost.as_model=mixtral_8x7b"],
     "no kernel efficiency for expert_format=int4; it has: dense, hqq2, hqq3, int8, mxfp4"),
    (["execution=cpu_on_miss", CPU_HW, "+model.expert_format=int3"],
     "expert_format='int3'; valid: dense"),
])
def test_bad_execution_settings_fail_in_validate(overrides, pattern):
    """A CPU policy on a profile with no cpu: block, a misspelled option or key, a backend
    or a testbed the CPU does not run on, a negative bandwidth, a format the CPU (or the
    model) cannot take: refused before any work, naming what is valid."""
    with pytest.raises((ConfigError, ConfigCompositionException, MissingConfigException),
                       match=pattern):
        validate(_compose(overrides))


@pytest.mark.parametrize(("overrides", "pattern"), [
    (["execution=layer_split", "execution.n_cpu_layers=5"], "must be an integer in 0..4"),
    (["execution=layer_split", "execution.n_cpu_layers=2"],
     "keeps 16 experts on the GPU, the cache budget holds 8 slots: use n_cpu_layers >= 3"),
    (["execution=hot_pinned", "execution.gpu_experts=9"], "pins 9 experts, the cache budget holds 8"),
])
def test_splits_beyond_the_model_or_the_budget_fail_with_the_dims(overrides, pattern):
    """A layer split larger than the layers, or pinned experts beyond the cache budget:
    refused when the dims are known, before the model's weights are read."""
    from moeexp.pipeline import _check_with_dims

    spec = validate(_compose([*overrides, CPU_HW]))
    with pytest.raises(ConfigError, match=pattern):
        _check_with_dims(spec, DIMS)
