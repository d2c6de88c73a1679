"""The benchmark runner: discovery, skipped/failed reporting, atomic JSON, the table."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import moeexp.bench as bench
from moeexp.errors import ConfigError


def _fake(monkeypatch: pytest.MonkeyPatch, name: str, run) -> None:  # type: ignore[no-untyped-def]
    mod = types.ModuleType(f"moeexp.bench.{name}")
    if run is not None:
        mod.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"moeexp.bench.{name}", mod)


def test_discovers_the_simulator_benchmark() -> None:
    assert "simulator" in bench.discover()


def test_outcomes_ok_skipped_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run() returning a dict is ok; BenchSkipped or an ImportError inside run() is
    skipped with the reason; any other exception is failed; a module without run() is
    skipped; a module whose import fails is skipped."""
    _fake(monkeypatch, "fake_ok", lambda: {"speed": {"x": 1.5}})
    _fake(monkeypatch, "fake_skip", lambda: (_ for _ in ()).throw(bench.BenchSkipped("no GPU")))
    _fake(monkeypatch, "fake_dep", lambda: __import__("not_a_real_package_xyz"))
    _fake(monkeypatch, "fake_fail", lambda: 1 / 0)
    _fake(monkeypatch, "fake_norun", None)
    assert bench.run_one("fake_ok").status == "ok"
    assert (bench.run_one("fake_skip").status, bench.run_one("fake_skip").reason) == ("skipped", "no GPU")
    assert bench.run_one("fake_dep").status == "skipped"
    failed = bench.run_one("fake_fail")
    assert failed.status == "failed" and "ZeroDivisionError" in failed.reason
    assert bench.run_one("fake_norun").status == "skipped"
    assert bench.run_one("definitely_missing_module").status == "skipped"


def test_json_and_table(tmp_path: Path) -> None:
    """The JSON holds status, results and env; the table lists flattened scalars."""
    out = bench.Outcome("demo", "ok", 1.25, {"sys": {"lru": {"accesses_per_s": 123456.7}}})
    path = bench.write_outcome(out, tmp_path, {"python": "3"})
    data = json.loads(path.read_text())
    assert data["status"] == "ok" and data["results"]["sys"]["lru"]["accesses_per_s"] == 123456.7
    assert data["env"] == {"python": "3"}
    table = bench.format_table([out, bench.Outcome("other", "skipped", reason="missing torch")])
    assert "sys.lru.accesses_per_s" in table and "1.235e+05" in table
    assert "missing torch" in table


def test_unknown_benchmark_name() -> None:
    with pytest.raises(ConfigError, match="unknown benchmark"):
        bench.run_all(["nope"], "/tmp/unused")
