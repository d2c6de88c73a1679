"""A run's label: the system, plus each group whose option differs from the bundle's."""

from __future__ import annotations

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.labels import (
    config_label,
    labelled_columns,
    register_resolver,
    run_label,
    table_labels,
)
from moeexp.systems import bundle_choices


def test_bundle_choices_in_file_order() -> None:
    assert bundle_choices("deepspeed") == {"predictor": "none", "cache": "lru"}
    assert bundle_choices("map_t") is None  # an experiment's own bundle: no conf/system file


@pytest.mark.parametrize(("choices", "label"), [
    ({"predictor": "none", "cache": "lru"}, "deepspeed"),
    ({"predictor": "none", "cache": "lfu"}, "deepspeed+cache=lfu"),
    ({"predictor": "hit_count", "cache": "lru"}, "deepspeed+predictor=hit_count"),
    ({"cache": "lfu", "predictor": "eam"}, "deepspeed+predictor=eam+cache=lfu"),  # file order
    ({"cache": None}, "deepspeed"),  # unknown: the bundle's
    ({"cache": "lfu", "scheduler": "fcfs"}, "deepspeed+cache=lfu"),  # not a bundle group
])
def test_run_label(choices, label) -> None:
    assert run_label("deepspeed", choices) == label


def test_a_system_without_a_bundle_file_is_its_own_label() -> None:
    assert run_label("map_t", {"predictor": "expert_map", "cache": "lfu"}) == "map_t"


def test_config_label_and_the_resolver() -> None:
    """``${moeexp.label:}`` (the sweep's job folders) is config_label of the whole config."""
    register_resolver()
    register_resolver()  # idempotent
    cfg = OmegaConf.create({"system": {"name": "finemoe"}, "predictor": {"name": "expert_map"},
                            "cache": {"name": "lru", "capacity": 0.5},
                            "hydra": {"sweep": {"subdir": "${hydra.job.num}_${moeexp.label:}"},
                                      "job": {"num": 3}}})
    assert config_label(cfg) == "finemoe+cache=lru"
    assert OmegaConf.select(cfg, "hydra.sweep.subdir") == "3_finemoe+cache=lru"
    assert config_label({"system": {"name": "oracle"}, "predictor": {"name": "oracle"},
                         "cache": {"name": "belady"}}) == "oracle"
    with pytest.raises(KeyError, match="system.name"):
        config_label({"cache": {"name": "lru"}})


def test_a_store_leak_run_is_labelled_leaky_whatever_else_it_ran() -> None:
    """dataset.store_leak set (the authors' demo leak): the label ends in
    +store_leak=<name>, for a system alone and after a changed group; null: no mark."""
    cfg = {"system": {"name": "finemoe"}, "predictor": {"name": "expert_map"},
           "cache": {"name": "finemoe"}, "dataset": {"store_leak": "artifact_demo"}}
    assert config_label(cfg) == "finemoe+store_leak=artifact_demo"
    cfg["cache"] = {"name": "lru"}
    assert config_label(OmegaConf.create(cfg)) == "finemoe+cache=lru+store_leak=artifact_demo"
    cfg["dataset"] = {"store_leak": None}
    assert config_label(cfg) == "finemoe+cache=lru"


def test_labelled_columns_and_table_labels() -> None:
    assert labelled_columns(["deepspeed", "map_t"]) == {
        "label", "system", "system.name", "predictor", "predictor.name", "cache", "cache.name"}
    assert labelled_columns(["map_t"]) == {"label", "system", "system.name"}
    df = pd.DataFrame({"system": ["deepspeed"], "label": ["deepspeed+cache=lfu"]})
    assert list(table_labels(df)) == ["deepspeed+cache=lfu"]
    assert list(table_labels(df.drop(columns="label"))) == ["deepspeed"]  # an older table
