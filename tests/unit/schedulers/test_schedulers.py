"""The scheduler registry, ``static`` and ``fcfs`` on hand-built views, and the wiring of
the ``scheduler`` group through the config (errors before any work)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from moeexp.backends import BACKENDS
from moeexp.config import validate
from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR, group_options
from moeexp.registry import GroupChoice
from moeexp.schedulers import SCHEDULERS, build_scheduler, check_scheduler
from moeexp.schedulers.base import SchedulerView, WaitingRequest


def _w(unit: int, tokens: int = 4, kv: int = 10) -> WaitingRequest:
    return WaitingRequest(unit=unit, task="", arrival_s=float(unit), first_tokens=tokens,
                          kv_bytes=kv, slo_ttft_s=1.0, slo_e2e_s=9.0)


def _view(waiting, *, running=(), remaining=None, tokens=100, places=10, kv=100):  # type: ignore[no-untyped-def]
    return SchedulerView(now_s=10.0, waiting=list(waiting), running=list(running),
                         remaining=len(waiting) if remaining is None else remaining,
                         tokens_left=tokens, running_left=places, kv_left_bytes=kv)


def test_every_yaml_is_registered_under_its_name() -> None:
    assert sorted(group_options("scheduler")) == SCHEDULERS.names() == ["emoe", "fcfs", "static"]


def test_fcfs_admits_the_fitting_prefix_in_arrival_order() -> None:
    """Room for 10 tokens: 4 + 4 fit, the third (4) does not, and the fourth (1 token),
    although it would fit, does not overtake it."""
    s = build_scheduler({"name": "fcfs"})
    assert s.admit(_view([_w(0), _w(1), _w(2), _w(3, tokens=1)], tokens=10)) == [0, 1]
    assert s.stats() == {"blocked_tokens": 1.0}
    assert s.admit(_view([_w(0, kv=60), _w(1, kv=60)])) == [0]
    assert s.admit(_view([_w(0), _w(1)], places=1)) == [0]
    assert s.stats() == {"blocked_memory": 1.0, "blocked_running": 1.0, "blocked_tokens": 1.0}


def test_static_waits_for_its_whole_batch_and_an_idle_server() -> None:
    s = build_scheduler({"name": "static"}, batch_size=3)
    assert s.admit(_view([_w(0), _w(1)], remaining=5)) == []  # third member not arrived
    assert s.admit(_view([_w(0), _w(1), _w(2), _w(3)], remaining=5)) == [0, 1, 2]
    assert s.admit(_view([_w(4)], remaining=1)) == [4]  # the last, short batch
    running = [object()]
    assert s.admit(_view([_w(5)], running=running, remaining=1)) == []  # type: ignore[list-item]


def test_unknown_name_and_key_fail_with_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'fcfs'.*emoe, fcfs, static"):
        check_scheduler(GroupChoice("fcfss", {}))
    with pytest.raises(ConfigError, match=r"restart_fractoin.*restart_fraction"):
        check_scheduler(GroupChoice("emoe", {"restart_fractoin": 0.1}))
    with pytest.raises(ConfigError, match="unknown key"):  # static's batch size is the backend's
        check_scheduler(GroupChoice("static", {"batch_size": 4}))


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("name", ["static", "fcfs", "emoe"])
def test_each_scheduler_composes_and_validates(name: str) -> None:
    spec = validate(_cfg(f"scheduler={name}", "logger=none"))
    assert spec.scheduler.name == name


def test_default_is_static() -> None:
    assert validate(_cfg("logger=none")).scheduler == GroupChoice("static", {})


@pytest.mark.parametrize(("overrides", "match"), [
    (["scheduler=fcfs", "backend=sim_vs_engine"], "serves static batches"),
    (["scheduler=fcfs", "backend=engine", "backend.arrival_rate=0"], "arrival_rate must be > 0"),
    (["scheduler=fcfs", "backend=engine", "backend.serving.max_running=0"], "max_running"),
    (["scheduler=fcfs", "backend=engine", "backend.replay_tokens=false"], "decodes greedily"),
    (["scheduler=fcfs", "backend=engine", "backend.serving.max_batch_tokens=10"],
     "below one prompt"),
    (["scheduler=emoe", "backend.batch_size=4"], "batch_size=1"),
    (["scheduler=fcfs", "backend.serving.max_batch_tokens=10"], "below one prompt"),
    (["scheduler=fcfs", "backend.serving.slo_e2e_scale=0"], "SLO must be > 0"),
    (["scheduler=fcfs", "backend.arrival_rate=-1"], "arrival_rate must be > 0"),
    (["scheduler=fcfs", "+backend.serving.max_batch_token=10"], "max_batch_tokens"),
    (["scheduler=fcfs", "+backend.serving.slo_task_scales.cooking.e2e=2"],
     "unknown task label.*'cooking'; valid: .*code"),
])
def test_misconfigurations_fail_before_work(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(*overrides, "logger=none"))


def test_engine_backend_takes_a_continuous_scheduler() -> None:
    """backend=engine with scheduler=fcfs|emoe validates (moeexp.engine.serve_continuous)."""
    for name in ("fcfs", "emoe"):
        spec = validate(_cfg(f"scheduler={name}", "backend=engine", "logger=none",
                             "backend.serving.max_running=4"))
        assert spec.scheduler.name == name and spec.backend.name == "engine"


def test_sim_backend_checks_its_serving_block() -> None:
    with pytest.raises(ConfigError, match="max_running"):
        BACKENDS.build("sim", serving={"max_running": 0})


def test_a_known_task_label_validates() -> None:
    spec = validate(_cfg("scheduler=emoe", "+backend.serving.slo_task_scales.code.e2e=2",
                         "logger=none"))
    assert spec.backend.kwargs["serving"]["slo_task_scales"] == {"code": {"e2e": 2}}
