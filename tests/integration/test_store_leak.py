"""The authors' demo leak through the pipeline: it runs only when asked for by name, and
every row it writes is marked (``store_leak`` identity and the label); a clean run's rows
say ``store_leak`` empty and its store stays disjoint from its test split."""

from __future__ import annotations

import json
import logging

import pytest
from hydra import compose, initialize_config_dir

from moeexp import pipeline
from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR
from moeexp.tracking.run_dir import METRICS_FILE


@pytest.fixture
def cfg_of(small):
    """``cfg_of(*overrides)``: the composed config of a small FineMoE run, no logger."""
    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", [*small, "system=finemoe", "logger=none", *overrides])
    return make


def test_a_leaky_run_cannot_write_an_unmarked_row(tmp_path, cfg_of, monkeypatch, caplog):
    """The same run without and with dataset.store_leak=artifact_demo: the clean one fits
    on the store requests only and writes store_leak "" under its plain label; the leaky
    one fits on the test requests too, warns, and its metrics.json says store_leak
    artifact_demo under the label finemoe+store_leak=artifact_demo."""
    fitted: list[bool] = []  # per run: did the fitted store hold a test request
    real = pipeline.store_split

    def spy(trace, leak, label=""):
        out = real(trace, leak, label)
        test = {r.request_id for r in trace.requests if r.split == "test"}
        fitted.append(bool(test & {r.request_id for r in out.requests}))
        return out

    monkeypatch.setattr(pipeline, "store_split", spy)
    clean = pipeline.run(cfg_of(), run_dir=tmp_path / "clean")
    with caplog.at_level(logging.WARNING, logger="moeexp.pipeline"):
        leaky = pipeline.run(cfg_of("dataset.store_leak=artifact_demo"),
                             run_dir=tmp_path / "leaky")
    assert fitted == [False, True]
    assert clean["store_leak"] == "" and clean["label"] == "finemoe"
    assert leaky["store_leak"] == "artifact_demo"
    assert leaky["label"] == "finemoe+store_leak=artifact_demo"
    written = json.loads((tmp_path / "leaky" / METRICS_FILE).read_text())
    assert written["store_leak"] == "artifact_demo"
    assert written["label"] == "finemoe+store_leak=artifact_demo"
    assert "the authors' demo leak" in caplog.text


def test_a_misspelt_leak_is_refused_before_any_work(tmp_path, cfg_of, monkeypatch):
    """dataset.store_leak=artifact-demo (or true): ConfigError naming the valid values,
    raised before the model is loaded."""
    def boom(*_a, **_k):
        raise AssertionError("work started although the config is invalid")

    monkeypatch.setattr("moeexp.models.loading.load_model", boom)
    for value in ("artifact-demo", "true"):
        with pytest.raises(ConfigError, match="store_leak=.* refused.*artifact_demo"):
            pipeline.run(cfg_of(f"dataset.store_leak={value}"), run_dir=tmp_path / value)
