"""``backend=eviction_landscape``: its settings, its files, its metrics, and the clear
failure without the optional libcachesim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from moeexp.backends import BACKENDS, BackendContext, EvictionLandscapeBackend
from moeexp.config import validate
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.landscape.backend import LandscapeSettings
from moeexp.landscape.cachesim import POLICIES, CacheSimMissing
from moeexp.paths import CONF_DIR, REPO_DIR
from moeexp.traces.synthetic import random_trace

INSTALL = "libcachesim is optional: pip install -e '.[cachesim]'"
SYN = {"name": "syn", "kind": "synthetic", "num_layers": 6, "num_experts": 8,
       "num_requests": 8, "output_len": 10}


def _settings(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"capacities": [0.25, 0.5], "sources": [SYN],
                               "moeexp_policies": ["lru", "belady"],
                               "libcachesim_policies": ["LRU", "Belady", "LIRS"],
                               "jobs": 1, "progress": False}
    base.update(kw)
    return base


def test_settings_are_checked() -> None:
    """Bad capacities, semantics, keys, repeated source names and excluded policies fail
    with ConfigError; null libcachesim_policies means every applicable one."""
    for bad, match in [({"capacities": [0.0]}, "capacities"),
                       ({"semantics": ["lazy"]}, "semantics"),
                       ({"sources": []}, "no sources"),
                       ({"sources": [SYN, SYN]}, "repeat"),
                       ({"libcachesim_policies": ["LFUDA"]}, "excluded"),
                       ({"jobs": 0}, "jobs")]:
        with pytest.raises(ConfigError, match=match):
            LandscapeSettings.from_mapping(_settings(**bad))
    with pytest.raises(ConfigError, match="did you mean 'capacities'"):
        LandscapeSettings.from_mapping({**_settings(), "capacity": [0.5]})
    every = LandscapeSettings.from_mapping(_settings(libcachesim_policies=None))
    assert [p.name for p in every.libcachesim_policies] == list(POLICIES)


def test_registered_and_fails_fast_without_libcachesim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend is in BACKENDS; without libcachesim it refuses to build (before any
    work), naming the install command, unless no libCacheSim policy is asked for."""
    assert BACKENDS.get("eviction_landscape") is EvictionLandscapeBackend
    monkeypatch.setitem(sys.modules, "libcachesim", None)
    with pytest.raises(CacheSimMissing, match=r"pip install -e '\.\[cachesim\]'"):
        EvictionLandscapeBackend(**_settings())
    EvictionLandscapeBackend(**_settings(libcachesim_policies=[]))


def test_the_app_exits_with_the_install_command_when_libcachesim_is_missing(
        tmp_path: Path) -> None:
    """``python -m moeexp +experiment=eviction_landscape`` without the extra: exit 2 and
    one line naming ``pip install -e '.[cachesim]'``, before any model or trace work."""
    code = ("import sys\n"
            "sys.modules['libcachesim'] = None\n"
            "from moeexp.__main__ import main\n"
            "sys.argv = ['moeexp', '+experiment=eviction_landscape', 'logger=none',\n"
            "            'hydra.run.dir=' + sys.argv[1]]\n"
            "main()\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=REPO_DIR)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "pip install -e '.[cachesim]'" in text
    assert "recording trace" not in text and "loading model" not in text


def test_experiment_composes_and_validates() -> None:
    """+experiment=eviction_landscape picks the backend group (conf/backend), names the
    sources (the run's is the model's name) and validates; backend=eviction_landscape alone
    composes too (the backend is registered by moeexp.backends, wrapped lazily)."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["+experiment=eviction_landscape"])
        alone = compose(config_name="config", overrides=["backend=eviction_landscape"])
    assert validate(alone).backend.name == "eviction_landscape"
    spec = validate(cfg)
    assert spec.backend.name == "eviction_landscape" and spec.system.name == "eviction_landscape"
    s = LandscapeSettings.from_mapping(spec.backend.kwargs)
    assert [x.name for x in s.sources] == ["tiny", "synthetic_mixtral", "gpt_oss_20b"]
    assert min(s.capacities) == 0.05 and max(s.capacities) == 0.75


def test_run_writes_the_table_and_metrics(tmp_path: Path) -> None:
    """summary.csv (a row per cell), summary.md (a table per source) and metrics whose
    agreement checks are exactly 0 on the run's own (synthetic) trace."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    tr = random_trace(num_layers=4, num_experts=8, num_requests=10, output_len=12, seed=5)
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), tr.dims)
    ctx = BackendContext(loaded=None, prompts=[], trace=tr.split("test"), predictor=None,
                         cache=None, cost=cost, seed=0, store=tr.split("store"),
                         run_dir=tmp_path)
    backend = EvictionLandscapeBackend(**_settings(
        sources=[{"name": "own", "kind": "run"}, SYN]))
    res = backend.run(ctx)
    df = pd.read_csv(tmp_path / "summary.csv")
    assert set(df["source"]) == {"own", "syn"} and len(df) == 2 * 2 * (2 + 1 + 2 * 2)
    md = (tmp_path / "summary.md").read_text()
    assert "## own" in md and "## syn" in md and "lcs.LIRS (native)" in md
    m = res.metrics
    for src in ("own", "syn"):
        assert m[f"{src}_lru_agreement_max_abs"] == 0.0
        assert m[f"{src}_belady_agreement_max_abs"] == 0.0
        assert m[f"{src}_best_online_policy"] in {"lru", "lcs.LRU", "lcs.LIRS"}
    assert m["sources"] == "own,syn"
