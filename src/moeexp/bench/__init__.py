"""Benchmarks: every module ``moeexp.bench.<name>`` with a ``run() -> dict`` is one.

``python -m moeexp.bench [NAME ...]`` (``make bench``) imports each module, runs it, writes
``results/bench/<name>.json`` atomically (status, seconds, the returned numbers, the
environment) and prints a table. A module whose imports fail (a missing optional
dependency) or whose ``run`` raises :class:`BenchSkipped` is reported as skipped with the
reason; any other exception marks it failed and the runner exits non-zero.
"""

from __future__ import annotations

import importlib
import logging
import math
import pkgutil
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moeexp.atomic import write_json

log = logging.getLogger(__name__)

Status = Literal["ok", "skipped", "failed"]


class BenchSkipped(Exception):
    """Raised by a benchmark's ``run`` when it cannot run here (the message says why)."""


@dataclass
class Outcome:
    """One benchmark's result."""

    name: str
    status: Status
    seconds: float = 0.0
    results: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(the fastest of ``repeats`` wall-clock runs of ``fn`` in seconds, the last result):
    the best of a few runs is the least disturbed by other processes."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def discover() -> list[str]:
    """Names of the benchmark modules in this package (sorted)."""
    pkg = sys.modules[__name__]
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def env_info() -> dict[str, Any]:
    """The environment for the JSON files (``moeexp.tracking.env`` when available)."""
    try:
        from moeexp.tracking.env import collect_env

        return collect_env()
    except Exception as e:  # noqa: BLE001 - a broken optional helper must not stop benchmarks
        log.debug("tracking.env unavailable (%s); minimal environment", e)
        import numpy

        return {"python": sys.version.split()[0], "platform": platform.platform(),
                "numpy": numpy.__version__, "time_unix": time.time()}


def run_one(name: str) -> Outcome:
    """Import ``moeexp.bench.<name>`` and call its ``run()``."""
    try:
        mod = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        return Outcome(name, "skipped", reason=f"import failed: {e}")
    fn = getattr(mod, "run", None)
    if not callable(fn):
        return Outcome(name, "skipped", reason="module has no run()")
    t0 = time.perf_counter()
    try:
        results = fn()
    except BenchSkipped as e:
        return Outcome(name, "skipped", time.perf_counter() - t0, reason=str(e))
    except ImportError as e:
        return Outcome(name, "skipped", time.perf_counter() - t0, reason=f"missing dependency: {e}")
    except Exception as e:  # noqa: BLE001 - report and continue with the other benchmarks
        log.error("benchmark %s failed:\n%s", name, traceback.format_exc())
        return Outcome(name, "failed", time.perf_counter() - t0, reason=f"{type(e).__name__}: {e}")
    if not isinstance(results, dict):
        return Outcome(name, "failed", time.perf_counter() - t0,
                       reason=f"run() returned {type(results).__name__}, not a dict")
    return Outcome(name, "ok", time.perf_counter() - t0, results=results)


def write_outcome(out: Outcome, out_dir: Path, env: dict[str, Any]) -> Path:
    """``out_dir/<name>.json``, written atomically."""
    path = out_dir / f"{out.name}.json"
    write_json(path, {"name": out.name, "status": out.status, "seconds": out.seconds,
                      "reason": out.reason, "results": out.results, "env": env})
    return path


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``a.b.c`` keys (lists and strings kept as values)."""
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, f"{key}."))
        else:
            flat[key] = v
    return flat


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        s = str(v)
        return s if len(s) <= 48 else s[:45] + "..."
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:.4g}"


def format_table(outcomes: list[Outcome]) -> str:
    """One row per scalar result: benchmark | status | metric | value."""
    rows = [("benchmark", "status", "metric", "value")]
    for o in outcomes:
        if o.status != "ok":
            rows.append((o.name, o.status, "reason", o.reason))
            continue
        rows.append((o.name, o.status, "seconds", _fmt(o.seconds)))
        for k, v in flatten(o.results).items():
            if not isinstance(v, (list, tuple)):
                rows.append((o.name, "", k, _fmt(v)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_all(names: list[str] | None = None, out_dir: str | Path = "results/bench") -> list[Outcome]:
    """Run the named benchmarks (default: all), write their JSON files, return outcomes."""
    available = discover()
    todo = available if not names else names
    unknown = [n for n in todo if n not in available]
    if unknown:
        from moeexp.errors import ConfigError

        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}. Valid: {', '.join(available)}")
    env = env_info()
    outcomes = []
    for name in todo:
        log.info("benchmark %s ...", name)
        out = run_one(name)
        path = write_outcome(out, Path(out_dir), env)
        log.info("benchmark %s: %s (%.1f s) -> %s", name, out.status, out.seconds, path)
        outcomes.append(out)
    return outcomes
