"""Errors that can be known before any work are raised before any work: no weight read,
no prompt sampled, no trace recorded."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR


def _boom(*_a, **_k):
    raise AssertionError("work started before the error")


@pytest.mark.parametrize("system", ["promoe", "mixtral_offloading", "finemoe", "promoe_learned"])
def test_prefetch_distance_beyond_the_moe_layers_fails_before_the_load(tmp_path, monkeypatch,
                                                                        system):
    """model=tiny has 8 MoE layers: model.prefetch_distance=9 fails in the check with the
    model's dims from its config on the meta device, before load_model (promoe used to fail
    only at fit time, after the load, the sampling and the recording; mixtral_offloading's
    speculative gate at distance 8 did not fail at all)."""
    from moeexp import pipeline

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", ["logger=none", f"system={system}",
                                 "model.prefetch_distance=9"])
        if system == "mixtral_offloading":  # its bundle fixes d = 1: follow the model's
            cfg = compose("config", ["logger=none", f"system={system}",
                                     "model.prefetch_distance=9",
                                     "predictor.distance=${model.prefetch_distance}"])
    monkeypatch.setattr("moeexp.models.loading.load_model", _boom)
    monkeypatch.setattr(pipeline, "sample_prompts", _boom)
    with pytest.raises(ConfigError, match=r"distance.*(1\.\.[78]|valid: 1\.\.8)"):
        pipeline.run(cfg, run_dir=tmp_path / "run")
