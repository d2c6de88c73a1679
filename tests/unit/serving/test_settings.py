"""moeexp.serving.settings: the budgets' validation, per-task SLO scales, the KV
reservation, the checks before serving and the not-applicable policies."""

from __future__ import annotations

import pytest

from moeexp.cache import CACHES
from moeexp.errors import ConfigError
from moeexp.schedulers.base import ServingProfile
from moeexp.serving.settings import (
    ServingSettings,
    check_budgets,
    kv_reservation_bytes,
    not_applicable_reason,
)

PROFILE = ServingProfile(output_len_by_task={"qa": 3.4, "chat": 10.5}, output_len_mean=6.0,
                         token_s=1e-3, expert_load_s=0.0)


@pytest.mark.parametrize(("settings", "match"), [
    (dict(max_batch_tokens=0), "max_batch_tokens"),
    (dict(max_batch_tokens=2.5), "max_batch_tokens"),
    (dict(max_running=0), "max_running"),
    (dict(slo_ttft_scale=0.0), "SLO must be > 0"),
    (dict(slo_e2e_scale=-1.0), "SLO must be > 0"),
    (dict(device_memory_gb=0.0), "device_memory_gb"),
    (dict(slo_task_scales={"chat": {"tpot": 2.0}}), "keys ttft, e2e"),
    (dict(slo_task_scales={"chat": {"e2e": 0.0}}), "values > 0"),
])
def test_bad_settings_fail_with_the_valid_range(settings, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        ServingSettings(**settings)


def test_every_bad_key_is_named_at_once() -> None:
    with pytest.raises(ConfigError, match="max_batch_tokens=0.*max_running=0"):
        ServingSettings(max_batch_tokens=0, max_running=0)


def test_a_task_scale_replaces_only_its_own_target() -> None:
    s = ServingSettings(slo_ttft_scale=5.0, slo_e2e_scale=4.0,
                        slo_task_scales={"chat": {"ttft": 2.0}})
    assert s.scales("chat") == (2.0, 4.0)
    assert s.scales("qa") == (5.0, 4.0)


def test_kv_reservation_is_prompt_plus_the_tasks_profiled_output() -> None:
    """10 B/token x round(5 + 3.4) = 80; an unseen task uses the overall mean (5 + 6)."""
    assert kv_reservation_bytes(10, 5, "qa", PROFILE) == 80
    assert kv_reservation_bytes(10, 5, "chat", PROFILE) == 160  # round(15.5) = 16 (to even)
    assert kv_reservation_bytes(10, 5, "unseen", PROFILE) == 110
    assert kv_reservation_bytes(0, 5, "qa", PROFILE) == 0


def test_budget_checks_name_the_numbers() -> None:
    """A first pass of 9 tokens under T_max = 8; a 120-byte reservation over a 100-byte
    pool (with where the pool comes from and what to raise); both fitting: no error."""
    s = ServingSettings(max_batch_tokens=8)
    with pytest.raises(ConfigError, match=r"below one prompt \(9 tokens\); T_max must be >= 9"):
        check_budgets([3, 9], [10, 10], s, pool=100)
    with pytest.raises(ConfigError, match=r"\(120 bytes\) exceeds the KV pool \(100 bytes = "
                                          r"memory - weights\); raise device_memory_gb"):
        check_budgets([3, 8], [120, 10], s, pool=100, pool_detail=" = memory - weights",
                      remedy="raise device_memory_gb")
    with pytest.raises(ConfigError, match=r"exceeds the KV pool \(100 bytes\)$"):
        check_budgets([3, 8], [120, 10], s, pool=100)
    check_budgets([8, 1], [100, 0], s, pool=100)


def test_a_policy_needing_the_future_is_not_applicable() -> None:
    kw = dict(capacity_slots=4, num_layers=2, num_experts=4)
    assert "not applicable" in str(not_applicable_reason(CACHES.build("belady", **kw)))
    assert not_applicable_reason(CACHES.build("lru", **kw)) is None
