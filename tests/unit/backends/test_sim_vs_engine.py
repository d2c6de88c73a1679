"""moeexp.backends.sim_vs_engine's settings: the multi-member pass profile, the systems entries."""

from __future__ import annotations

import pytest

from moeexp.backends.sim_vs_engine import PASS_PROFILE, SimVsEngineSettings
from moeexp.errors import ConfigError


def test_pass_profile_defaults_to_the_full_sweep_and_replaces_given_keys() -> None:
    """null = PASS_PROFILE exactly (the calibration store's key is unchanged); a mapping
    replaces only its keys."""
    s = SimVsEngineSettings.from_mapping({"systems": ["deepspeed"]})
    assert s.passes == PASS_PROFILE
    small = SimVsEngineSettings.from_mapping(
        {"systems": ["deepspeed"], "pass_profile": {"batch_sizes": [1, 2, 4], "repeats": 1}})
    assert small.passes == {**PASS_PROFILE, "batch_sizes": [1, 2, 4], "repeats": 1}


@pytest.mark.parametrize("bad, match", [
    ({"members": [1, 2]}, "unknown key"),
    ({"batch_sizes": [4]}, "2 distinct batch_sizes"),
    ({"batch_sizes": [0, 2]}, "2 distinct batch_sizes"),
    ({"steps": 0}, "steps >= 1"),
    ({"prompt_fractions": [1.5]}, "prompt_fractions in"),
])
def test_a_bad_pass_profile_is_refused_before_any_work(bad, match) -> None:
    with pytest.raises(ConfigError, match=match):
        SimVsEngineSettings.from_mapping({"systems": ["deepspeed"], "pass_profile": bad})


def test_an_entry_cache_is_a_name_or_keys_over_the_systems_cache() -> None:
    """``systems`` entries: ``cache`` a conf/cache name, or a mapping of keys over the
    system's cache (an ablation such as ``{feed_gate: false}``), resolved as the run does."""
    from moeexp.backends.sim_vs_engine import SimVsEngineSettings, cache_choice
    from moeexp.systems import resolve_system

    s = SimVsEngineSettings.from_mapping({"systems": [
        "deepspeed", {"name": "static", "system": "deepspeed", "cache": "static"},
        {"name": "pip_nogate", "system": "prefetch_if_pays", "cache": {"feed_gate": False}}]})
    plain, static, nogate = s.systems
    assert cache_choice(plain, 0.25) == {"capacity": 0.25}
    assert cache_choice(static, 0.25) == {"capacity": 0.25, "name": "static"}
    _, ccfg, _ = resolve_system(nogate.system, nogate.predictor, cache_choice(nogate, 0.5))
    assert ccfg["name"] == "next_use" and ccfg["feed_gate"] is False
    assert ccfg["capacity"] == 0.5


def test_an_entry_execution_is_an_option_or_keys_over_one() -> None:
    """``execution: {name: balanced, late_to_cpu: true}`` passes the settings' checks and
    stays a mapping on the entry; a key its option lacks is refused before any work."""
    from moeexp.backends.sim_vs_engine import SimVsEngineSettings

    s = SimVsEngineSettings.from_mapping({"systems": [
        {"name": "pip_late", "system": "prefetch_if_pays_cpu",
         "execution": {"name": "balanced", "late_to_cpu": True}}]})
    assert s.systems[0].execution == {"name": "balanced", "late_to_cpu": True}
    with pytest.raises(ConfigError, match="no key"):
        SimVsEngineSettings.from_mapping({"systems": [
            {"name": "x", "system": "deepspeed", "execution": {"name": "balanced", "late": 1}}]})
