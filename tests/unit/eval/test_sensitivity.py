"""eMoE's sensitivity profiling: randomised routing of one layer, profile -> predictor input."""

from __future__ import annotations

import pytest
import torch

from moeexp.errors import ConfigError
from moeexp.eval.sensitivity import SensitivityProfile, profile_sensitivity, randomized_routing


def test_randomized_routing_changes_only_that_layer(loaded):
    """Inside the block, layer 1's experts receive other indices than the router's own,
    K distinct experts per token; layer 0 is untouched; afterwards layer 1 routes
    as before (the hook is removed)."""
    layers = loaded.adapter.moe_layers()
    seen: dict[int, torch.Tensor] = {}
    # what the experts really receive: their forward's top_k_index argument
    hooks = [lay.experts.register_forward_pre_hook(
        lambda m, a, i=lay.index: seen.__setitem__(i, a[1].clone())) for lay in layers[:2]]
    ids = torch.arange(3, 40).reshape(1, -1)
    try:
        with torch.no_grad():
            loaded.model(input_ids=ids)
            base = dict(seen)
            with randomized_routing(loaded.adapter, 1, seed=0):
                out = loaded.model(input_ids=ids)
            rand = dict(seen)
            loaded.model(input_ids=ids)
            after = dict(seen)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(rand[0], base[0]) and not torch.equal(rand[1], base[1])
    assert all(len(set(row.tolist())) == rand[1].shape[1] for row in rand[1])
    assert torch.equal(after[1], base[1]) and torch.isfinite(out.logits).all()
    with pytest.raises(ConfigError, match="out of range"):
        with randomized_routing(loaded.adapter, 99):
            pass


def test_profile_feeds_the_emoe_predictor(loaded, prompts, dataset_cfg):
    """Token-agreement profile on 2 prompts per task: one row of L similarities in [0, 1]
    per task; layer 0 randomised changes the output (< 1); the sensitivity mapping has
    0 exactly where similarity > threshold, all-ones default, and the EMoE predictor
    accepts it; the override string parses as a Hydra override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from moeexp.predictors.emoe import EMoE

    prof = profile_sensitivity(loaded, prompts, dataset_cfg=dataset_cfg,
                               max_prompts_per_task=2, max_tokens=48, progress=False)
    L = loaded.adapter.num_layers
    tasks = {p.task for p in prompts}
    assert set(prof.similarity) == tasks and all(len(v) == L for v in prof.similarity.values())
    assert all(0 <= s <= 1 for v in prof.similarity.values() for s in v)
    assert all(v[0] < 1 for v in prof.similarity.values())
    sens = prof.sensitivity()
    for t, v in prof.similarity.items():
        assert sens[t] == [0 if s > 0.85 else 1 for s in v]
    assert sens["default"] == [1] * L
    ov = OverridesParser.create().parse_overrides([prof.override()])[0]
    assert ov.key_or_group == "predictor.sensitivity" and ov.value() == sens
    dims = type("D", (), {"num_layers": L, "num_experts": loaded.adapter.num_experts})()
    s_default, per_task = EMoE._parse_sensitivity(sens, dims.num_layers)
    assert s_default.tolist() == [1.0] * L and set(per_task) == tasks
    assert prof.markdown().count("\n") == len(tasks) + 2


def test_threshold_rule_and_bad_arguments(loaded, prompts):
    """similarity [0.9, 0.85, 0.2] at threshold 0.85 -> s = [0, 1, 1] (strictly above is
    insensitive); bad metric/threshold raise ConfigError."""
    p = SensitivityProfile({"code": [0.9, 0.85, 0.2]}, {"code": 1}, 0.85, "token", 3)
    assert p.sensitivity() == {"code": [0, 1, 1], "default": [1, 1, 1]}
    assert p.override() == "predictor.sensitivity={code:[0,1,1],default:[1,1,1]}"
    with pytest.raises(ConfigError, match="metric"):
        profile_sensitivity(loaded, prompts, metric="bleu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="threshold"):
        profile_sensitivity(loaded, prompts, threshold=1.5)


def _sensitive_run() -> tuple[dict, dict]:
    """(predictor.sensitivity, dataset) of emoe_serving's emoe_sensitive bundle, composed."""
    from omegaconf import OmegaConf
    from tests.unit.test_config import _compose

    cfg = _compose(["+experiment=emoe_serving", "+experiment/serving=emoe_sensitive"])
    return (OmegaConf.to_container(cfg.predictor.sensitivity),  # type: ignore[return-value]
            OmegaConf.to_container(cfg.dataset))


def test_shipped_profile_is_the_bundles_and_not_stale() -> None:
    """emoe_sensitive's map is the stored profile's (experiments/emoe_serving/
    sensitivity_profile.json) and that profile was measured on the labels the experiment
    gives (same classifier, same text): a classifier or dataset change fails here."""
    import json

    from moeexp.eval.sensitivity import check_profile_matches
    from moeexp.paths import REPO_DIR

    stored = json.loads((REPO_DIR / "experiments/emoe_serving/sensitivity_profile.json")
                        .read_text())
    sens, dataset = _sensitive_run()
    assert check_profile_matches(stored, sens, dataset) == []
    stale = check_profile_matches(stored, sens, {**dataset, "task_classifier": "keyword"})
    assert len(stale) == 1 and "task_classifier" in stale[0]
    other = check_profile_matches(stored, {**sens, "chat": [1] * 8}, dataset)
    assert len(other) == 1 and "differs" in other[0]
    assert check_profile_matches({**stored, "dataset": {**stored["dataset"], "lengths": "fixed"}},
                                 sens, dataset)[0].startswith("dataset.lengths")


def test_unknown_sensitivity_label_fails_validation() -> None:
    """A per-task map naming a label the run's classifier never gives fails validate()
    before any work, naming the valid labels; under keyword labels, logreg-only ones
    (summarisation, other) are unknown."""
    from tests.unit.test_config import _compose

    from moeexp.config import validate

    base = ["+experiment=emoe_serving", "+experiment/serving=emoe_sensitive"]
    validate(_compose(base))
    with pytest.raises(ConfigError, match="unknown task label.*'poetry'"):
        validate(_compose([*base, "+predictor.sensitivity.poetry=[1,1,1,1,1,1,1,1]"]))
    with pytest.raises(ConfigError, match="'other', 'summarisation'"):
        validate(_compose([*base, "dataset.task_classifier=keyword",
                           "backend.serving.slo_task_scales={}"]))


def test_dataset_sets_parse_yaml_values() -> None:
    from moeexp.eval.sensitivity import _dataset_sets

    assert _dataset_sets(["lengths=natural", "max_input_len=256", "template=null"]) == {
        "lengths": "natural", "max_input_len": 256, "template": None}
    with pytest.raises(ConfigError, match="key=value"):
        _dataset_sets(["lengths"])
