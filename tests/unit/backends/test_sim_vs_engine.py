"""moeexp.backends.sim_vs_engine's settings: the multi-member pass profile."""

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
